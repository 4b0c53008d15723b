"""Fault injection: slow one worker down with a SIGSTOP/SIGCONT duty cycle.

Why a duty cycle rather than a lower CPU share: it works the same for any process (CPU or GPU
bound, any cgroup setup) and needs no privileges beyond signalling our own child. The worker runs
for ``period`` seconds, then is stopped for ``(factor - 1) * period``, so it gets ``1/factor`` of
its wall time.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)
DEFAULT_PERIOD = 0.05


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
        run, pause = self.spec.period, (self.spec.factor - 1.0) * self.spec.period
        try:
            while not self._stop.wait(run):
                if not self._signal(signal.SIGSTOP):
                    break  # the worker exited
                stopped = self._stop.wait(pause)
                if not self._signal(signal.SIGCONT) or stopped:
                    break
        finally:
            self._signal(signal.SIGCONT)
        log.info("throttle of rank %d (pgid %d) ended", self.rank, self.pgid, extra={"rank": self.rank})

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
