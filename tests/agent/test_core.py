"""The agent's pure membership decisions (agent/core.py): no etcd, gRPC or processes."""

from __future__ import annotations

import dataclasses

import pytest

from stalwart.agent.core import (
    JoinFacts,
    ProcState,
    WorkerFacts,
    join_readiness,
    keep_verdict,
    overdue_reform,
    refill_in_place,
    stale_hello,
)

HEALTHY = WorkerFacts(running=True, stopping=False, local_rank=0, connected=True, reforming=False, stalled=False,
                      proc=ProcState.RUNNING, can_reform=True)


def test_a_healthy_worker_is_kept() -> None:
    assert keep_verdict(HEALTHY, local_world_size=1).keep


def test_a_stalled_worker_whose_process_runs_is_kept_it_waits_for_the_rank_that_hung() -> None:
    # The survivor blocked in a collective with a SIGSTOPped peer: its agent saw no step for the
    # stall timeout, but the culprit is the stopped process on the other node.
    verdict = keep_verdict(dataclasses.replace(HEALTHY, stalled=True), local_world_size=1)
    assert verdict.keep


def test_a_stopped_worker_is_replaced_at_once() -> None:
    verdict = keep_verdict(dataclasses.replace(HEALTHY, stalled=True, proc=ProcState.STOPPED), local_world_size=1)
    assert not verdict.keep and verdict.unhealthy and "SIGSTOP" in verdict.why


@pytest.mark.parametrize(("change", "why", "unhealthy"), [
    ({"running": False}, "not running", True),
    ({"stopping": True}, "not running", True),
    ({"local_rank": 1}, "local rank 1 is not in the new round", False),
    ({"connected": False}, "not connected", True),
    ({"proc": ProcState.EXITED}, "exited", True),
    ({"can_reform": False}, "cannot re-form in place", False),
])
def test_workers_that_cannot_be_kept_say_why(change: dict[str, object], why: str, unhealthy: bool) -> None:
    verdict = keep_verdict(dataclasses.replace(HEALTHY, **change), local_world_size=1)  # type: ignore[arg-type]
    assert not verdict.keep and why in verdict.why and verdict.unhealthy is unhealthy


def test_a_spare_still_acknowledging_an_earlier_reform_is_kept_though_its_worker_stream_is_not_open() -> None:
    facts = dataclasses.replace(HEALTHY, connected=False, reforming=True, can_reform=False)
    assert keep_verdict(facts, local_world_size=1).keep


def test_an_overdue_reform_of_a_worker_waiting_for_its_peers_is_not_killed() -> None:
    # The cascade: survivors waiting for a cold joiner were killed after a fixed 10 s.
    overdue = overdue_reform(ProcState.RUNNING, connected=True, waited=250.0, joining=True)
    assert not overdue.kill and "waiting for its peers" in overdue.why


@pytest.mark.parametrize(("proc", "connected", "joining", "kill", "why"), [
    (ProcState.STOPPED, True, True, True, "stopped"),
    (ProcState.RUNNING, False, True, True, "lost its channel"),
    (ProcState.RUNNING, True, False, True, "did not begin"),  # it ignores its Reform
    (ProcState.EXITED, True, False, False, "exited"),
])
def test_an_overdue_reform_kills_only_on_local_facts(proc: ProcState, connected: bool, joining: bool, kill: bool,
                                                     why: str) -> None:
    overdue = overdue_reform(proc, connected=connected, waited=41.0, joining=joining)
    assert overdue.kill is kill and why in overdue.why


OUTSIDE = JoinFacts(in_round=False, started=True, workers=2, ready_spares=0, spares_disabled=False,
                    reform_in_place=True, warming_for=None)


def test_a_node_outside_an_open_round_is_not_ready_until_a_spare_per_worker_is_warm() -> None:
    assert not join_readiness(OUTSIDE, replace_timeout=300).ready
    one = join_readiness(dataclasses.replace(OUTSIDE, ready_spares=1, warming_for=5.0), replace_timeout=300)
    assert not one.ready and "1 of 2" in one.why
    assert join_readiness(dataclasses.replace(OUTSIDE, ready_spares=2, warming_for=9.0), replace_timeout=300).ready


@pytest.mark.parametrize(("change", "why"), [
    ({"in_round": True}, "in the round"),
    ({"started": False}, "first round"),
    ({"reform_in_place": False}, "reform_in_place = false"),
    ({"spares_disabled": True}, "cannot run warm spares"),
    ({"warming_for": 301.0}, "joining cold"),
])
def test_a_node_is_ready_when_there_is_nothing_to_warm_or_no_point_waiting(change: dict[str, object],
                                                                           why: str) -> None:
    readiness = join_readiness(dataclasses.replace(OUTSIDE, **change), replace_timeout=300)  # type: ignore[arg-type]
    assert readiness.ready and why in readiness.why


def test_spares_wait_for_the_rounds_first_step_unless_the_node_needs_them_now() -> None:
    from stalwart.agent.core import spares_may_start

    assert not spares_may_start(warming=False, replacing=False, workers=2, stepped=1)
    assert spares_may_start(warming=False, replacing=False, workers=2, stepped=2)
    assert not spares_may_start(warming=False, replacing=False, workers=0, stepped=0)  # before the first round
    assert spares_may_start(warming=True, replacing=False, workers=2, stepped=0)
    assert spares_may_start(warming=False, replacing=True, workers=2, stepped=0)
    # niced spares take only what the workers leave: they start with the round's workers
    assert spares_may_start(warming=False, replacing=False, workers=2, stepped=0, niced=True)
    assert not spares_may_start(warming=False, replacing=False, workers=0, stepped=0, niced=True)


def test_lost_time_before_a_step_by_cause() -> None:
    from stalwart.agent.core import lost_before_step

    assert lost_before_step(12.0, 0.5, "startup") == ("startup", 11.5)
    assert lost_before_step(1.5, 0.5, "re-form") == ("re-form", 1.0)
    assert lost_before_step(3.0, 0.5, "") == ("pause", 2.5)
    assert lost_before_step(0.9, 0.5, "") is None  # within two normal steps: not a pause
    assert lost_before_step(0.4, 0.5, "re-form") is None


def test_ring_neighbours_are_the_next_k_members_wrapping_around() -> None:
    from stalwart.agent.core import ring_neighbours

    members = ["a", "b", "c", "d", "e"]
    assert ring_neighbours(members, "d", 3) == ["e", "a", "b"]
    assert ring_neighbours(members, "a", 0) == []
    assert ring_neighbours(["a", "b", "c"], "b", 3) == ["c", "a"]  # fewer in a small world, never itself
    assert ring_neighbours(members, "x", 3) == []  # not a member
    # every member is checked by exactly k others
    checked = [n for m in members for n in ring_neighbours(members, m, 2)]
    assert sorted(checked) == sorted(members * 2)


def test_a_worker_that_died_before_beginning_its_reform_is_refilled_in_the_same_round_unless_it_was_rank_0() -> None:
    assert refill_in_place(joining=False, new_rank=1, warm_spare=True, spares=1)
    assert refill_in_place(joining=False, new_rank=3, warm_spare=False, spares=0)  # a new process comes anyway
    assert not refill_in_place(joining=False, new_rank=1, warm_spare=False, spares=1)  # would start cold
    assert not refill_in_place(joining=True, new_rank=1, warm_spare=True, spares=1)  # may have broken its peers
    # rank 0 may already host the round's store: its peers' joins broke with it, the round fails
    assert not refill_in_place(joining=False, new_rank=0, warm_spare=True, spares=1)


def test_a_spare_given_its_rank_while_still_warming_is_not_killed_for_a_late_reform() -> None:
    overdue = overdue_reform(ProcState.RUNNING, connected=True, waited=45.0, joining=False, warming=True)
    assert not overdue.kill and "warming" in overdue.why
    # past the caller's patience it is one that never began, like any other
    assert overdue_reform(ProcState.RUNNING, connected=True, waited=125.0, joining=False, warming=False).kill
    # warming or not, a stopped one or one that lost its channel is not waited for
    assert overdue_reform(ProcState.STOPPED, connected=True, waited=45.0, joining=False, warming=True).kill
    assert overdue_reform(ProcState.RUNNING, connected=False, waited=45.0, joining=False, warming=True).kill


def test_a_hello_for_an_older_round_at_a_place_another_live_process_holds_is_stale() -> None:
    """The worker an agent was stopping when it handed off reconnects to the next agent: it must
    not take the channel of the worker that holds its place now (the two would displace each
    other's stream, and a command for the rank would reach the stale one)."""
    args = {"hello_round": 2, "hello_pid": 10, "current_round": 7, "holder_pid": 20, "holder_running": True,
            "pending": False}
    assert "round 7's worker of its local rank is pid 20" in str(stale_hello(**args))
    assert stale_hello(**{**args, "hello_pid": 20}) is None  # the holder itself, re-forming from an older round
    assert stale_hello(**{**args, "hello_round": 7}) is None  # a worker of this round
    assert stale_hello(**{**args, "pending": True}) is None  # told to take the place (a spare)
    assert stale_hello(**{**args, "holder_running": False}) is None  # the place is free: a restarted worker
    assert stale_hello(**{**args, "holder_pid": None}) is None
    assert stale_hello(**{**args, "current_round": None}) is None
