"""What goes into the round state machine (events) and what comes out (decisions).

Plain frozen dataclasses, free of etcd and protobuf: the daemon's loop decodes etcd values into
events and encodes decisions into etcd writes. Constructors do not validate: the machine asks
:func:`malformed` about each event and ignores (and logs) one that has a reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "CheckpointCommitted",
    "CloseRound",
    "Cordon",
    "Decision",
    "Drain",
    "Event",
    "Health",
    "HealthVerdict",
    "LeaseLost",
    "Member",
    "NodeRegistered",
    "OpenRound",
    "PeerReachability",
    "PeersLost",
    "ProgressReport",
    "Replacing",
    "Status",
    "Tick",
    "Uncordon",
    "WorkerFailed",
    "malformed",
]


class Health(enum.Enum):
    """An agent's verdict on its node.

    HEALTHY: fit to train. TRANSIENT: a problem the agent expects to clear (e.g. restarting a
    worker); the node stays in its current round but is not taken into a new one until it is
    healthy again. FATAL: the node cannot train (e.g. a GPU fell off the bus); it leaves the world.
    """

    HEALTHY = "healthy"
    TRANSIENT = "transient"
    FATAL = "fatal"


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRegistered:
    """A node's agent registered (its lease is alive). Registration implies a healthy node: agents
    register after their first health probe passes. ``address`` is the host name or IP its peers
    reach it at (no port); ``devices`` the number of local accelerators, at least 1."""

    node_id: str
    address: str
    devices: int


@dataclass(frozen=True)
class LeaseLost:
    """The lease of a node's agent expired or was revoked: the node is gone until it registers.
    ``planned``: its agent said it was leaving (a graceful stop), so it is not a fault.
    ``host_up``: its host still answers (the agent's port refuses or accepts a connection): only
    the agent is gone, and its workers may be training on for its successor to adopt."""

    node_id: str
    planned: bool = False
    host_up: bool = False


@dataclass(frozen=True)
class HealthVerdict:
    """The latest health verdict of a node's agent; ``detail`` is shown to operators."""

    node_id: str
    health: Health
    detail: str = ""


@dataclass(frozen=True)
class ProgressReport:
    """A member reports the training step it reached. ``time`` is the node's own clock when the
    step finished, kept for display only: stall detection uses the daemon's ``now`` because node
    clocks are not comparable with the daemon's. Only a step larger than the node's previous one in
    this round counts as progress."""

    node_id: str
    step: int
    time: float
    busy_time: float = 0.0  # seconds per step outside collectives (0: unknown); for stragglers


@dataclass(frozen=True)
class JobGaveUp:
    """A member's trainer stopped on repeated training-health faults (exit ``EXIT_DIVERGED``):
    the job gave up. The machine closes the round and opens no new one; restarting would only
    diverge again."""

    node_id: str
    round: int
    reason: str = ""


@dataclass(frozen=True)
class CheckpointCommitted:
    """A checkpoint at ``step`` was committed (every shard durable, manifest written)."""

    step: int


@dataclass(frozen=True)
class Drain:
    """Take the node out of the world now and keep it out until uncordoned. ``why`` goes into the
    round's reason: an operator, or the daemon itself (a straggler excluded at a checkpoint)."""

    node_id: str
    why: str = "by operator"


@dataclass(frozen=True)
class Cordon:
    """Operator: take the node into no new round until uncordoned. A member stays in the current
    round and leaves it when the world next changes for another reason."""

    node_id: str


@dataclass(frozen=True)
class Uncordon:
    """Operator: lift a cordon, drain or quarantine (and forget the node's past faults)."""

    node_id: str


@dataclass(frozen=True)
class PeersLost:
    """A member's workers lost these peers in ``round`` (a collective broke on them) and their
    agents do not answer: evidence that those nodes are gone, seconds before their leases expire."""

    node_id: str
    round: int
    lost: frozenset[str] = field(default_factory=frozenset)
    # those of ``lost`` whose agent the daemon itself found gone (its port accepts no connection):
    # one peer's report and the daemon's own check suffice, no majority is needed
    confirmed: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class PeerReachability:
    """A member's agent reports which peers of the round it cannot reach; the latest report of
    each member in the current round is kept and used when the whole round stalls."""

    node_id: str
    unreachable: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class WorkerFailed:
    """A member's workers failed in round ``round`` (a worker died, or stopped making progress):
    the round cannot go on and is restarted. ``blame`` says whether this node caused it (a
    worker killed by a signal or the OOM killer, or a stall) rather than failing because a
    peer did (an error exit in a collective); only blamed failures count towards quarantine."""

    node_id: str
    round: int
    blame: bool = True
    detail: str = ""


@dataclass(frozen=True)
class Replacing:
    """A node says whether it is warming a replacement for a lost worker (no warm spare was ready
    when the worker died). While it is, it leaves the world at the next round if enough nodes
    remain without it, and is not taken into a new round: the other ranks re-form at once instead
    of waiting for a new process to start. It comes back by the regrow rule once it is warm."""

    node_id: str
    replacing: bool


@dataclass(frozen=True)
class Tick:
    """Time passed. Carries nothing: every call is given ``now``; a tick only gives time-based
    rules (join timeout, stall timeout, cool-down) a chance to fire when nothing else happens."""


Event = (
    NodeRegistered
    | LeaseLost
    | HealthVerdict
    | ProgressReport
    | CheckpointCommitted
    | Drain
    | Cordon
    | Uncordon
    | PeerReachability
    | PeersLost
    | WorkerFailed
    | Replacing
    | Tick
)


# --- decisions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One node of a round. ``rank`` is the node's rank (torchrun's group rank), 0..W-1; worker
    ranks are derived from it by the agents."""

    rank: int
    node_id: str
    address: str
    devices: int


@dataclass(frozen=True)
class OpenRound:
    """Open round ``number`` with ``members`` in rank order (``members[i].rank == i``).

    Workers of the previous round stop; the new world restores the checkpoint at ``restore_step``
    (None: no checkpoint committed yet, start from scratch). The master is rank 0's address.
    """

    number: int
    members: tuple[Member, ...]
    world_size: int
    master_addr: str
    master_port: int
    restore_step: int | None
    reason: str


@dataclass(frozen=True)
class CloseRound:
    """Round ``number`` is over and no new round can open yet: its workers must stop."""

    number: int
    reason: str


@dataclass(frozen=True)
class Status:
    """No round can open now, and why (e.g. "waiting: 2 healthy nodes, min_nodes=3"). Emitted
    when the reason changes, not on every event."""

    reason: str


Decision = OpenRound | CloseRound | Status

_NODE_EVENTS = (NodeRegistered, LeaseLost, HealthVerdict, ProgressReport, Drain, Cordon, Uncordon,
                PeerReachability, PeersLost, WorkerFailed, JobGaveUp, Replacing)


def _is_count(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def malformed(event: object) -> str | None:
    """Why ``event`` cannot be applied (wrong type, empty node id, negative step, ...), or None
    when it can. The state machine ignores an event for which this returns a reason."""
    if isinstance(event, Tick):
        return None
    if isinstance(event, CheckpointCommitted):
        return None if _is_count(event.step, 0) else f"step {event.step!r} is not a non-negative integer"
    if not isinstance(event, _NODE_EVENTS):
        return f"unknown event type {type(event).__name__}"
    node_id = event.node_id
    if not isinstance(node_id, str) or not node_id:
        return f"node id {node_id!r} is not a non-empty string"
    if isinstance(event, NodeRegistered):
        if not isinstance(event.address, str) or not event.address:
            return f"address {event.address!r} is not a non-empty string"
        if not _is_count(event.devices, 1):
            return f"devices {event.devices!r} is not a positive integer"
    elif isinstance(event, HealthVerdict):
        if not isinstance(event.health, Health):
            return f"health {event.health!r} is not a Health"
        if not isinstance(event.detail, str):
            return f"detail {event.detail!r} is not a string"
    elif isinstance(event, ProgressReport):
        if not _is_count(event.step, 0):
            return f"step {event.step!r} is not a non-negative integer"
    elif isinstance(event, PeersLost):
        if not _is_count(event.round, 1):
            return f"round {event.round!r} is not a positive integer"
        if not isinstance(event.lost, (set, frozenset)) or not all(isinstance(p, str) for p in event.lost):
            return f"lost {event.lost!r} is not a set of node ids"
    elif isinstance(event, (WorkerFailed, JobGaveUp)):
        if not _is_count(event.round, 1):
            return f"round {event.round!r} is not a positive integer"
    elif isinstance(event, Replacing):
        if not isinstance(event.replacing, bool):
            return f"replacing {event.replacing!r} is not a bool"
    elif isinstance(event, PeerReachability):
        peers = event.unreachable
        if not isinstance(peers, (set, frozenset)) or not all(isinstance(p, str) for p in peers):
            return f"unreachable {peers!r} is not a set of node ids"
    return None
