"""Scenario tests of the pure round state machine and its policy: no etcd, no clock."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from stalwart.daemon.errors import TransitionError
from stalwart.daemon.nodes import NodeState, check_transition
from stalwart.daemon.policy import PolicyError, RoundPolicy
from stalwart.daemon.round_events import (
    CheckpointCommitted,
    CloseRound,
    Cordon,
    Decision,
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
)
from stalwart.daemon.rounds import RoundMachine, name_unreachable_node


class Sim:
    """A machine plus a clock the test moves by hand."""

    def __init__(self, **policy: object) -> None:
        defaults: dict[str, object] = {
            "min_nodes": 2, "max_nodes": 4, "join_timeout": 10.0, "regrow_cooldown": 30.0,
            "quarantine_faults": 3, "quarantine_window": 100.0, "stall_timeout": 1000.0,
        }
        defaults.update(policy)
        self.machine = RoundMachine(RoundPolicy.from_mapping(defaults))
        self.now = 0.0

    def send(self, event: Event, dt: float = 0.0) -> list[Decision]:
        self.now += dt
        return self.machine.handle(event, self.now)

    def register(self, *ids: str) -> list[Decision]:
        out: list[Decision] = []
        for node_id in ids:
            out += self.send(NodeRegistered(node_id, f"{node_id}.example", 8))
        return out

    def tick(self, dt: float) -> list[Decision]:
        return self.send(Tick(), dt)

    def progress(self, step: int, dt: float = 0.0) -> None:
        """Every member of the open round reports ``step``."""
        self.now += dt
        rnd = self.machine.state.round
        assert rnd is not None
        for node_id in rnd.members:
            assert self.machine.handle(ProgressReport(node_id, step, self.now), self.now) == []

    def state_of(self, node_id: str) -> NodeState:
        return self.machine.state.nodes[node_id].state

    def start(self, *ids: str) -> OpenRound:
        """Register ``ids`` and open the first round by waiting out join_timeout."""
        decisions = self.register(*ids)
        if not rounds(decisions):
            decisions += self.tick(self.machine.policy.join_timeout)
        opened = rounds(decisions)
        assert len(opened) == 1
        return opened[0]


def rounds(decisions: list[Decision]) -> list[OpenRound]:
    return [d for d in decisions if isinstance(d, OpenRound)]


def ids(decision: OpenRound) -> list[str]:
    return [m.node_id for m in decision.members]


def only_round(decisions: list[Decision]) -> OpenRound:
    opened = rounds(decisions)
    assert len(opened) == 1, decisions
    return opened[0]


# --- policy ---------------------------------------------------------------------------------------


def test_policy_defaults_are_valid() -> None:
    policy = RoundPolicy()
    assert policy.min_nodes <= policy.max_nodes
    assert policy.largest_world_size >= policy.min_nodes


@pytest.mark.parametrize(
    "settings",
    [
        {"min_nodes": 3, "max_nodes": 2},
        {"min_nodes": 3, "max_nodes": 3, "node_quantum": 2},
        {"min_nodes": 5, "max_nodes": 7, "node_quantum": 4},
        {"min_nodes": 0},
        {"node_quantum": 0},
        {"min_nodes": "2"},
        {"max_nodes": 4.0},
        {"master_port": True},
        {"master_port": 0},
        {"master_port": 70000},
        {"join_timeout": -1},
        {"regrow_cooldown": -0.5},
        {"stall_timeout": 0},
        {"quarantine_faults": 0},
        {"quarantine_window": 0},
        {"join_timeout": math.inf},
        {"stall_timeout": "60"},
        {"min_nodes": 2, "max_nodes": 4, "stall_timeout_s": 3},
    ],
)
def test_bad_policy_raises_policy_error(settings: dict[str, object]) -> None:
    with pytest.raises(PolicyError):
        RoundPolicy.from_mapping(settings)


def test_policy_error_is_value_error_and_constructor_validates() -> None:
    with pytest.raises(ValueError):
        RoundPolicy(min_nodes=4, max_nodes=2)


def test_from_mapping_rejects_non_mapping() -> None:
    with pytest.raises(PolicyError):
        RoundPolicy.from_mapping([("min_nodes", 2)])  # type: ignore[arg-type]


def test_from_mapping_fills_defaults_and_converts_seconds() -> None:
    policy = RoundPolicy.from_mapping({"min_nodes": 2, "max_nodes": 8, "node_quantum": 2, "join_timeout": 5})
    assert policy.join_timeout == 5.0 and isinstance(policy.join_timeout, float)
    assert policy.master_port == RoundPolicy().master_port


@pytest.mark.parametrize(
    ("available", "expected"),
    [(1, None), (2, 2), (3, 2), (5, 4), (6, 6), (7, 6), (100, 6)],
)
def test_world_size_for_rounds_down_to_quantum_and_caps(available: int, expected: int | None) -> None:
    policy = RoundPolicy(min_nodes=2, max_nodes=7, node_quantum=2)
    assert policy.world_size_for(available) == expected


# --- first round ----------------------------------------------------------------------------------


def test_first_round_waits_for_join_timeout() -> None:
    sim = Sim()
    assert rounds(sim.register("c", "a", "b")) == []
    assert rounds(sim.tick(9.0)) == []
    opened = only_round(sim.tick(1.0))
    assert opened.number == 1
    assert ids(opened) == ["a", "b", "c"]
    assert [m.rank for m in opened.members] == [0, 1, 2]
    assert opened.world_size == 3
    assert opened.master_addr == "a.example"
    assert opened.master_port == RoundPolicy().master_port
    assert opened.restore_step is None
    assert opened.reason


def test_first_round_starts_early_at_max_nodes() -> None:
    sim = Sim(max_nodes=3)
    assert rounds(sim.register("a", "b")) == []
    opened = only_round(sim.register("c"))
    assert sim.now < 10.0
    assert opened.world_size == 3


def test_first_round_starts_early_at_largest_multiple_of_quantum() -> None:
    sim = Sim(min_nodes=2, max_nodes=5, node_quantum=2)
    assert rounds(sim.register("a", "b", "c")) == []
    opened = only_round(sim.register("d"))
    assert ids(opened) == ["a", "b", "c", "d"]


def test_first_round_below_min_after_timeout_waits_with_reason_then_opens() -> None:
    sim = Sim(min_nodes=3)
    sim.register("a", "b")
    decisions = sim.tick(15.0)
    assert rounds(decisions) == []
    statuses = [d for d in decisions if isinstance(d, Status)]
    assert len(statuses) == 1 and "2 healthy nodes" in statuses[0].reason
    assert sim.tick(1.0) == []  # the same reason is not repeated
    opened = only_round(sim.register("c"))
    assert opened.world_size == 3


def test_first_round_caps_at_max_nodes_and_rest_wait() -> None:
    sim = Sim(max_nodes=4)
    opened = only_round(sim.register("f", "e", "d", "c", "b", "a")[-4:] + sim.tick(0))
    assert ids(opened) == ["c", "d", "e", "f"]
    assert sim.state_of("a") is NodeState.WAITING


# --- shrink ---------------------------------------------------------------------------------------


def test_lease_lost_opens_smaller_round_keeping_survivor_order() -> None:
    sim = Sim()
    sim.start("a", "b", "c")
    sim.send(CheckpointCommitted(100))
    opened = only_round(sim.send(LeaseLost("a"), 1.0))
    assert opened.number == 2
    assert ids(opened) == ["b", "c"]
    assert [m.rank for m in opened.members] == [0, 1]
    assert opened.master_addr == "b.example"
    assert opened.restore_step == 100
    assert sim.state_of("a") is NodeState.LOST


def test_fatal_health_of_member_shrinks() -> None:
    sim = Sim()
    sim.start("a", "b", "c")
    opened = only_round(sim.send(HealthVerdict("b", Health.FATAL, "Xid 79"), 1.0))
    assert ids(opened) == ["a", "c"]
    assert sim.state_of("b") is NodeState.UNHEALTHY


def test_transient_health_keeps_member_in_round() -> None:
    sim = Sim()
    sim.start("a", "b", "c")
    assert sim.send(HealthVerdict("b", Health.TRANSIENT), 1.0) == []
    assert sim.state_of("b") is NodeState.MEMBER


def test_below_min_closes_round_and_waits_with_reason() -> None:
    sim = Sim(min_nodes=3)
    sim.start("a", "b", "c")
    decisions = sim.send(LeaseLost("b"), 1.0)
    closed, status = decisions
    assert isinstance(closed, CloseRound) and closed.number == 1
    assert isinstance(status, Status)
    assert "2 healthy nodes" in status.reason and "min_nodes=3" in status.reason
    assert sim.state_of("a") is NodeState.WAITING
    assert sim.tick(5.0) == []
    opened = only_round(sim.register("b"))
    assert opened.number == 2
    assert opened.world_size == 3


def test_shrink_rounds_down_to_quantum_dropping_highest_rank() -> None:
    sim = Sim(min_nodes=2, max_nodes=4, node_quantum=2)
    first = sim.start("a", "b", "c", "d")
    assert ids(first) == ["a", "b", "c", "d"]
    opened = only_round(sim.send(LeaseLost("b"), 1.0))
    assert ids(opened) == ["a", "c"]
    assert sim.state_of("d") is NodeState.WAITING


def test_shrink_takes_in_waiting_nodes_after_survivors() -> None:
    sim = Sim(max_nodes=3)
    sim.start("b", "c", "d")
    sim.register("a")
    opened = only_round(sim.send(LeaseLost("c"), 1.0))
    assert ids(opened) == ["b", "d", "a"]


# --- regrow ---------------------------------------------------------------------------------------


def test_regrow_waits_for_next_checkpoint_then_appends_newcomers() -> None:
    sim = Sim(regrow_cooldown=0.0)
    sim.start("b", "c")
    sim.progress(1, dt=1.0)
    assert rounds(sim.register("z", "a")) == []
    assert rounds(sim.tick(50.0)) == []
    opened = only_round(sim.send(CheckpointCommitted(10), 1.0))
    assert ids(opened) == ["b", "c", "a", "z"]
    assert opened.restore_step == 10
    assert opened.number == 2


def test_regrow_respects_cooldown() -> None:
    sim = Sim(regrow_cooldown=30.0)
    sim.start("a", "b")
    sim.progress(1, dt=1.0)
    sim.register("c")
    assert rounds(sim.send(CheckpointCommitted(10), 5.0)) == []
    assert rounds(sim.tick(30.0)) == []  # cool-down over, but no new checkpoint yet
    opened = only_round(sim.send(CheckpointCommitted(20), 1.0))
    assert ids(opened) == ["a", "b", "c"]
    assert opened.restore_step == 20


def test_regrow_at_once_when_round_has_not_trained_after_cooldown() -> None:
    sim = Sim(regrow_cooldown=30.0)
    sim.start("a", "b")
    assert rounds(sim.register("c")) == []
    assert rounds(sim.tick(29.0)) == []
    opened = only_round(sim.tick(1.0))
    assert ids(opened) == ["a", "b", "c"]


def test_checkpoint_not_newer_than_restore_step_does_not_regrow() -> None:
    sim = Sim(regrow_cooldown=0.0)
    sim.send(CheckpointCommitted(50))
    first = sim.start("a", "b")
    assert first.restore_step == 50
    sim.progress(51, dt=1.0)
    sim.register("c")
    assert rounds(sim.send(CheckpointCommitted(50), 1.0)) == []
    assert rounds(sim.send(CheckpointCommitted(40), 1.0)) == []
    assert only_round(sim.send(CheckpointCommitted(60), 1.0)).restore_step == 60


def test_regrow_needs_a_full_quantum() -> None:
    sim = Sim(min_nodes=2, max_nodes=6, node_quantum=2, regrow_cooldown=0.0)
    sim.start("a", "b")
    sim.progress(1, dt=1.0)
    sim.register("c")
    assert rounds(sim.send(CheckpointCommitted(10), 1.0)) == []
    sim.register("d", "e")
    opened = only_round(sim.send(CheckpointCommitted(20), 1.0))
    assert ids(opened) == ["a", "b", "c", "d"]
    assert sim.state_of("e") is NodeState.WAITING


def test_no_regrow_beyond_max_nodes() -> None:
    sim = Sim(max_nodes=2, regrow_cooldown=0.0)
    sim.register("a", "b")
    sim.progress(1, dt=1.0)
    sim.register("c")
    assert rounds(sim.send(CheckpointCommitted(10), 1.0)) == []


def test_restore_step_is_newest_commit_even_out_of_order() -> None:
    sim = Sim()
    sim.send(CheckpointCommitted(30))
    sim.send(CheckpointCommitted(10))
    assert sim.start("a", "b").restore_step == 30


# --- quarantine and operators ---------------------------------------------------------------------


def test_quarantine_after_n_faults_until_uncordon() -> None:
    sim = Sim(quarantine_faults=2, regrow_cooldown=0.0)
    sim.start("a", "b", "c")
    only_round(sim.send(LeaseLost("c"), 1.0))  # fault 1
    sim.register("c")
    sim.send(HealthVerdict("c", Health.TRANSIENT), 1.0)  # fault 2
    assert sim.state_of("c") is NodeState.QUARANTINED
    sim.send(HealthVerdict("c", Health.HEALTHY), 1.0)
    sim.progress(1, dt=1.0)
    assert rounds(sim.send(CheckpointCommitted(10), 1.0)) == []
    assert sim.state_of("c") is NodeState.QUARANTINED
    sim.send(Uncordon("c"), 1.0)
    assert sim.state_of("c") is NodeState.WAITING
    opened = only_round(sim.send(CheckpointCommitted(20), 1.0))
    assert "c" in ids(opened)


def _two_faults_of_c(apart: float) -> Sim:
    """Nodes a, b, c registered; c faults twice (transient health), ``apart`` seconds apart."""
    sim = Sim(quarantine_faults=2, quarantine_window=10.0)
    sim.register("a", "b", "c")
    sim.send(HealthVerdict("c", Health.TRANSIENT), 1.0)
    sim.send(HealthVerdict("c", Health.HEALTHY), 1.0)
    sim.send(HealthVerdict("c", Health.TRANSIENT), apart - 1.0)
    return sim


def test_faults_outside_window_do_not_quarantine() -> None:
    sim = _two_faults_of_c(apart=21.0)
    assert sim.state_of("c") is not NodeState.QUARANTINED


def test_faults_that_leave_the_window_are_forgotten_and_their_record_goes() -> None:
    """Over months (and hosts replaced under new names) the one fault record per node that ever
    faulted would only accumulate in etcd: faults that left the window are dropped each tick, and
    the loop deletes a record with none left."""
    sim = Sim(quarantine_faults=2, quarantine_window=10.0)
    sim.register("a", "b", "c")
    sim.send(HealthVerdict("c", Health.TRANSIENT), 1.0)
    sim.send(HealthVerdict("b", Health.TRANSIENT), 5.0)
    state = sim.machine.state
    state.fault_changes.clear()  # the loop wrote them
    assert state.nodes["c"].faults == [1.0] and state.nodes["b"].faults == [6.0]
    assert sim.machine.expire_faults(10.5) == 0  # c's fault is 9.5 s old: kept
    assert sim.machine.expire_faults(11.0) == 1
    assert state.nodes["c"].faults == [] and state.nodes["b"].faults == [6.0] and state.fault_changes == {"c"}
    state.fault_changes.clear()
    assert sim.machine.expire_faults(11.0) == 0  # nothing more to forget: nothing written


def test_a_quarantined_node_stays_quarantined_when_its_faults_expire() -> None:
    sim = _two_faults_of_c(apart=2.0)
    assert sim.state_of("c") is NodeState.QUARANTINED
    assert sim.machine.expire_faults(sim.now + 100.0) == 1
    assert sim.state_of("c") is NodeState.QUARANTINED and sim.machine.state.nodes["c"].faults == []


def test_quarantined_member_leaves_round_and_survives_reregistration() -> None:
    sim = Sim(quarantine_faults=1)
    sim.start("a", "b", "c")
    opened = only_round(sim.send(HealthVerdict("a", Health.TRANSIENT), 1.0))
    assert ids(opened) == ["b", "c"]
    sim.send(LeaseLost("a"), 1.0)
    sim.register("a")
    assert sim.state_of("a") is NodeState.QUARANTINED


def test_drain_member_opens_round_without_it() -> None:
    sim = Sim()
    sim.start("a", "b", "c", "d")
    opened = only_round(sim.send(Drain("b"), 1.0))
    assert ids(opened) == ["a", "c", "d"]
    assert sim.state_of("b") is NodeState.DRAINED
    assert "node b drained by operator" in opened.reason
    opened = only_round(sim.send(Drain("c", "by daemon d0 (straggler)"), 1.0))
    assert ids(opened) == ["a", "d"] and "node c drained by daemon d0 (straggler)" in opened.reason


def test_cordoned_member_stays_until_world_changes_and_uncordon_lets_it_regrow() -> None:
    sim = Sim(regrow_cooldown=0.0)
    sim.start("a", "b", "c", "d")
    assert sim.send(Cordon("b"), 1.0) == []
    assert sim.state_of("b") is NodeState.CORDONED
    sim.progress(1, dt=1.0)  # still in the round: its reports count, nothing stalls
    opened = only_round(sim.send(LeaseLost("d"), 1.0))
    assert ids(opened) == ["a", "c"]
    assert sim.state_of("b") is NodeState.CORDONED
    # round 2 has not trained yet and the cool-down is 0: uncordoning regrows at once
    assert ids(only_round(sim.send(Uncordon("b"), 1.0))) == ["a", "c", "b"]


def test_uncordon_of_a_member_makes_it_member_again() -> None:
    sim = Sim()
    sim.start("a", "b")
    sim.send(Cordon("b"))
    sim.send(Uncordon("b"))
    assert sim.state_of("b") is NodeState.MEMBER


# --- stalls ---------------------------------------------------------------------------------------


def test_network_stall_excludes_the_node_others_cannot_reach() -> None:
    sim = Sim(stall_timeout=20.0)
    sim.start("a", "b", "c")
    sim.progress(1, dt=1.0)
    sim.send(PeerReachability("a", frozenset({"c"})))
    sim.send(PeerReachability("b", frozenset({"c"})))
    sim.send(PeerReachability("c", frozenset({"a", "b"})))
    assert rounds(sim.tick(19.0)) == []
    opened = only_round(sim.tick(1.0))
    assert ids(opened) == ["a", "b"]
    assert opened.number == 2
    assert "c" in opened.reason
    assert sim.machine.state.nodes["c"].faults == [sim.now]


def test_network_stall_without_culprit_reopens_same_members() -> None:
    sim = Sim(regrow_cooldown=0.0, stall_timeout=20.0)
    sim.start("a", "b")
    sim.progress(1, dt=1.0)
    sim.register("c")  # waiting, but a no-culprit reopen takes in nobody new
    sim.send(PeerReachability("a", frozenset({"b"})))
    sim.send(PeerReachability("b", frozenset({"a"})))
    opened = only_round(sim.tick(20.0))
    assert ids(opened) == ["a", "b"]
    assert opened.number == 2


def test_stall_before_any_progress_counts_from_round_opening() -> None:
    sim = Sim(stall_timeout=20.0)
    sim.start("a", "b")
    assert rounds(sim.tick(19.0)) == []
    assert only_round(sim.tick(1.0)).number == 2


def test_repeated_step_is_not_progress() -> None:
    sim = Sim(stall_timeout=20.0)
    sim.start("a", "b")
    sim.progress(5, dt=1.0)
    sim.progress(5, dt=10.0)
    assert only_round(sim.tick(10.0)).number == 2


def test_single_stalled_member_is_excluded() -> None:
    sim = Sim(stall_timeout=20.0)
    sim.start("a", "b", "c")
    decisions: list[Decision] = []
    for _ in range(3):
        sim.now += 5.0
        for node_id in ("a", "c"):
            decisions += sim.send(ProgressReport(node_id, int(sim.now), sim.now))
    assert decisions == []
    sim.progress(1000, dt=4.0)  # b reports once: its clock restarts
    for _ in range(5):
        sim.now += 5.0
        for node_id in ("a", "c"):
            decisions += sim.send(ProgressReport(node_id, int(sim.now) + 1000, sim.now))
    opened = only_round(decisions)
    assert ids(opened) == ["a", "c"]
    assert sim.state_of("b") is NodeState.WAITING


def test_name_unreachable_node() -> None:
    members = ["a", "b", "c", "d"]
    assert name_unreachable_node(members, {"a": {"d"}, "b": {"d"}, "c": set()}) == "d"
    assert name_unreachable_node(members, {"a": {"d"}}) is None  # 1 of 3 is no majority
    assert name_unreachable_node(["a", "b"], {"a": {"b"}, "b": {"a"}}) is None
    assert name_unreachable_node(["a", "b"], {"a": {"b"}}) == "b"
    assert name_unreachable_node(["a"], {"a": {"x"}}) is None
    assert name_unreachable_node(members, {"x": {"a"}, "y": {"a"}, "z": {"a"}}) is None


# --- batches -------------------------------------------------------------------------------------


def test_losses_in_one_batch_change_the_world_once() -> None:
    sim = Sim(max_nodes=8)
    sim.start(*"abcdefgh")
    decisions = sim.machine.handle_batch([LeaseLost("b"), LeaseLost("e"), LeaseLost("ghost"), Tick()], 1.0)
    assert ids(only_round(decisions)) == ["a", "c", "d", "f", "g", "h"]
    assert len(decisions) == 1


def test_batch_with_malformed_event_applies_the_rest() -> None:
    sim = Sim(max_nodes=3)
    decisions = sim.machine.handle_batch(
        [NodeRegistered("a", "a.example", 8), ProgressReport("a", -1, 0.0), NodeRegistered("b", "b.example", 8),
         NodeRegistered("c", "c.example", 8)],
        0.0,
    )
    assert ids(only_round(decisions)) == ["a", "b", "c"]


def test_batch_loss_and_checkpoint_open_one_round_with_newcomers() -> None:
    sim = Sim(regrow_cooldown=0.0)
    sim.start("a", "b", "c")
    sim.progress(1, dt=1.0)
    sim.register("d")
    decisions = sim.machine.handle_batch([CheckpointCommitted(7), LeaseLost("a")], sim.now + 1.0)
    opened = only_round(decisions)
    assert ids(opened) == ["b", "c", "d"]
    assert opened.restore_step == 7


# --- a standby taking over -----------------------------------------------------------------------


def test_resume_continues_numbering_and_ranks_after_previous_leader() -> None:
    leader = Sim(max_nodes=3)
    leader.send(CheckpointCommitted(40))
    current = only_round(leader.register("c", "a", "b"))
    standby = RoundMachine.resume(leader.machine.policy, current, current.number, 40, now=100.0)
    decisions = standby.handle_batch(
        [NodeRegistered("a", "a.example", 8), NodeRegistered("c", "c.example", 8), LeaseLost("b"),
         ProgressReport("a", 41, 0.0)],
        100.0,
    )
    opened = only_round(decisions)
    assert opened.number == current.number + 1
    assert ids(opened) == ["a", "c"]
    assert opened.restore_step == 40


def test_resume_without_round_opens_next_number_once_enough_nodes() -> None:
    policy = RoundPolicy(min_nodes=2, max_nodes=4, join_timeout=60.0)
    standby = RoundMachine.resume(policy, None, last_round_number=7, committed_step=None, now=5.0)
    decisions = standby.handle_batch([NodeRegistered("b", "b.example", 8), NodeRegistered("a", "a.example", 8)], 5.0)
    opened = only_round(decisions)
    assert opened.number == 8
    assert ids(opened) == ["a", "b"]


def test_resumed_round_keeps_running_without_events() -> None:
    leader = Sim(max_nodes=2)
    current = only_round(leader.register("a", "b"))
    standby = RoundMachine.resume(leader.machine.policy, current, current.number, None, now=50.0)
    assert standby.handle_batch([NodeRegistered("a", "a.example", 8), NodeRegistered("b", "b.example", 8)],
                                50.0) == []
    assert standby.state.round is not None and standby.state.round.number == current.number


# --- ignored input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        LeaseLost("ghost"),
        HealthVerdict("ghost", Health.FATAL),
        Drain("ghost"),
        Cordon("ghost"),
        Uncordon("ghost"),
        ProgressReport("ghost", 3, 0.0),
        PeerReachability("ghost", frozenset({"a"})),
        NodeRegistered("a", "elsewhere", 8),  # duplicate registration
        Uncordon("a"),  # nothing to lift
        NodeRegistered("", "x", 8),
        NodeRegistered("z", "", 8),
        NodeRegistered("z", "x", 0),
        NodeRegistered("z", "x", True),
        HealthVerdict("a", "fatal"),  # type: ignore[arg-type]
        ProgressReport("a", -1, 0.0),
        ProgressReport("a", 1.5, 0.0),  # type: ignore[arg-type]
        CheckpointCommitted(-5),
        PeerReachability("a", ["b"]),  # type: ignore[arg-type]
        LeaseLost(7),  # type: ignore[arg-type]
        object(),
    ],
)
def test_unknown_duplicate_and_malformed_events_are_ignored(event: Event) -> None:
    sim = Sim()
    sim.start("a", "b")
    before = copy.deepcopy(sim.machine.state)
    assert sim.send(event, 1.0) == []
    assert dataclasses.replace(sim.machine.state, now=before.now) == before


def test_events_from_waiting_nodes_about_the_round_are_ignored() -> None:
    sim = Sim(max_nodes=2)
    sim.register("a", "b", "c")
    assert sim.send(ProgressReport("c", 1, 0.0)) == []
    assert sim.send(PeerReachability("c", frozenset({"a"}))) == []
    assert sim.machine.state.nodes["c"].last_step is None


@pytest.mark.parametrize("now", [math.nan, math.inf, "1"])
def test_non_finite_time_is_ignored(now: object) -> None:
    sim = Sim(max_nodes=2)
    sim.register("a")
    assert sim.machine.handle(NodeRegistered("b", "b.example", 8), now) == []  # type: ignore[arg-type]
    assert "b" not in sim.machine.state.nodes


def test_time_going_backwards_is_treated_as_latest() -> None:
    sim = Sim()
    sim.register("a", "b")
    assert rounds(sim.machine.handle(Tick(), 11.0))
    assert sim.machine.handle(Tick(), 5.0) == []
    assert sim.machine.state.now == 11.0


def test_transition_table_rejects_forbidden_moves() -> None:
    check_transition("a", NodeState.WAITING, NodeState.MEMBER)
    with pytest.raises(TransitionError):
        check_transition("a", NodeState.LOST, NodeState.MEMBER)
    with pytest.raises(TransitionError):
        check_transition("a", NodeState.QUARANTINED, NodeState.MEMBER)


# --- worker failures: the restart-everything path -------------------------------------------------


def test_worker_failure_restarts_the_round_with_the_same_members() -> None:
    from stalwart.daemon.round_events import WorkerFailed

    sim = Sim()
    first = sim.start("a", "b", "c")
    sim.progress(5, dt=1)
    sim.send(CheckpointCommitted(4))
    again = only_round(sim.send(WorkerFailed("b", first.number, blame=True, detail="rank 1: killed by SIGKILL")))
    assert again.number == first.number + 1
    assert ids(again) == ids(first)
    assert again.restore_step == 4
    assert "worker failed" in again.reason
    assert len(sim.machine.state.nodes["b"].faults) == 1  # blamed: counts towards quarantine


def test_peer_side_failure_restarts_without_blame_and_stale_reports_are_ignored() -> None:
    from stalwart.daemon.round_events import WorkerFailed

    sim = Sim()
    first = sim.start("a", "b")
    assert sim.send(WorkerFailed("a", first.number + 5)) == []  # not the current round
    assert sim.send(WorkerFailed("ghost", first.number)) == []  # unknown node
    again = only_round(sim.send(WorkerFailed("a", first.number, blame=False, detail="exit code 1")))
    assert ids(again) == ids(first) and sim.machine.state.nodes["a"].faults == []
    assert sim.send(WorkerFailed("a", first.number)) == []  # the old round's failure, reported late


def test_repeated_blamed_worker_failures_quarantine_the_node() -> None:
    from stalwart.daemon.round_events import WorkerFailed

    sim = Sim(quarantine_faults=2, min_nodes=2)
    rnd = sim.start("a", "b", "c")
    rnd = only_round(sim.send(WorkerFailed("c", rnd.number), dt=1))
    assert "c" in ids(rnd)
    rnd = only_round(sim.send(WorkerFailed("c", rnd.number), dt=1))
    assert "c" not in ids(rnd) and sim.state_of("c") is NodeState.QUARANTINED


def _lose_worker(sim: Sim, node: str, rnd: OpenRound) -> list[Decision]:
    """What an agent's one health write says when a worker died with no warm spare ready."""
    from stalwart.daemon.round_events import Replacing, WorkerFailed

    return sim.machine.handle_batch([HealthVerdict(node, Health.HEALTHY), Replacing(node, True),
                                     WorkerFailed(node, rnd.number, blame=True, detail="rank 1: SIGKILL")], sim.now)


def test_a_node_replacing_a_lost_worker_leaves_until_warm_then_regrows_at_a_checkpoint() -> None:
    from stalwart.daemon.round_events import Replacing

    sim = Sim(min_nodes=2, regrow_cooldown=0.0)
    first = sim.start("a", "b", "c")
    sim.progress(5, dt=1)
    sim.send(CheckpointCommitted(4))
    shrunk = only_round(_lose_worker(sim, "b", first))
    assert ids(shrunk) == ["a", "c"] and shrunk.restore_step == 4
    assert "b left out while warming a replacement" in shrunk.reason
    assert len(sim.machine.state.nodes["b"].faults) == 1
    # a waiting node that is still warming is not taken back, not even at a checkpoint
    sim.progress(7, dt=1)
    assert rounds(sim.send(CheckpointCommitted(6))) == []
    assert sim.send(Replacing("b", False), dt=1) == []  # warm: it waits for the regrow rule
    sim.progress(9, dt=1)
    regrown = only_round(sim.send(CheckpointCommitted(8)))
    assert ids(regrown) == ["a", "c", "b"] and regrown.restore_step == 8


def test_a_replacing_node_stays_when_the_world_would_be_too_small_without_it() -> None:
    sim = Sim(min_nodes=3)
    first = sim.start("a", "b", "c")
    again = only_round(_lose_worker(sim, "c", first))
    assert ids(again) == ["a", "b", "c"]
    assert "too few nodes without c, keeping them" in again.reason


def test_shrink_to_replace_off_restarts_with_the_same_members() -> None:
    sim = Sim(min_nodes=2, shrink_to_replace=False)
    first = sim.start("a", "b", "c")
    again = only_round(_lose_worker(sim, "b", first))
    assert ids(again) == ["a", "b", "c"] and "replacement" not in again.reason


def test_lease_lost_and_registered_again_in_one_batch_is_one_member() -> None:
    sim = Sim(min_nodes=1, max_nodes=4, join_timeout=0.0, regrow_cooldown=0.0)
    sim.register("n0", "n1", "n2")
    decisions = sim.machine.handle_batch([LeaseLost("n0"), NodeRegistered("n0", "10.0.0.1", 1)], sim.now)
    for d in rounds(decisions):
        assert len({m.node_id for m in d.members}) == d.world_size == len(d.members)


# --- a node lost by its peers ------------------------------------------------------------------------

def test_a_member_lost_by_a_majority_of_its_peers_leaves_at_once_without_waiting_for_its_lease() -> None:
    from stalwart.daemon.round_events import PeersLost
    from stalwart.daemon.rounds import LOST_BY_PEERS_HOLD

    sim = Sim(regrow_cooldown=0.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    assert sim.send(PeersLost("b", 1, frozenset({"a"}))) == []  # one of two peers: not yet
    opened = only_round(sim.send(PeersLost("c", 1, frozenset({"a"}))))
    assert ids(opened) == ["b", "c"] and "node a lost" in opened.reason
    assert len(sim.machine.state.nodes["a"].faults) == 1
    # Still registered (its lease has not expired): held out of new rounds, not regrown at once.
    assert rounds(sim.tick(1.0)) == []
    sim.send(CheckpointCommitted(10))
    assert rounds(sim.send(CheckpointCommitted(11), 1.0)) == []
    # Its lease expires: it is lost as usual; it comes back by registering again.
    assert rounds(sim.send(LeaseLost("a"), 1.0)) == []
    assert sim.state_of("a") is NodeState.LOST
    assert ids(only_round(sim.register("a"))) == ["b", "c", "a"]  # the round has not trained: regrow at once
    assert LOST_BY_PEERS_HOLD > 5


def test_one_peers_report_suffices_when_the_daemon_finds_the_agent_gone_and_ends_any_grace() -> None:
    """In a ring all-reduce only a lost rank's neighbours see it fail; the others see a survivor
    cut its connections and blame that one (which answers). One accuser, confirmed by the daemon's
    own probe of the accused agent, is enough; and a lease lost afterwards gets no restart grace."""
    from stalwart.daemon.round_events import PeersLost

    sim = Sim(regrow_cooldown=0.0, agent_restart_grace=10.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    assert sim.send(PeersLost("b", 1, frozenset({"a"}))) == []  # unconfirmed: one of two is not enough
    opened = only_round(sim.send(PeersLost("b", 1, frozenset({"a"}), confirmed=frozenset({"a"}))))
    assert ids(opened) == ["b", "c"] and "node a lost" in opened.reason

    sim = Sim(regrow_cooldown=0.0, agent_restart_grace=10.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    assert sim.send(PeersLost("b", 1, frozenset({"a"}))) == []
    opened = only_round(sim.send(LeaseLost("a", host_up=True), 0.5))  # accused: not a restarting agent
    assert ids(opened) == ["b", "c"]


def test_a_member_lost_by_its_peers_but_alive_rejoins_after_the_hold() -> None:
    from stalwart.daemon.round_events import PeersLost
    from stalwart.daemon.rounds import LOST_BY_PEERS_HOLD

    sim = Sim(regrow_cooldown=0.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    sim.send(PeersLost("b", 1, frozenset({"a"})))
    only_round(sim.send(PeersLost("c", 1, frozenset({"a"}))))
    sim.progress(2, 1.0)
    assert rounds(sim.send(CheckpointCommitted(12))) == []
    sim.tick(LOST_BY_PEERS_HOLD)
    assert ids(only_round(sim.send(CheckpointCommitted(13), 0.1))) == ["b", "c", "a"]


def test_in_a_world_of_two_one_report_decides_only_once_confirmed_and_reports_of_an_old_round_are_ignored(
        ) -> None:
    """One member's word alone never drops the other: with a link cut between just those two,
    each would accuse the other and both would go."""
    from stalwart.daemon.round_events import PeersLost

    sim = Sim(min_nodes=1)
    sim.start("a", "b")
    assert sim.send(PeersLost("a", 1, frozenset({"b"}))) == []
    assert sim.send(PeersLost("b", 1, frozenset({"a"}))) == []  # both accuse: neither is dropped
    assert ids(only_round(sim.send(PeersLost("a", 1, frozenset({"b"}), confirmed=frozenset({"b"}))))) == ["a"]
    assert sim.send(PeersLost("b", 1, frozenset({"a"}))) == []  # about round 1: moot
    assert sim.send(PeersLost("a", 1, frozenset({"b"}))) == []


# --- an agent that restarts while its workers train on ----------------------------------------


def test_a_member_whose_agent_restarts_stays_in_the_round_and_its_return_changes_nothing() -> None:
    sim = Sim(agent_restart_grace=10.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    assert rounds(sim.send(LeaseLost("a", host_up=True), 0.5)) == []  # only its agent is gone
    sim.progress(2, 2.0)
    assert rounds(sim.tick(5.0)) == []
    assert rounds(sim.register("a")) == []  # its successor adopted the workers
    assert sim.state_of("a") is NodeState.MEMBER and sim.machine.state.nodes["a"].registered
    assert rounds(sim.tick(20.0)) == []  # the grace no longer runs
    assert sim.machine.state.nodes["a"].faults == []
    assert sim.machine.state.round is not None and sim.machine.state.round.number == 1


def test_an_agent_that_does_not_come_back_within_the_grace_is_a_lost_lease() -> None:
    sim = Sim(agent_restart_grace=10.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    assert rounds(sim.send(LeaseLost("a", host_up=True))) == []
    assert rounds(sim.tick(9.0)) == []
    opened = only_round(sim.tick(1.0))
    assert ids(opened) == ["b", "c"] and "no agent came back within 10s" in opened.reason
    assert sim.state_of("a") is NodeState.LOST and len(sim.machine.state.nodes["a"].faults) == 1


def test_peers_that_lost_the_workers_of_a_restarting_agent_end_the_grace_at_once() -> None:
    from stalwart.daemon.round_events import PeersLost

    sim = Sim(agent_restart_grace=10.0)
    sim.start("a", "b", "c")
    sim.progress(1, 1.0)
    assert rounds(sim.send(LeaseLost("a", host_up=True))) == []
    assert rounds(sim.send(PeersLost("b", 1, frozenset({"a"})), 0.2)) == []
    opened = only_round(sim.send(PeersLost("c", 1, frozenset({"a"})), 0.1))
    assert ids(opened) == ["b", "c"]
    assert rounds(sim.tick(20.0)) == []  # no second round when the grace would have run out


@pytest.mark.parametrize("case", ["host down", "grace 0", "not training"])
def test_a_lost_lease_shrinks_at_once_when_the_host_is_down_or_there_is_no_grace(case: str) -> None:
    sim = Sim(agent_restart_grace=0.0 if case == "grace 0" else 10.0)
    sim.start("a", "b", "c")
    if case != "not training":
        sim.progress(1, 1.0)
    opened = only_round(sim.send(LeaseLost("a", host_up=case != "host down"), 0.5))
    assert ids(opened) == ["b", "c"]


def test_agent_restart_grace_is_checked() -> None:
    with pytest.raises(PolicyError, match="agent_restart_grace"):
        RoundPolicy(agent_restart_grace=-1.0)


def test_with_no_commit_for_regrow_without_commit_the_waiting_nodes_join_anyway() -> None:
    """A full disk (or saves far apart) must not keep the world small for good."""
    sim = Sim(regrow_cooldown=0.0, regrow_without_commit=20.0)
    sim.send(CheckpointCommitted(40))
    sim.start("a", "b")
    sim.progress(41, dt=1.0)
    sim.register("c")
    assert rounds(sim.tick(10.0)) == []
    assert rounds(sim.send(CheckpointCommitted(50), 5.0)) != []  # a commit: the regrow rule as ever
    sim.progress(51, dt=1.0)
    sim.register("d")
    assert rounds(sim.tick(18.0)) == []  # the round opened at the commit 19 s ago
    opened = only_round(sim.tick(1.0))
    assert ids(opened) == ["a", "b", "c", "d"] and opened.restore_step == 50
