"""Straggler detection: pure logic, no I/O and no clock.

Why busy time: in synchronous data parallelism every rank's wall step time is the same (fast
ranks wait for the slow one inside the collectives), so the agents report each node's *busy*
time, wall step time minus time blocked in ``torch.distributed`` collectives (a recent median
of the node's slowest rank). A node whose busy time exceeds the median of the *other* members'
by ``factor`` for ``steps`` consecutive reports (each with a newer training step) is a straggler.
Comparing with the others' median, not the overall one, keeps a two-node world decidable.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["ExclusionPlan", "StragglerDetector", "StragglerPolicy", "Verdict", "median_without"]


@dataclass(frozen=True)
class StragglerPolicy:
    factor: float = 1.5
    steps: int = 5

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"straggler_factor must be > 1, got {self.factor!r}")
        if self.steps < 1:
            raise ValueError(f"straggler_steps must be at least 1, got {self.steps!r}")


@dataclass(frozen=True)
class Verdict:
    """A node found straggling: its busy time, the others' median, reports in a row, the step of
    the report that made it a straggler."""

    node_id: str
    busy_time: float
    others_median: float
    consecutive: int
    since_step: int


@dataclass
class _Node:
    busy: float = 0.0
    step: int = -1
    over: int = 0  # consecutive reports over the threshold
    since_step: int = 0


def median_without(ordered: Sequence[float], value: float | None) -> float | None:
    """``statistics.median`` of ``ordered`` (sorted) less one occurrence of ``value`` (None: less
    nothing), in O(log n): the ranks either side of the removed element are read directly.
    ``value`` must be in ``ordered`` when given. None when nothing is left."""
    cut = len(ordered) if value is None else bisect.bisect_left(ordered, value)
    n = len(ordered) - (value is not None)
    if n <= 0:
        return None

    def at(k: int) -> float:
        return ordered[k] if k < cut else ordered[k + 1]

    half = n // 2
    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2


@dataclass
class StragglerDetector:
    """Feed it the members' progress reports; ask :meth:`stragglers` after each batch.

    :meth:`reset` at every new round: busy times of different worlds are not comparable (the
    per-rank batch changes with the world size).

    Cost (the daemon calls both on every pass, at 10,000 members): the known busy times are kept
    sorted, so a report is a binary search plus a list insert and removal (O(log n) comparisons,
    a memmove of at most n pointers), and :meth:`stragglers` looks only at nodes with a run of
    slow reports long enough to count. It answers exactly what recomputing every median from
    scratch would (``tests/daemon`` keeps a property test against that simple form).
    """

    policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    _nodes: dict[str, _Node] = field(default_factory=dict)
    _members: frozenset[str] = frozenset()
    _sorted: list[float] = field(default_factory=list)  # busy times > 0 of every node that reported
    _long_runs: set[str] = field(default_factory=set)  # nodes with over >= policy.steps

    def reset(self, members: Iterable[str]) -> None:
        self._members = frozenset(members)
        self._nodes = {}
        self._sorted = []
        self._long_runs = set()

    def report(self, node_id: str, step: int, busy_time: float) -> None:
        """A member's progress report. A report without a newer step is a heartbeat and does not
        count; a report with an unknown busy time (0) breaks a run of slow reports."""
        if node_id not in self._members:
            return
        node = self._nodes.setdefault(node_id, _Node())
        if step <= node.step:
            return
        if node.busy > 0:
            del self._sorted[bisect.bisect_left(self._sorted, node.busy)]
        node.step, node.busy = step, busy_time
        median = median_without(self._sorted, None)  # the others': this node is out of the list now
        if busy_time > 0:
            bisect.insort(self._sorted, busy_time)
        if median is not None and busy_time > self.policy.factor * median:
            if node.over == 0:
                node.since_step = step
            node.over += 1
        else:
            node.over = 0
        (self._long_runs.add if node.over >= self.policy.steps else self._long_runs.discard)(node_id)

    def _others_median(self, node_id: str) -> float | None:
        node = self._nodes[node_id]
        return median_without(self._sorted, node.busy if node.busy > 0 else None)

    def stragglers(self) -> list[Verdict]:
        """The current stragglers, sorted by node id."""
        out = []
        for node_id in sorted(self._long_runs):
            node = self._nodes[node_id]
            median = self._others_median(node_id)
            if median is not None:
                out.append(Verdict(node_id, node.busy, median, node.over, node.since_step))
        return out

    def busy_times(self) -> dict[str, float]:
        return {k: n.busy for k, n in self._nodes.items()}


@dataclass
class ExclusionPlan:
    """``exclude_stragglers``: a straggler leaves the world at the first checkpoint committed
    after it was found, so the new round restores from that checkpoint and loses no work.

    :meth:`found` records the newest committed step when a straggler is first seen;
    :meth:`committed` returns the stragglers whose checkpoint has now come (each once).
    """

    waiting: dict[str, int | None] = field(default_factory=dict)  # node -> newest commit when found
    excluded: set[str] = field(default_factory=set)

    def found(self, node_id: str, committed_step: int | None) -> bool:
        """True the first time ``node_id`` is seen (it now waits for a checkpoint)."""
        if node_id in self.waiting or node_id in self.excluded:
            return False
        self.waiting[node_id] = committed_step
        return True

    def recovered(self, node_id: str) -> None:
        """The node is no longer a straggler before its checkpoint came: nothing to do."""
        self.waiting.pop(node_id, None)

    def committed(self, step: int) -> list[str]:
        due = sorted(n for n, before in self.waiting.items() if before is None or step > before)
        for node_id in due:
            del self.waiting[node_id]
            self.excluded.add(node_id)
        return due
