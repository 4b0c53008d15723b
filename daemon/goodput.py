"""The job's goodput as the leader sees it: pure bookkeeping, fed by the loop, no I/O, no clock.

Goodput follows the usual convention: *productive* time is the time the job's useful steps
would take at its typical step time, and goodput is productive time over elapsed time. A step
counts once, the first time the job's newest step passes it; steps trained again after a
rollback, start-up, re-forms and standstills are all badput. The typical step time is the median
of the recent per-step intervals between progress reports (reports are rate-limited, so each
interval averages several steps).

A member's fault (lost lease, fatal health, failed worker, drain) is remembered with the job's
newest step at that moment; its *cost* is known once the job passes that step again: the time
between, less the time the steps beyond it took. That is what ``stalwart status`` shows beside
each recent fault.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from stalwart.daemon.round_events import Drain, Event, Health, HealthVerdict, LeaseLost, WorkerFailed

__all__ = ["FaultCost", "Goodput", "GoodputTracker", "fault_kind"]

_INTERVALS = 21  # recent per-step intervals in the median
_FAULTS = 8  # recent faults kept for display


def fault_kind(event: Event, members: Collection[str]) -> str | None:
    """The kind of member fault ``event`` is (a label for metrics and status), or None.

    A planned leave (``left``) and an operator's drain (``drained``) are listed too: they are no
    node faults (nothing quarantines for them), but they cost the job training time all the same.
    """
    node = getattr(event, "node_id", None)
    if node is None or node not in members:
        return None
    if isinstance(event, LeaseLost):
        return "left" if event.planned else "lease-lost"
    if isinstance(event, HealthVerdict) and event.health is Health.FATAL:
        return "unhealthy"
    if isinstance(event, WorkerFailed):
        return "worker-failed"
    if isinstance(event, Drain):
        return "drained"
    return None


@dataclass
class FaultCost:
    """One member fault. ``cost`` is None until the job trained past ``step`` again."""

    node: str
    kind: str
    at: float  # the tracker's clock (the loop passes wall time)
    step: int
    cost: float | None = None
    observed: bool = False  # the caller has counted the cost (in a histogram)


@dataclass(frozen=True)
class Goodput:
    productive: float  # seconds
    elapsed: float  # seconds since the job's first round opened
    step: int  # the newest step the job reached
    step_time: float | None  # typical seconds per step
    faults: tuple[FaultCost, ...]

    @property
    def ratio(self) -> float | None:
        return min(1.0, self.productive / self.elapsed) if self.elapsed > 0 else None


class GoodputTracker:
    """Feed it :meth:`started` once, then :meth:`progress` and :meth:`fault` as they happen, with
    a non-decreasing clock; :meth:`summary` at any time. ``resume`` carries a previous leader's
    totals over (from the status record), so the job's goodput survives a change of leader."""

    def __init__(self) -> None:
        self.started_at: float | None = None
        self.step = -1
        self.productive = 0.0
        self._elapsed_before = 0.0
        self._last: tuple[float, int] | None = None  # (time, step) of the newest progress seen
        self._intervals: deque[float] = deque(maxlen=_INTERVALS)
        self.faults: deque[FaultCost] = deque(maxlen=_FAULTS)
        self.new_costs = 0  # faults whose cost became known since the caller last reset this

    def resume(self, productive: float, elapsed: float, step: int, now: float) -> None:
        self.productive, self._elapsed_before, self.step = max(0.0, productive), max(0.0, elapsed), step
        self.started_at = now

    def started(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now

    def step_time(self) -> float | None:
        return statistics.median(self._intervals) if self._intervals else None

    def progress(self, step: int, now: float) -> None:
        """A member reported ``step`` (members report the same steps; repeats are ignored)."""
        self.started(now)
        last = self._last
        if last is not None and step > last[1] and now > last[0]:
            self._intervals.append((now - last[0]) / (step - last[1]))
        if last is None or step > last[1]:
            self._last = (now, step)
        if step <= self.step:
            return
        typical = self.step_time()
        if self.step >= 0 and typical is not None:
            self.productive += (step - self.step) * typical
        for f in self.faults:
            if f.cost is None and step > f.step:
                beyond = (step - f.step) * (typical or 0.0)
                f.cost = max(0.0, now - f.at - beyond)
                self.new_costs += 1
        self.step = step

    def round_opened(self, now: float) -> None:
        """A new world: its members may restart from an older step; measure intervals afresh."""
        self.started(now)
        self._last = None

    def fault(self, node: str, kind: str, now: float) -> None:
        self.started(now)
        self.faults.append(FaultCost(node, kind, now, self.step))

    def summary(self, now: float) -> Goodput:
        elapsed = self._elapsed_before + (now - self.started_at if self.started_at is not None else 0.0)
        return Goodput(self.productive, elapsed, self.step, self.step_time(), tuple(self.faults))
