"""Stall detection from step reports: a timeout learned from each worker's own step times.

A worker is stalled when no step completes within ``max(floor, factor × median recent step
time)`` of its last one. The first step after a start gets ``first_step`` seconds instead
(imports, process-group set-up and compilation take far longer than a step). A worker that is
frozen (stopped by a signal or a cgroup freezer) is stalled once it has been frozen for
``frozen_after`` seconds (or ``FROZEN_STEPS`` of its median step times, if longer; never more than
``floor``; a debugger's tracing stop is not frozen),
even within that allowance: a frozen process is not starting up, and not waiting for a peer, so
there is nothing to wait for.

Long before a stall, a worker is *quiet* once no step has come for ``max(quiet_floor,
quiet_steps × median)`` after one did: too soon to blame anyone, but the peer it waits on in a
collective may sit behind a cut link, which its agent then checks (``monitoring.py``). Pure: the caller
passes the clock (and what it saw of the process), so every rule is tested without sleeping.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# A stopped process makes no progress at all, and every peer waits for it meanwhile: the margin
# (one step, ``frozen_after`` at least) only lets a stop that is continued at once (job control) pass.
FROZEN_STEPS = 1.0


@dataclass(frozen=True)
class StallPolicy:
    floor: float = 10.0  # seconds: never declare a stall sooner than this after a step
    factor: float = 5.0  # times the median recent step time
    first_step: float = 300.0  # seconds allowed for the first step after a (re)start
    window: int = 50  # recent step times the median is taken over
    frozen_after: float = 0.3  # seconds a stopped process may stay stopped before it is stalled
    quiet_floor: float = 0.3  # seconds: a worker is quiet (worth a peer check) no sooner than this
    quiet_steps: float = 1.5  # ... nor sooner than this many median recent step times

    def __post_init__(self) -> None:
        if (self.floor <= 0 or self.factor < 1 or self.first_step <= 0 or self.window < 1 or self.frozen_after <= 0
                or self.quiet_floor <= 0 or self.quiet_steps < 1):
            raise ValueError(f"stall policy: need floor > 0, factor >= 1, first_step > 0, window >= 1, "
                             f"frozen_after > 0, quiet_floor > 0, quiet_steps >= 1; got {self}")


@dataclass
class _Worker:
    started: float
    last_step_at: float | None = None
    last_step: int = -1
    times: deque[float] = field(default_factory=deque)
    stalled: bool = False
    frozen_since: float | None = None


@dataclass(frozen=True)
class Stall:
    rank: int
    silent_for: float
    timeout: float
    last_step: int


class StallDetector:
    def __init__(self, policy: StallPolicy) -> None:
        self.policy = policy
        self._workers: dict[int, _Worker] = {}

    def started(self, rank: int, now: float) -> None:
        self._workers[rank] = _Worker(started=now, times=deque(maxlen=self.policy.window))

    def forget(self, rank: int) -> None:
        self._workers.pop(rank, None)

    def step(self, rank: int, step: int, step_time: float, now: float) -> None:
        w = self._workers.get(rank)
        if w is None:
            w = self._workers[rank] = _Worker(started=now, times=deque(maxlen=self.policy.window))
        if step <= w.last_step:
            return  # a repeated report is not progress
        if step_time > 0:
            w.times.append(step_time)
        w.last_step, w.last_step_at, w.stalled = step, now, False

    def frozen(self, rank: int, frozen: bool, now: float) -> None:
        """What the caller saw of the worker's process just now: stopped (frozen) or not."""
        w = self._workers.get(rank)
        if w is None:
            return
        if not frozen:
            w.frozen_since = None
        elif w.frozen_since is None:
            w.frozen_since = now

    def stalled(self, rank: int) -> bool:
        """Was this rank declared stalled, with no step since? (Such a worker is not kept in place.)"""
        w = self._workers.get(rank)
        return w is not None and w.stalled

    def timeout(self, rank: int) -> float:
        w = self._workers[rank]
        if w.last_step_at is None:
            return self.policy.first_step
        if not w.times:
            return self.policy.floor
        return max(self.policy.floor, self.policy.factor * statistics.median(w.times))

    def last_step(self, rank: int) -> int:
        """The rank's last step reported (-1: none, or an unknown rank)."""
        w = self._workers.get(rank)
        return w.last_step if w is not None else -1

    def typical(self, rank: int) -> float:
        """The rank's recent median step time (0: none yet)."""
        w = self._workers.get(rank)
        return statistics.median(w.times) if w is not None and w.times else 0.0

    def frozen_limit(self, rank: int) -> float:
        w = self._workers[rank]
        typical = FROZEN_STEPS * statistics.median(w.times) if w.times else 0.0
        return min(self.policy.floor, max(self.policy.frozen_after, typical))

    def quiet(self, now: float) -> list[tuple[int, int]]:
        """(rank, last step) of each worker that made a step and none since ``max(quiet_floor,
        quiet_steps × its median step time)``, not yet stalled (see the module docstring)."""
        out = []
        for rank, w in self._workers.items():
            if w.last_step_at is None or w.stalled:
                continue
            typical = statistics.median(w.times) if w.times else 0.0
            if now - w.last_step_at > max(self.policy.quiet_floor, self.policy.quiet_steps * typical):
                out.append((rank, w.last_step))
        return out

    def check(self, now: float) -> list[Stall]:
        """Workers that newly stalled since the last check (each stall is reported once)."""
        stalls = []
        for rank, w in self._workers.items():
            since = w.last_step_at if w.last_step_at is not None else w.started
            limit = self.timeout(rank)
            frozen_limit = self.frozen_limit(rank)
            if w.frozen_since is not None and now - w.frozen_since > frozen_limit:
                since, limit = w.frozen_since, min(limit, frozen_limit)
            if not w.stalled and now - since > limit:
                w.stalled = True
                stalls.append(Stall(rank, now - since, limit, w.last_step))
        return stalls
