"""Fault injection: slow one worker down by a factor with SIGSTOP/SIGCONT.

Why signals: they work the same for any process (CPU or GPU bound, any cgroup setup) and need no
privileges beyond signalling our own child. Why paced by the worker's own busy time rather than a
fixed duty cycle: a worker blocked in a collective is not busy, and a fixed cycle whose period is
near the step time can lock into that phase and slow nothing. The throttle stops the worker for
``(factor - 1)`` × the time its main thread was runnable (on a CPU or waiting for one, from
``/proc/PID/schedstat``) since the last look, so its compute takes ``factor`` × as long whatever
the phase and however busy the machine's CPUs are. Where that cannot be read it uses the
process's CPU time, and where that cannot be read either a fixed duty cycle (run ``period``,
stop ``(factor - 1) * period``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
DEFAULT_PERIOD = 0.01  # how often the throttle looks at the worker's busy time


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
        try:
            if _busy_seconds(self.pgid) is None:
                self._duty_cycle()
            else:
                self._paced_by_busy_time()
        finally:
            self._signal(signal.SIGCONT)
        log.info("throttle of rank %d (pgid %d) ended", self.rank, self.pgid, extra={"rank": self.rank})

    def _paced_by_busy_time(self) -> None:
        last = _busy_seconds(self.pgid)
        while not self._stop.wait(self.spec.period):
            now = _busy_seconds(self.pgid)
            if now is None or last is None:
                return  # the worker exited
            used, last = now - last, now
            if used <= 0:
                continue
            if not self._signal(signal.SIGSTOP):
                return
            stopped = self._stop.wait((self.spec.factor - 1.0) * used)
            if not self._signal(signal.SIGCONT) or stopped:
                return
            last = _busy_seconds(self.pgid)

    def _duty_cycle(self) -> None:
        run, pause = self.spec.period, (self.spec.factor - 1.0) * self.spec.period
        while not self._stop.wait(run):
            if not self._signal(signal.SIGSTOP):
                return  # the worker exited
            stopped = self._stop.wait(pause)
            if not self._signal(signal.SIGCONT) or stopped:
                return

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _cpu_seconds(pid: int) -> float | None:
    """CPU time used by process ``pid`` (all its threads), from its Linux process CPU clock
    (clock id ``(~pid << 3) | CPUCLOCK_SCHED``); None when it cannot be read (gone, or not Linux)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError):
        return None


def _busy_seconds(pid: int) -> float | None:
    """Seconds the main thread of ``pid`` was runnable (running, or waiting for a CPU), else its
    process CPU time; None when neither can be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
        return (int(on_cpu) + int(waiting)) / 1e9
    except (OSError, ValueError):
        return _cpu_seconds(pid)
