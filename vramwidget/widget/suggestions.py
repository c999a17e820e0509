"""The suggestions panel: when the setup does not fit the chosen GPU, the changes that would
make it fit (:func:`vramwidget.fit.suggestions`, tens of milliseconds), worked out *after*
the update, off the path that redraws the charts: on the kernel's event loop shortly after
the last change (or a timer thread where no loop runs), so dragging a control stays fast."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Dict, List, Tuple

from ..units import GIB


class SuggestionsPanel:
    """Suggestions: scheduled after an update, cached by setup, published as a trait."""

    def fit_suggestions(self) -> List[Any]:
        """:func:`vramwidget.fit.suggestions` for the current training setup on the chosen
        GPU (every GPU of a parallel run is that kind), computed now if not already: ranked
        :class:`~vramwidget.fit.Suggestion` objects, [] when it fits, there is no GPU or the
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
    def _suggestions_for(self, job: Tuple[Tuple, Any, Dict[str, Any]]) -> List[Any]:
        """fit.suggestions for a job (key, arch, keyword arguments with gpu), cached."""
        from .. import fit

        key, arch, kw = job
        with self._lock:
            hit = self._sugg_cache.get(key)
        if hit is not None:
            return hit
        kw = {k: v for k, v in kw.items() if k != "model"}
        gpu = kw.pop("gpu")
        kw.setdefault("max_gpus", self.max_gpus)
        items = fit.suggestions(arch, gpu, **kw)
        with self._lock:
            self._sugg_cache[key] = items
            if len(self._sugg_cache) > 16:
                self._sugg_cache.popitem(last=False)
        return items

    def _schedule_suggestions(self, token: int, job: Tuple[Tuple, Any, Dict[str, Any]]) -> None:
        """Work out the suggestions ``suggestions_delay`` seconds after the last change: on
        the running event loop (the Jupyter kernel's: the same thread, between messages),
        else on a timer thread; at once when the delay is None."""
        delay = self.suggestions_delay
        if delay is None:
            self._run_suggestions(token, job)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._pending = loop.call_later(delay, self._run_suggestions, token, job)
        else:
            timer = threading.Timer(delay, self._run_suggestions, (token, job))
            timer.daemon = True
            self._pending = timer
            timer.start()

    def _defer(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` after the update the way suggestions are (``suggestions_delay``
        seconds later on the event loop or a timer thread; at once when it is None)."""
        delay = self.suggestions_delay
        if delay is None:
            fn(*args)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            loop.call_later(delay, fn, *args)
        else:
            timer = threading.Timer(delay, fn, args)
            timer.daemon = True
            timer.start()

    def _cancel_pending(self) -> None:
        pending = getattr(self, "_pending", None)   # None too when __init__ failed early
        self._pending = None
        if pending is not None:
            pending.cancel()

    def _run_suggestions(self, token: int, job: Tuple[Tuple, Any, Dict[str, Any]]) -> None:
        if token != self._sugg_token:
            return   # the setup changed since: its own update scheduled its own
        try:
            items = self._suggestions_for(job)
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
