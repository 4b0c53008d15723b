"""Pure straggler detection, exclusion planning and the give-up rule of the round machine."""

from __future__ import annotations

import pytest

from stalwart.daemon import codec
from stalwart.daemon.policy import PolicyError, RoundPolicy
from stalwart.daemon.round_events import (
    CloseRound,
    JobGaveUp,
    NodeRegistered,
    OpenRound,
    Status,
    WorkerFailed,
)
from stalwart.daemon.rounds import RoundMachine
from stalwart.daemon.stragglers import ExclusionPlan, StragglerDetector, StragglerPolicy


def _detector(members: list[str], factor: float = 1.5, steps: int = 3) -> StragglerDetector:
    d = StragglerDetector(StragglerPolicy(factor, steps))
    d.reset(members)
    return d


def test_a_straggler_needs_consecutive_reports_with_new_steps() -> None:
    d = _detector(["a", "b", "c"])
    for step in range(1, 3):
        d.report("a", step, 0.1)
        d.report("b", step, 0.1)
        d.report("c", step, 0.2)
    assert d.stragglers() == []  # two reports over the threshold
    d.report("c", 2, 0.2)  # a heartbeat (same step) does not count
    assert d.stragglers() == []
    d.report("c", 3, 0.2)
    [v] = d.stragglers()
    assert (v.node_id, v.consecutive, v.since_step) == ("c", 3, 1)
    assert v.busy_time == 0.2 and v.others_median == pytest.approx(0.1)
    d.report("c", 4, 0.12)  # back to normal: the run is broken
    assert d.stragglers() == []


def test_unknown_busy_times_and_non_members_never_make_stragglers() -> None:
    d = _detector(["a", "b"], steps=1)
    d.report("a", 1, 0.0)
    d.report("b", 1, 9.0)  # nothing to compare with: a's busy time is unknown
    d.report("x", 1, 99.0)  # not a member
    assert d.stragglers() == []
    d.report("a", 2, 1.0)
    d.report("b", 2, 9.0)
    assert [v.node_id for v in d.stragglers()] == ["b"]
    d.reset(["a", "b"])  # a new round: busy times of another world are not comparable
    assert d.stragglers() == []


def test_a_uniformly_slow_world_has_no_straggler() -> None:
    d = _detector(["a", "b", "c", "d"], steps=1)
    for step in range(1, 10):
        for node in "abcd":
            d.report(node, step, 0.5 + 0.01 * step)
    assert d.stragglers() == []


def test_exclusion_waits_for_a_checkpoint_newer_than_the_detection() -> None:
    plan = ExclusionPlan()
    assert plan.found("c", 10) and not plan.found("c", 10)
    assert plan.committed(10) == []  # the checkpoint known at detection does not count
    assert plan.committed(20) == ["c"] and plan.committed(30) == []
    plan2 = ExclusionPlan()
    plan2.found("d", None)
    plan2.recovered("d")
    assert plan2.committed(5) == []


def test_policy_validates_straggler_settings() -> None:
    assert RoundPolicy().straggler_factor == 1.5 and RoundPolicy().straggler_steps == 5
    for bad in ({"straggler_factor": 1.0}, {"straggler_factor": "2"}, {"straggler_steps": 0},
                {"exclude_stragglers": 1}):
        with pytest.raises(PolicyError, match=next(iter(bad))):
            RoundPolicy.from_mapping(bad)
    with pytest.raises(ValueError):
        StragglerPolicy(factor=0.9)


def _two_node_round() -> tuple[RoundMachine, OpenRound]:
    m = RoundMachine(RoundPolicy(min_nodes=1, max_nodes=2, join_timeout=0))
    out = m.handle_batch([NodeRegistered("a", "h-a", 1), NodeRegistered("b", "h-b", 1)], 0.0)
    [opened] = [d for d in out if isinstance(d, OpenRound)]
    return m, opened


def test_a_job_that_gave_up_is_closed_and_never_reopened() -> None:
    m, opened = _two_node_round()
    # the give-up and a peer's broken collective in one batch: close, do not restart
    out = m.handle_batch([WorkerFailed("b", opened.number, False, "exit code 1"),
                          JobGaveUp("a", opened.number, "rank 0: training diverged")], 1.0)
    assert [type(d) for d in out] == [CloseRound, Status]
    assert out[0].reason.startswith(codec.GAVE_UP_PREFIX) and "training diverged" in out[0].reason
    assert m.state.round is None
    assert not any(isinstance(d, OpenRound) for t in range(2, 400, 50) for d in m.handle_batch([], float(t)))


def test_a_give_up_after_a_restart_still_closes_the_job() -> None:
    m, opened = _two_node_round()
    out = m.handle_batch([WorkerFailed("b", opened.number, False, "exit code 1")], 1.0)
    [reopened] = [d for d in out if isinstance(d, OpenRound)]
    out = m.handle_batch([JobGaveUp("a", opened.number, "diverged")], 2.0)  # news of the previous round
    assert [d.number for d in out if isinstance(d, CloseRound)] == [reopened.number]
    stale = RoundMachine(RoundPolicy(min_nodes=1, max_nodes=2, join_timeout=0))
    stale.handle_batch([NodeRegistered("a", "h-a", 1)], 0.0)
    stale.state.last_round_number = 5
    assert stale.handle_batch([JobGaveUp("a", 2, "old")], 1.0) == [] or not stale.state.gave_up


def test_a_new_leader_keeps_a_job_that_gave_up_closed() -> None:
    m = RoundMachine.resume(RoundPolicy(min_nodes=1, join_timeout=0), None, 4, 10, 0.0,
                            gave_up="the job gave up: node a: diverged")
    out = m.handle_batch([NodeRegistered("a", "h-a", 1), NodeRegistered("b", "h-b", 1)], 1.0)
    assert not any(isinstance(d, OpenRound) for d in out)
    assert [d.reason for d in out if isinstance(d, Status)] == ["the job gave up: node a: diverged"]
