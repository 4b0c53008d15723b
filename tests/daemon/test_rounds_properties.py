"""Property tests: random event sequences never break the round invariants.

A shadow model, built only from the events sent, tracks which nodes are registered, healthy and
held by an operator, and which checkpoints committed; every decision is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from stalwart.daemon.nodes import NodeState
from stalwart.daemon.policy import PolicyError, RoundPolicy
from stalwart.daemon.round_events import (
    CheckpointCommitted,
    CloseRound,
    Cordon,
    Drain,
    Event,
    Health,
    HealthVerdict,
    LeaseLost,
    NodeRegistered,
    OpenRound,
    PeerReachability,
    ProgressReport,
    Status,
    Tick,
    Uncordon,
    WorkerFailed,
)
from stalwart.daemon.rounds import RoundMachine

NODES = [f"n{i}" for i in range(7)]
IDS = st.sampled_from([*NODES, "ghost"])


@st.composite
def policies(draw: st.DrawFn) -> RoundPolicy:
    quantum = draw(st.integers(1, 3))
    min_nodes = draw(st.integers(1, 5))
    max_nodes = draw(st.integers(min_nodes, 7))
    try:
        return RoundPolicy(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            node_quantum=quantum,
            join_timeout=draw(st.sampled_from([0.0, 5.0, 30.0])),
            regrow_cooldown=draw(st.sampled_from([0.0, 10.0, 60.0])),
            quarantine_faults=draw(st.integers(1, 3)),
            quarantine_window=draw(st.sampled_from([10.0, 100.0])),
            stall_timeout=draw(st.sampled_from([5.0, 30.0])),
        )
    except PolicyError:
        assume(False)
        raise


_KINDS: dict[str, tuple[int, st.SearchStrategy[Event]]] = {
    # kind: (weight, strategy); registrations and progress dominate, as in a real job
    "register": (5, st.builds(NodeRegistered, IDS, st.sampled_from(["10.0.0.1", "10.0.0.2", "h"]),
                              st.integers(1, 8))),
    "lease": (1, st.builds(LeaseLost, IDS)),
    "health": (2, st.builds(HealthVerdict, IDS, st.sampled_from(list(Health)))),
    "progress": (6, st.builds(ProgressReport, IDS, st.integers(0, 60), st.just(0.0))),
    "checkpoint": (2, st.builds(CheckpointCommitted, st.integers(0, 60))),
    "drain": (1, st.builds(Drain, IDS)),
    "cordon": (1, st.builds(Cordon, IDS)),
    "uncordon": (1, st.builds(Uncordon, IDS)),
    "reachability": (2, st.builds(PeerReachability, IDS, st.frozensets(IDS, max_size=3))),
    "worker": (2, st.builds(WorkerFailed, IDS, st.integers(1, 6), st.booleans())),
    "tick": (3, st.just(Tick())),
    "malformed": (1, st.builds(ProgressReport, IDS, st.integers(-2, -1), st.just(0.0))),
}
events: st.SearchStrategy[Event] = st.sampled_from(
    [kind for kind, (weight, _) in _KINDS.items() for _ in range(weight)]
).flatmap(lambda kind: _KINDS[kind][1])

_DT = st.floats(0.0, 12.0, allow_nan=False)


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[float, Event]]:
    """Most nodes register first (so rounds open), then anything happens."""
    first = draw(st.lists(st.sampled_from(NODES), unique=True, min_size=3, max_size=len(NODES)))
    prefix: list[tuple[float, Event]] = [(draw(st.floats(0.0, 2.0)), NodeRegistered(n, f"{n}.ip", 8)) for n in first]
    return prefix + draw(st.lists(st.tuples(_DT, events), max_size=80))


steps = scripts()


@dataclass
class Shadow:
    """What the events say, independent of the machine's own bookkeeping."""

    registered: dict[str, bool] = field(default_factory=dict)
    address: dict[str, str] = field(default_factory=dict)
    health: dict[str, Health] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)
    committed: set[int] = field(default_factory=set)

    def apply(self, event: Event) -> None:
        if isinstance(event, NodeRegistered):
            if event.node_id and not self.registered.get(event.node_id, False):
                self.registered[event.node_id] = True
                self.address[event.node_id] = event.address
                self.health[event.node_id] = Health.HEALTHY
        elif isinstance(event, LeaseLost) and event.node_id in self.registered:
            self.registered[event.node_id] = False
        elif isinstance(event, HealthVerdict) and event.node_id in self.registered:
            self.health[event.node_id] = event.health
        elif isinstance(event, (Drain, Cordon)) and event.node_id in self.registered:
            self.held.add(event.node_id)
        elif isinstance(event, Uncordon):
            self.held.discard(event.node_id)
        elif isinstance(event, CheckpointCommitted) and event.step >= 0:
            self.committed.add(event.step)


def check_open(decision: OpenRound, policy: RoundPolicy, shadow: Shadow, machine: RoundMachine) -> None:
    w = decision.world_size
    assert [m.rank for m in decision.members] == list(range(w))
    assert len({m.node_id for m in decision.members}) == w
    assert policy.min_nodes <= w <= policy.max_nodes
    assert w % policy.node_quantum == 0
    for member in decision.members:
        assert shadow.registered[member.node_id]
        assert shadow.health[member.node_id] is Health.HEALTHY
        assert member.node_id not in shadow.held
        assert member.address == shadow.address[member.node_id]
        assert machine.state.nodes[member.node_id].state is NodeState.MEMBER  # so not quarantined
    assert decision.master_addr == decision.members[0].address
    assert decision.master_port == policy.master_port
    newest = max(shadow.committed) if shadow.committed else None
    assert decision.restore_step == newest
    assert decision.reason


def check_rank_order(new: list[str], previous: list[str] | None) -> None:
    """Survivors of the previous open round first, in their old relative order; then newcomers
    sorted by id. With no round open before, the whole list is sorted by id."""
    old = previous or []
    kept = [m for m in new if m in old]
    assert new[:len(kept)] == kept
    assert kept == [m for m in old if m in kept]
    assert new[len(kept):] == sorted(new[len(kept):])


def _kind(reason: str) -> str:
    for word in ("first round", "regrow", "network stall", "no progress", "lease lost", "health",
                 "drained", "available again"):
        if word in reason:
            return word
    return "other"


def check_state(machine: RoundMachine) -> None:
    st_ = machine.state
    eligible = {
        n for n, rec in st_.nodes.items()
        if rec.state is NodeState.WAITING and rec.registered and rec.health is Health.HEALTHY
    }
    assert st_.waiting == eligible
    members = set(st_.round.members) if st_.round else set()
    assert {n for n, rec in st_.nodes.items() if rec.state is NodeState.MEMBER} <= members
    for n in members:
        assert st_.nodes[n].state not in (NodeState.QUARANTINED, NodeState.DRAINED, NodeState.LOST)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), script=steps, batch=st.integers(1, 4))
# A quarantine and an uncordon in one batch: the node is still in the round being left.
@example(policy=RoundPolicy(min_nodes=1, max_nodes=1, quarantine_faults=1),
         script=[(0.0, NodeRegistered("n0", "n0.ip", 8)), (0.0, NodeRegistered("n1", "n1.ip", 8)),
                 (0.0, NodeRegistered("n2", "n2.ip", 8)), (0.0, Tick()),
                 (0.0, HealthVerdict("n0", Health.TRANSIENT)), (0.0, Uncordon("n0"))],
         batch=2)
def test_random_event_sequences_keep_round_invariants(
    policy: RoundPolicy, script: list[tuple[float, Event]], batch: int
) -> None:
    """Events go in one by one or in batches of up to ``batch`` (the time of a batch's first)."""
    machine = RoundMachine(policy)
    shadow = Shadow()
    now = 0.0
    last_number = 0
    open_number: int | None = None
    previous: list[str] | None = None
    for start in range(0, len(script), batch):
        chunk = script[start:start + batch]
        now += chunk[0][0]
        for _, event in chunk:
            shadow.apply(event)
        decisions = machine.handle_batch([event for _, event in chunk], now)
        changes = [d for d in decisions if isinstance(d, (OpenRound, CloseRound))]
        assert len(changes) <= 1
        for decision in decisions:
            if isinstance(decision, OpenRound):
                assert decision.number == last_number + 1
                last_number = open_number = decision.number
                check_open(decision, policy, shadow, machine)
                check_rank_order([m.node_id for m in decision.members], previous)
                previous = [m.node_id for m in decision.members]
                note_event(f"opened: {_kind(decision.reason)}")
            elif isinstance(decision, CloseRound):
                note_event("closed")
                assert decision.number == open_number
                open_number = previous = None
                assert decision.reason
            else:
                assert isinstance(decision, Status) and decision.reason
        check_state(machine)
    note_event(f"rounds opened: {min(last_number, 5)}{'+' if last_number >= 5 else ''}")
    if any(rec.state is NodeState.QUARANTINED for rec in machine.state.nodes.values()):
        note_event("a node was quarantined")
    # Once time is up, a feasible set of waiting nodes is never left without a round.
    machine.handle(Tick(), now + policy.join_timeout + 1.0)
    if machine.state.round is None:
        assert policy.world_size_for(len(machine.state.waiting)) is None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), script=steps)
def test_no_progress_stall_or_loss_means_no_shrink(policy: RoundPolicy, script: list[tuple[float, Event]]) -> None:
    """Registrations and checkpoints alone only ever open or grow rounds, never shrink them."""
    machine = RoundMachine(policy)
    now, world = 0.0, 0
    for dt, event in script:
        if not isinstance(event, (NodeRegistered, CheckpointCommitted)):
            continue
        now += min(dt, policy.stall_timeout / 4)
        for decision in machine.handle(event, now):
            assert not isinstance(decision, CloseRound)
            if isinstance(decision, OpenRound):
                assert decision.world_size > world
                world = decision.world_size
        rnd = machine.state.round
        if rnd is not None:  # keep every member progressing so nothing stalls
            for node_id in rnd.members:
                machine.handle(ProgressReport(node_id, int(now * 10) + 1, now), now)
