"""The suggestions panel: when the setup does not fit the chosen GPU, the changes that would
make it fit (:func:`vramwidget.fit.solver.suggestions`, tens of milliseconds to seconds), worked
out *after* the update, off the path that redraws the charts: by the widget's background
worker (:mod:`.worker`), once the exact verdict is known, so dragging a control stays fast."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..units import GIB


class SuggestionsPanel:
    """Suggestions: scheduled after an update, cached by setup, published as a trait."""

    def fit_suggestions(self) -> List[Any]:
        """:func:`vramwidget.fit.solver.suggestions` for the current training setup on the chosen
        GPU (every GPU of a parallel run is that kind), computed now if not already: ranked
        :class:`~vramwidget.fit.solver.Suggestion` objects, [] when it fits, there is no GPU or the
        mode is inference.  Also sets the ``suggestions`` trait."""
        with self._lock:
            job = self._sugg_job
            token = self._sugg_token
        if job is None:
            return []
        items = self._suggestions_for(job)
        self._publish_suggestions(token, items, "ready")
        return list(items)

    # -- suggestions, off the hot path -----------------------------------------------------
    def _suggestions_for(self, job: Tuple[Tuple, Any, Dict[str, Any]],
                         progress: Optional[Callable[[List[Any]], None]] = None,
                         stop: Optional[Callable[[], bool]] = None) -> List[Any]:
        """fit.suggestions for a job (key, arch, keyword arguments with gpu), cached;
        ``progress`` gets the single changes first, ``stop`` ends the search early
        (``fit.suggestions``'s: :class:`~vramwidget.fit.solver.SearchStopped`)."""
        from ..fit import solver as fit

        key, arch, kw = job
        with self._lock:
            hit = self._sugg_cache.get(key)
        if hit is not None:
            return hit
        kw = {k: v for k, v in kw.items() if k != "model"}
        gpu = kw.pop("gpu")
        kw.setdefault("max_gpus", self.max_gpus)
        items = fit.suggestions(arch, gpu, progress=progress, stop=stop, **kw)
        with self._lock:
            self._sugg_cache[key] = items
            if len(self._sugg_cache) > 16:
                self._sugg_cache.popitem(last=False)
        return items

    def _cancel_pending(self) -> None:
        pending = getattr(self, "_pending", None)   # None too when __init__ failed early
        self._pending = None
        if pending is not None:
            pending.cancel()

    def _run_suggestions(self, token: int, job: Tuple[Tuple, Any, Dict[str, Any]]) -> None:
        if token != self._sugg_token:
            return   # the setup changed since: its own update scheduled its own

        def singles(items: List[Any]) -> None:
            # the single changes while the combinations are worked out ("partial"): the
            # first fixes come in a fraction of the time the whole list takes
            with self._lock:
                self._sugg_partial = (job[0], list(items))
            self._publish_suggestions(token, items, "partial")

        from ..allocator.collector import gc_paused
        from ..fit.solver import SearchStopped

        # published before the garbage collector runs again: its first collection after a
        # search walks every object the search cached (~0.5 s for a 7B model's suggestions)
        with gc_paused():
            try:
                # a newer update ends this search at its next candidate: what it built stays
                # cached, and the newer one's search starts without waiting for it
                items = self._suggestions_for(job, singles, stop=lambda: token != self._sugg_token)
            except SearchStopped:
                return
            except Exception as e:  # never raise out of a callback
                self._publish_suggestions(token, [], f"failed: {type(e).__name__}: {e}".splitlines()[0])
                return
            self._publish_suggestions(token, items, "ready")

    def _publish_suggestions(self, token: int, items: List[Any], status: str) -> None:
        with self._lock:
            if token != self._sugg_token:
                return
            with self.hold_sync():
                self.suggestions = [suggestion_dict(x) for x in items]
                self.suggestions_status = status


def suggestion_dict(x: Any) -> Dict[str, Any]:
    """A fit.Suggestion as the frontend shows it; ``changes`` are trait names and values."""
    d = x.to_dict()
    d["changes"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in x.changes.items()}
    d["cpu_per_node_gib"] = x.cpu_bytes_per_node / GIB
    return d
