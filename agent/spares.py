"""Warm spares: processes of the job's command that have imported torch/DeepSpeed and built the
model, and wait on the progress channel for a rank.

Why: a restarted worker spends seconds before its first step (≈1 s importing torch, ≈1.3 s more
for DeepSpeed, then the engine build). A spare has paid that already, so a lost local rank is
taken over in the time of a process-group set-up. The pool only keeps the books; processes are
started by the agent's main loop (their parent-death signal is tied to the creating thread).
A spare that exits on its own is replaced after a back-off that doubles with each early exit, so
a command that cannot run as a spare does not spin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from stalwart.agent.workers import Worker, stop_workers

log = logging.getLogger(__name__)
BACKOFF_FIRST = 0.5  # seconds before replacing a spare that exited on its own
BACKOFF_MAX = 60.0
STEADY = 60.0  # a spare that lived this long before exiting resets the back-off


@dataclass(frozen=True)
class SpareInfo:
    pid: int
    ready: bool  # connected to the agent
    age: float
    warm: bool = False  # done warming up (model and engine built): it only waits for a rank


class SparePool:
    """Up to ``wanted`` spares; :meth:`take` hands out the oldest warm one, else the oldest
    connected one (still warming, but further along than a new process)."""

    def __init__(self, wanted: int, start: Callable[[], Worker], *, node: str = "") -> None:
        self.wanted = wanted
        self._start = start
        self._node = node
        self._lock = threading.Lock()
        self._spares: dict[int, Worker] = {}
        self._ready: set[int] = set()
        self._warm: set[int] = set()
        self._failures = 0
        self._not_before = 0.0
        self.disabled = ""  # why no more spares are started ("" while they are)
        self.paused = False  # draining: no spares, none started

    def maintain(self, now: float | None = None) -> list[Worker]:
        """Start the spares that are missing (main loop only); returns those started."""
        now = time.monotonic() if now is None else now
        started: list[Worker] = []
        while True:
            with self._lock:
                if (self.disabled or self.paused or len(self._spares) >= self.wanted or now < self._not_before):
                    return started
            worker = self._start()
            with self._lock:
                if worker.running:
                    self._spares[worker.pid] = worker
            started.append(worker)

    def add(self, worker: Worker) -> None:
        """Take a running spare this agent did not start (one the agent before left)."""
        with self._lock:
            if worker.running:
                self._spares[worker.pid] = worker

    def workers(self) -> list[Worker]:
        """The spares, running or not yet booked as exited (oldest first)."""
        with self._lock:
            return sorted(self._spares.values(), key=lambda w: w.started_at)

    def ready(self, pid: int) -> bool:
        """A spare connected and waits for an assignment; False if ``pid`` is not one of ours."""
        with self._lock:
            if pid not in self._spares:
                return False
            self._ready.add(pid)
            return True

    def warm(self, pid: int) -> bool:
        """A connected spare finished warming up; False if ``pid`` is not one of ours."""
        with self._lock:
            if pid not in self._spares:
                return False
            self._ready.add(pid)
            self._warm.add(pid)
            return True

    def is_spare(self, pid: int) -> bool:
        with self._lock:
            return pid in self._spares

    def take(self) -> Worker | None:
        """The oldest ready, running spare, out of the pool (the caller makes it a worker)."""
        with self._lock:
            ready = [w for pid, w in self._spares.items() if pid in self._ready and w.running and not w.stopping]
            if not ready:
                return None
            worker = min(ready, key=lambda w: (w.pid not in self._warm, w.started_at))
            worker.warming = worker.pid not in self._warm
            worker.restore_priority()  # it may have warmed niced (start_spare)
            del self._spares[worker.pid]
            self._ready.discard(worker.pid)
            self._warm.discard(worker.pid)
            return worker

    def exited(self, pid: int) -> bool:
        """Book a spare's exit; True if it was ours and exited on its own (a fault)."""
        now = time.monotonic()
        with self._lock:
            worker = self._spares.pop(pid, None)
            if worker is None:
                return False
            self._ready.discard(worker.pid)
            self._warm.discard(worker.pid)
            if worker.stopping:
                return False
            if now - worker.started_at >= STEADY:
                self._failures = 0
            self._failures += 1
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self._failures - 1))
            self._not_before = now + delay
        log.warning("agent %s: spare (pid %d) exited: %s; replacing it in %.1f s", self._node, worker.pid,
                    worker.exit.reason if worker.exit else "?", delay, extra={"node": self._node})
        return True

    def disable(self, why: str) -> list[Worker]:
        """Start no more spares (the command cannot run as one); returns the spares to stop."""
        with self._lock:
            self.disabled = why
            spares, self._spares, self._ready, self._warm = list(self._spares.values()), {}, set(), set()
        log.error("agent %s: no more warm spares: %s", self._node, why, extra={"node": self._node})
        return spares

    def stop_all(self, grace: float) -> None:
        with self._lock:
            spares, self._spares, self._ready, self._warm = list(self._spares.values()), {}, set(), set()
        if spares:
            stop_workers(spares, grace)

    def status(self, now: float | None = None) -> list[SpareInfo]:
        now = time.monotonic() if now is None else now
        with self._lock:
            return [SpareInfo(w.pid, pid in self._ready, now - w.started_at, pid in self._warm)
                    for pid, w in sorted(self._spares.items())]
