"""The straggler rules written the simple way (every median recomputed from scratch, O(n² log n)
a pass): the oracle that the daemon's and the agent's fast detectors are compared with."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from stalwart.daemon.stragglers import StragglerPolicy, Verdict

K = TypeVar("K")


@dataclass
class _Node:
    busy: float = 0.0
    step: int = -1
    over: int = 0
    since_step: int = 0


@dataclass
class SimpleStragglerDetector:
    policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    nodes: dict[str, _Node] = field(default_factory=dict)
    members: frozenset[str] = frozenset()

    def reset(self, members: Iterable[str]) -> None:
        self.members = frozenset(members)
        self.nodes = {}

    def report(self, node_id: str, step: int, busy_time: float) -> None:
        if node_id not in self.members:
            return
        node = self.nodes.setdefault(node_id, _Node())
        if step <= node.step:
            return
        node.step, node.busy = step, busy_time
        median = self.others_median(node_id)
        if median is not None and busy_time > self.policy.factor * median:
            if node.over == 0:
                node.since_step = step
            node.over += 1
        else:
            node.over = 0

    def others_median(self, node_id: str) -> float | None:
        others = [n.busy for k, n in self.nodes.items() if k != node_id and n.busy > 0]
        return statistics.median(others) if others else None

    def stragglers(self) -> list[Verdict]:
        out = []
        for node_id in sorted(self.nodes):
            node = self.nodes[node_id]
            median = self.others_median(node_id)
            if node.over >= self.policy.steps and median is not None:
                out.append(Verdict(node_id, node.busy, median, node.over, node.since_step))
        return out


def simple_slower_than_others(busy: Mapping[K, float], factor: float) -> list[K]:
    known = {k: v for k, v in busy.items() if v > 0}
    if len(known) < 2:
        return []
    return [k for k, v in known.items() if v > factor * statistics.median([w for j, w in known.items() if j != k])]
