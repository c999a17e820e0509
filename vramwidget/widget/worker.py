"""The widget's background worker: one thread that runs the slow part of an update (the exact
caching-allocator replays, a traced model, the fit map, the suggestions) after the update
has already shown a provisional answer.

Latest request wins: :meth:`Worker.submit` replaces a job that has not started yet, so
dragging a slider never piles up work; a job that is running checks
:meth:`Worker.current` between its steps and stops when a newer request has come in.
A job's exceptions are the job's business (the calculator turns them into the error
banner); the thread itself never dies of one.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple


class Worker:
    """One daemon thread running the latest submitted job."""

    def __init__(self, name: str = "vramwidget-worker") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._job: Optional[Tuple[int, Callable[[], Any]]] = None
        self._running: Optional[int] = None
        self._token = 0
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[[], Any]) -> int:
        """Queue ``fn`` in place of any job not yet started; returns its token."""
        with self._cv:
            if self._closed:
                return self._token
            self._token += 1
            self._job = (self._token, fn)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify_all()
            return self._token

    def cancel(self) -> None:
        """Drop the job not yet started and mark a running one as stale."""
        with self._cv:
            self._token += 1
            if self._job is not None:
                self._job = None
                self._cv.notify_all()   # only wait() can be waiting on it: the thread is not

    def current(self, token: int) -> bool:
        """Whether ``token`` is still the latest request (a running job checks this)."""
        return token == self._token and not self._closed

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._job is not None or self._running is not None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until no job is queued or running; False when ``timeout`` ran out first."""
        if self._thread is not None and threading.current_thread() is self._thread:
            return True   # a job waiting on itself would never return
        with self._cv:
            return self._cv.wait_for(lambda: self._job is None and self._running is None, timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._job = None
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._job is not None or self._closed)
                if self._closed:
                    self._running = None
                    self._cv.notify_all()
                    return
                assert self._job is not None
                token, fn = self._job
                self._job = None
                self._running = token
            try:
                fn()
            except BaseException:   # noqa: BLE001 - the job reports its own errors; never die
                pass
            finally:
                with self._cv:
                    self._running = None
                    self._cv.notify_all()
