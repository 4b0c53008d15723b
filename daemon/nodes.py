"""What the round state machine knows about each node: its state, with the allowed transitions.

Node states (``NodeState``), and how a node moves between them:

- ``WAITING``: registered, outside the world. Taken into the next round that opens when its
  health is HEALTHY (a TRANSIENT node waits until it is healthy again).
- ``MEMBER``: in the current round.
- ``UNHEALTHY``: registered, but its agent's last verdict is FATAL; WAITING again on a better one.
- ``LOST``: its lease is gone; WAITING again when it registers.
- ``CORDONED``, ``DRAINED``, ``QUARANTINED``: held out by an operator (cordon, drain) or by the
  quarantine rule, whatever happens to its lease or health, until an operator uncordons it. A
  cordoned node may still be in the current round (it leaves when the world next changes); a
  drained or quarantined one never is.

Health and registration are kept beside the state because the held states outlive both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stalwart.daemon.errors import TransitionError
from stalwart.daemon.round_events import Health

__all__ = ["HELD", "TRANSITIONS", "NodeRecord", "NodeState", "check_transition"]


class NodeState(enum.Enum):
    """Where a node stands with respect to the world; see the module docstring."""

    WAITING = "waiting"
    MEMBER = "member"
    UNHEALTHY = "unhealthy"
    LOST = "lost"
    CORDONED = "cordoned"
    DRAINED = "drained"
    QUARANTINED = "quarantined"


_S = NodeState

#: States only an operator's uncordon ends.
HELD: frozenset[NodeState] = frozenset({_S.CORDONED, _S.DRAINED, _S.QUARANTINED})

#: Allowed moves. ``CORDONED -> MEMBER`` is an uncordon while the node is still in the round.
TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _S.WAITING: frozenset({_S.MEMBER, _S.UNHEALTHY, _S.LOST, _S.CORDONED, _S.DRAINED, _S.QUARANTINED}),
    _S.MEMBER: frozenset({_S.WAITING, _S.UNHEALTHY, _S.LOST, _S.CORDONED, _S.DRAINED, _S.QUARANTINED}),
    _S.UNHEALTHY: frozenset({_S.WAITING, _S.LOST, _S.CORDONED, _S.DRAINED, _S.QUARANTINED}),
    _S.LOST: frozenset({_S.WAITING, _S.CORDONED, _S.DRAINED}),
    _S.CORDONED: frozenset({_S.WAITING, _S.MEMBER, _S.UNHEALTHY, _S.LOST, _S.DRAINED}),
    _S.DRAINED: frozenset({_S.WAITING, _S.UNHEALTHY, _S.LOST}),
    _S.QUARANTINED: frozenset({_S.WAITING, _S.UNHEALTHY, _S.LOST}),
}


def check_transition(node_id: str, old: NodeState, new: NodeState) -> None:
    """Raise :class:`TransitionError` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"node {node_id}: transition {old.value} -> {new.value} is not allowed")


@dataclass
class NodeRecord:
    """One node as the state machine sees it. Mutated only by the machine.

    ``faults`` holds the times of recent faults (pruned to the quarantine window when one is added,
    and each tick: :meth:`RoundMachine.expire_faults`).
    ``last_step``, ``last_progress_at`` and ``unreachable`` describe the current round only and are
    reset whenever a round opens.
    """

    node_id: str
    address: str
    devices: int
    state: NodeState = NodeState.WAITING
    registered: bool = True
    health: Health = Health.HEALTHY
    health_detail: str = ""
    faults: list[float] = field(default_factory=list)
    last_step: int | None = None
    last_progress_at: float | None = None
    unreachable: frozenset[str] = frozenset()
    replacing: bool = False  # warming a replacement for a lost worker: out of new rounds if possible
    # Lost by its peers (their collectives broke on it, its agent did not answer): out of new rounds
    # until this time, or until it registers again (a dead node's lease expires well before).
    lost_by_peers_until: float | None = None

    @property
    def eligible(self) -> bool:
        """Whether the node may be in a round that opens now (as a survivor or a newcomer)."""
        return (
            self.state in (NodeState.WAITING, NodeState.MEMBER)
            and self.registered
            and self.health is Health.HEALTHY
        )
