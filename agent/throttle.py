"""Fault injection: slow one worker down by a factor with SIGSTOP/SIGCONT.

Why signals: they work the same for any process (CPU or GPU bound, or sleeping to stand in for a
device) and need no privileges beyond signalling our own child. The worker runs for a random
``U(0.5, 1.5) × period`` seconds, then is stopped for ``(factor - 1)`` times that, so it gets
``1/factor`` of the wall time and whatever it is doing takes ``factor`` × as long. Why random:
with a fixed cycle whose length is near the step time, the stops can lock into the phase where
the worker waits in a collective anyway, and slow nothing.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)
DEFAULT_PERIOD = 0.02  # mean length of a run phase


@dataclass(frozen=True)
class ThrottleSpec:
    factor: float
    period: float = DEFAULT_PERIOD

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"slow-worker factor must be > 1 (got {self.factor:g})")
        if not 0.001 <= self.period <= 10.0:
            raise ValueError(f"slow-worker period must be within [0.001, 10] s (got {self.period:g})")


class Throttle:
    """Stops and continues the process group ``pgid`` on a thread until :meth:`stop` or until the
    group is gone. The group is always left running (SIGCONT) when the throttle ends."""

    def __init__(self, pgid: int, spec: ThrottleSpec, *, rank: int = -1) -> None:
        self.pgid = pgid
        self.spec = spec
        self.rank = rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"throttle-{pgid}")
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _signal(self, sig: signal.Signals) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _run(self) -> None:
        rng = random.Random(self.pgid)
        try:
            while not self._stop.wait(run := self.spec.period * rng.uniform(0.5, 1.5)):
                if not self._signal(signal.SIGSTOP):
                    break  # the worker exited
                stopped = self._stop.wait((self.spec.factor - 1.0) * run)
                if not self._signal(signal.SIGCONT) or stopped:
                    break
        finally:
            self._signal(signal.SIGCONT)
        log.info("throttle of rank %d (pgid %d) ended", self.rank, self.pgid, extra={"rank": self.rank})

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

