"""The node agent's records of its round and workers (plain data, no I/O).

:class:`NodeState` is the one mutable record every part of :class:`~stalwart.agent.node.NodeAgent`
reads and changes: the round applied and the newest one seen, the worker group, exits and
findings, progress per rank, re-forms not yet acknowledged and the replacing/warming clocks.
They are kept apart from the agent's code so that each of its parts can import them.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from stalwart.agent.health import Finding
from stalwart.agent.workers import WorkerExit, WorkerGroup
from stalwart.proto import records_pb2


@dataclass
class Progress:
    """One rank's latest step report, as the monitor and the status read it."""

    step: int = -1
    step_time: float = 0.0
    at: float = 0.0
    local_rank: int = -1
    busy: deque[float] = field(default_factory=deque)  # recent busy times (0: unknown)

    def busy_median(self) -> float:
        known = [b for b in self.busy if b > 0]
        return statistics.median(known) if known else 0.0


@dataclass(frozen=True)
class PendingReform:
    """A Reform sent to a worker (kept or spare) and not acknowledged yet."""

    round: int
    local_rank: int
    rank: int
    sent: float  # monotonic
    deadline: float
    joining: bool = False  # the worker said it left its old world and waits for its new peers
    warming: bool = False  # a spare given its rank before it was warm, and not warm yet


@dataclass
class NodeState:
    """What the agent knows of its round, its workers and their reports: shared by its threads,
    changed under ``NodeAgent._lock``."""

    round: records_pb2.RoundRecord | None = None
    group: WorkerGroup | None = None
    exits: list[WorkerExit] = field(default_factory=list)
    worker_findings: list[Finding] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    lost_peers: set[str] = field(default_factory=set)  # members of lost_peers_round our workers lost
    lost_peers_round: int = 0
    cut_check_round: int = 0  # the last round whose ring neighbours a stalled or joining worker had checked
    cut_quiet_checked: tuple[int, int] = (0, -1)  # (round, last step) of the newest quiet worker's check
    progress: dict[int, Progress] = field(default_factory=dict)
    draining: bool = False
    restarts: int = 0
    committed_step: int | None = None  # newest checkpoint a worker reported committed
    gave_up: str = ""  # why the job gave up (a worker exited with EXIT_DIVERGED); cleared by a new round
    pending: dict[int, PendingReform] = field(default_factory=dict)  # by pid
    can_reform: set[int] = field(default_factory=set)  # pids whose Hello said they handle Reform
    replacing_since: float | None = None  # a worker died with no ready spare: warming replacements
    warming_since: float | None = None  # outside the round, warming a spare per worker before joining
    seen_round: records_pb2.RoundRecord | None = None  # the newest round read, applied or not yet
