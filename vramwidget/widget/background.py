"""Background work of the Calculator: what an update leaves for later, and the two workers
that do it (:mod:`.worker`: one thread each, latest request wins).

An update pass (:meth:`BackgroundPanel._pass`, run under the calculator's lock) never
waits for slow work: where it meets some, it queues it (:meth:`_want`) and draws what it
has: a device total whose allocator replay is not cached yet, with its provisional reserve
(:meth:`_view`, ``Estimate.provisional_reserved_bytes``), the comparison as it was, no
fit map or largest batch yet; a model with no analytic family (``TracedModel``) raises
:class:`NotTracedYet` and the last estimate stays on screen.  Then:

* the first worker does the setup's own trace and exact replay (the refined verdict is
  published as soon as it is known), then the comparison's scenarios (rank order);
* the second worker does the searches that cannot stop half-way: the fit map, the
  largest batch, and the suggestions, so they never hold up the next refined verdict.

After each rank the outputs are recomputed (now from caches, milliseconds) and set inside
``hold_sync``; a newer update makes every queued or running job stop at its next step; an
exception becomes the error banner, never a traceback.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import VramError
from ..result import Estimate
from ..show.treemap import unit_box
from .state import TracedModel, run_estimate, shown
from .suggestions import suggestion_dict
from .training import YOUR_SETUP

_MISSING = object()

#: one piece of background work: (what it is, for the status line; the function; its rank)
Todo = Tuple[str, Callable[[], Any], int]
#: the ranks of background work, done in this order: the setup's own estimate (a trace) and
#: exact replay, the comparison's scenarios, the fit answers (fit map, largest batch)
_MAIN, _COMPARISON, _ANSWERS = 0, 1, 2


def traits_specs_same(calc: Any, mode: str) -> bool:
    """Whether the charts embedded now are the ones of ``mode`` (a mode switch re-embeds
    them, and then every dataset is sent anew)."""
    return calc.specs is calc._specs_for(mode)


class NotTracedYet(Exception):
    """The current setup's own estimate is not known yet (its model is being traced)."""

    def __init__(self, arch: Any) -> None:
        super().__init__(arch.name)
        self.arch = arch
        self.todo: List[Todo] = []


class BackgroundPanel:
    """The Calculator's background work: the update pass that queues it, the workers' jobs,
    and ``wait()``."""

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the background work for the current inputs is done (exact device
        totals, a trace, the fit map, the suggestions): then ``status`` is "idle" and every
        output trait is exact.  Returns the calculator."""
        self._worker.wait(timeout)
        self._suggester.wait(timeout)
        return self

    @staticmethod
    def _load_or_trace(load: Callable[[], Any], config: Callable[[], Tuple[str, Dict[str, Any]]],
                       hub_id: Optional[str]) -> Any:
        """The Architecture; where the model_type has no analytic family and the trace extra
        is installed, a :class:`~.state.TracedModel` (``estimate``'s ``backend="auto"``: the
        widget traces it in the background)."""
        try:
            return load()
        except VramError as e:
            if e.field != "model_type":
                raise
            from .. import trace

            if not trace.available():
                raise VramError(f"{e} (or trace it: {trace.INSTALL_HINT})", field="model_type") from None
            name, cfg = config()
            why = trace.refusal(cfg)
            if why:
                raise VramError(why, field="model") from None
            return TracedModel(name, cfg, hub_id)

    @property
    def _deferring(self) -> bool:
        """Inside an update pass (slow work is queued for the worker, not done here)."""
        return getattr(self._tl, "todo", None) is not None

    def _want(self, what: str, fn: Callable[[], Any], rank: int = _MAIN) -> bool:
        """Queue ``fn`` for the background; False outside an update pass (then the caller
        does the work itself)."""
        todo = getattr(self._tl, "todo", None)
        if todo is None:
            return False
        todo.append((what, fn, rank))
        return True

    def _view(self, est: Any) -> Any:
        """``est`` when its device total is known without a replay; else (inside an update)
        a copy drawn with the provisional reserve (``Estimate.provisional_reserved_bytes``
        and ``provisional_components``: the reserve's formula says it is provisional), and
        the exact replay queued for the worker."""
        if not self._deferring or not isinstance(est, Estimate) or est.reserved_exact:
            return est
        self._want("refining", lambda: est.reserved_bytes)
        return est.provisional_view()

    def _answer_later(self, key: Tuple, fn: Callable[[], Any]) -> Any:
        """A cached fit answer, else (inside an update) None and the search queued for the
        worker; outside an update it is computed now."""
        with self._lock:
            if key in self._answers:
                return self._answer(key, fn)
        if not self._deferring:
            return self._answer(key, fn)

        def work() -> None:
            try:
                value = fn()
            except VramError:
                value = None
            with self._lock:
                self._answers[key] = value
                if len(self._answers) > 32:
                    self._answers.popitem(last=False)

        self._want("refining", work, _ANSWERS)
        return None

    def _pass(self) -> Tuple[Tuple[Any, Any, Dict[str, Any], Any], List[Todo]]:
        """One update pass (:meth:`_compute`) with the slow work it met queued, not done."""
        self._tl.todo = []
        try:
            return self._compute(), self._tl.todo
        except NotTracedYet as later:
            later.todo = self._tl.todo
            raise
        finally:
            self._tl.todo = None

    def _background(self, token: int, todo: List[Todo]) -> None:
        """Run an update's slow work: on the worker threads, or here when ``suggestions_delay``
        is None."""
        if self.suggestions_delay is None:
            self._refine(token, todo)
        else:
            self._worker.submit(lambda: self._refine(token, todo))

    def _run_rounds(self, token: int, todo: List[Todo], ranks: Tuple[int, ...]) -> Optional[List[Todo]]:
        """Do the queued work of ``ranks``, lowest rank first, publishing the outputs after
        each rank (recomputed from caches under the lock); returns what is left (other
        ranks), or None when a newer update came in or the work failed (then the error
        banner says why: never a traceback)."""
        try:
            for _ in range(8):
                mine = [x for x in todo if x[2] in ranks]
                if not mine:
                    return todo
                low = min(x[2] for x in mine)
                for _what, fn, rank in mine:
                    if rank != low:
                        continue
                    if token != self._sugg_token:
                        return None
                    fn()
                with self._lock:
                    if token != self._sugg_token:
                        return None
                    outputs, todo = self._pass()
                    self._publish(token, outputs, todo)
            return todo
        except Exception as e:   # noqa: BLE001 - never a traceback: the banner says it
            with self._lock:
                if token == self._sugg_token:
                    if isinstance(e, VramError):
                        self._set_error(str(e), getattr(e, "field", None) or "")
                    else:
                        self._set_error(f"internal error ({type(e).__name__}: {e}); please report it", "")
            return None

    def _refine(self, token: int, todo: List[Todo]) -> None:
        """The worker's job for update ``token``: the setup's own exact replay (or trace)
        first, so the refined verdict comes as soon as it can; then the comparison's
        scenarios.  What is left (the fit map, the largest batch, the suggestions: searches
        that cannot stop half-way) goes to the second worker, so it never holds up the next
        update's refined verdict."""
        left = self._run_rounds(token, todo, (_MAIN, _COMPARISON))
        if left is None:
            return
        job = self._sugg_job
        cached = self._sugg_cache.get(job[0]) if job is not None else None
        if not left and (job is None or cached is not None):
            if cached is not None:    # cached after this update's pass said "computing"
                self._publish_suggestions(token, cached, "ready")
            return
        if self.suggestions_delay is None:
            self._answers_and_suggestions(token, left)
        else:
            self._suggester.submit(functools.partial(self._answers_and_suggestions, token, left))

    def _answers_and_suggestions(self, token: int, todo: List[Todo]) -> None:
        """The second worker's job: the fit answers, published; then, ``suggestions_delay``
        seconds later unless a newer update came in, the suggestions."""
        if self._run_rounds(token, todo, (_MAIN, _COMPARISON, _ANSWERS)) is None:
            return
        job = self._sugg_job
        if job is None or token != self._sugg_token:
            return
        with self._lock:
            cached = self._sugg_cache.get(job[0])
        if cached is not None:
            # worked out meanwhile by a run an older update started (its own publish was
            # dropped as stale): this update's outputs may still say "computing"
            self._publish_suggestions(token, cached, "ready")
            return
        if self.suggestions_delay:
            import time

            time.sleep(self.suggestions_delay)
        self._run_suggestions(token, job)

    def _cached_estimate(self, arch: Any, kind: str, kw: Dict[str, Any]) -> Any:
        """The estimate of one setup (``kind``: see :func:`_run`); the last few are kept
        (toggling back is free)."""
        key = self._key(kind, kw)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        args = {k: v for k, v in kw.items() if k != "model"}

        def work() -> Any:
            est = run_estimate(arch, kind, args)
            with self._lock:
                self._cache[key] = est
                if len(self._cache) > 40:   # the last 8 updates' setups and scenarios
                    self._cache.popitem(last=False)
            return est

        if isinstance(arch, TracedModel) and self._want(f"tracing {arch.name}", work):
            raise NotTracedYet(arch)   # seconds: the worker traces it
        return work()

    def _defer_box(self, arch: Any, name: str, kind: str, kw: Dict[str, Any]) -> bool:
        """Inside an update: queue a training scenario's box for the worker when it is not
        cached (its estimate, its exact replay, its layout); True when queued."""
        key = self._key(kind, kw)
        if kind != "train" or name == YOUR_SETUP or not self._deferring or key in self._boxes:
            return False

        def work() -> None:
            try:
                est = shown(self._cached_estimate(arch, kind, kw))
                est.reserved_bytes             # the exact replay, off the lock
                box: Any = unit_box(est, name)
            except VramError as e:              # the pass reports it as a left-out scenario
                box = e
            with self._lock:
                self._boxes[key] = box
                self._box_fits[key] = None
                self._box_notes[key] = ""

        self._want(f"tracing {arch.name}" if isinstance(arch, TracedModel) else "refining", work, _COMPARISON)
        return True

    def _publish(self, token: int, outputs: Tuple[Any, Any, Dict[str, Any], Any], todo: List[Todo]) -> None:
        """Set the output traits of a pass (under the lock), with the status its queued work
        leaves: "idle" when every figure is exact, else "refining" / "tracing"."""
        result, scenario_kw, traits, job = outputs
        self._rows_all = dict(self._rows_all, **traits["rows"])
        self._result = result
        self._estimate = shown(result)
        self._scenario_kw = scenario_kw
        self._sugg_job = job
        cached = self._sugg_cache.get(job[0]) if job else None
        partial = self._sugg_partial
        if job is None:
            traits.update(suggestions=[], suggestions_status="")
        elif cached is not None:
            traits.update(suggestions=[suggestion_dict(x) for x in cached], suggestions_status="ready")
        elif partial is not None and partial[0] == job[0]:
            # the single changes are known, the combinations are being worked out
            traits.update(suggestions=[suggestion_dict(x) for x in partial[1]], suggestions_status="partial")
        else:
            traits.update(suggestions=[], suggestions_status="computing")
        tracing = [w for w, _, _ in todo if w.startswith("tracing")]
        if tracing:
            traits.update(status="tracing", status_text=f"{tracing[0]}… (the comparison's scenarios)")
        elif todo:
            traits.update(status="refining", status_text="refining…")
        else:
            traits.update(status="idle", status_text="")
        if traits["specs"] is self.specs:
            del traits["specs"]    # unchanged: the frontend keeps its embedded views
        with self.hold_sync():
            for name, value in traits.items():
                setattr(self, name, value)
            self.error = ""
            self.error_field = ""

    def _answer(self, key: Tuple, fn) -> Any:
        """A fit answer (largest batch, longest context), cached by the setup it depends on."""
        hit = self._answers.get(key, _MISSING)
        if hit is not _MISSING:
            self._answers.move_to_end(key)
            return hit
        try:
            value = fn()
        except VramError:
            value = None
        self._answers[key] = value
        if len(self._answers) > 32:
            self._answers.popitem(last=False)
        return value
