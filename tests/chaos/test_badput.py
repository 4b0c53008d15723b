"""Lost time per fault and badput by cause (chaos/badput.py): pure, on made-up step samples."""

from __future__ import annotations

import pytest

from stalwart.chaos.badput import account
from stalwart.chaos.report import FaultRecord, RoundChange, Sample


def _steps(start_t: float, first: int, n: int, round_: int = 1, dt: float = 0.1) -> list[Sample]:
    return [Sample(start_t + i * dt, first + i, 3, round_) for i in range(n)]


def _paused_2s_after_step_30() -> list[Sample]:
    """Steps 1..30 every 0.1 s from 1.0 (the last at 3.9), then 31..60 of round 2 after a 2 s pause."""
    return _steps(1.0, 1, 30) + _steps(1.0 + 29 * 0.1 + 2.0, 31, 30, round_=2)


def _total(acc: object) -> float:
    return acc.training_s + sum(acc.badput.values())  # type: ignore[attr-defined]


def test_a_run_without_faults_loses_only_startup_and_finish() -> None:
    samples = _steps(5.0, 1, 50)
    acc = account(samples, [], [], wall_s=11.0, committed_step=50)
    assert acc.normal_step_s == pytest.approx(0.1)
    assert acc.badput["startup"] == pytest.approx(4.9)
    assert acc.badput["finish"] == pytest.approx(11.0 - samples[-1].t)
    assert acc.training_s == pytest.approx(5.0)
    assert _total(acc) == pytest.approx(11.0)


def test_a_pause_is_charged_to_the_fault_before_it_not_to_one_injected_during_it() -> None:
    samples = _paused_2s_after_step_30()
    first = FaultRecord("kill-worker", "n1", injected_at=3.85, detected_at=4.0)
    during = FaultRecord("kill-daemon", "d0", injected_at=4.5, detected_at=6.5)
    acc = account(samples, [first, during], [RoundChange(4.2, 2, 3, "node n1 worker failed")], wall_s=samples[-1].t,
                  committed_step=60)
    assert first.kind and acc.lost_by_fault[0] == pytest.approx(1.9)
    assert acc.lost_by_fault[1] == 0.0
    # the pause [3.9 + 0.1, 5.9]: detection until 4.0, decision until the round at 4.2, then re-form
    assert acc.badput["detection"] == pytest.approx(0.0)
    assert acc.badput["decision"] == pytest.approx(0.2)
    assert acc.badput["re-form and restore"] == pytest.approx(1.7)
    assert _total(acc) == pytest.approx(samples[-1].t)


def test_a_pause_after_training_settled_again_is_not_charged_to_an_old_fault() -> None:
    samples = _steps(1.0, 1, 40) + _steps(1.0 + 39 * 0.1 + 1.0, 41, 10)
    old = FaultRecord("kill-etcd", "m1", injected_at=1.5)  # 20+ normal steps before the pause
    acc = account(samples, [old], [], wall_s=samples[-1].t, committed_step=50)
    assert acc.lost_by_fault == [0.0]
    assert acc.badput["other"] == pytest.approx(0.9)


def test_steps_redone_after_a_restore_are_charged_to_the_fault_whose_recovery_restored() -> None:
    # steps 1..20, a fault at 2.95, a 1 s pause, then steps 16..40 again from checkpoint 15
    before = _steps(1.0, 1, 20)
    after = _steps(before[-1].t + 1.1, 16, 25, round_=2)
    fault = FaultRecord("kill-agent", "n1", injected_at=2.95)
    acc = account(before + after, [fault], [], wall_s=after[-1].t, committed_step=40)
    assert acc.redone_by_fault == [5]  # steps 16..20 ran twice
    assert acc.badput["recomputation"] == pytest.approx(0.5)
    assert acc.lost_by_fault[0] == pytest.approx(1.0 + 0.5)
    assert _total(acc) == pytest.approx(after[-1].t)


def test_no_samples_is_all_other() -> None:
    acc = account([], [FaultRecord("kill-worker", "n1", 1.0)], [], wall_s=7.0, committed_step=0)
    assert acc.badput["other"] == 7.0 and acc.training_s == 0.0


def test_a_pause_at_a_regrow_is_charged_to_the_fault_that_took_the_joiner_out() -> None:
    # n1's agent killed at 2.0 (a short pause), training settles, n1 regrows at 6.0 with a pause
    # that a later, unrelated fault (a daemon kill at 5.5) did not cause.
    samples = _steps(1.0, 1, 10) + _steps(2.5, 11, 35) + _steps(2.5 + 34 * 0.1 + 1.5, 46, 10)
    kill_agent = FaultRecord("kill-agent", "n1", injected_at=1.95)
    kill_daemon = FaultRecord("kill-daemon", "daemon0", injected_at=5.5)
    rounds = [RoundChange(0.5, 1, 3, "first round", members=("n0", "n1", "n2")),
              RoundChange(2.1, 2, 2, "node n1 lost", members=("n0", "n2")),
              RoundChange(6.0, 3, 3, "regrow (checkpoint at step 40 committed)", members=("n0", "n2", "n1"))]
    acc = account(samples, [kill_agent, kill_daemon], rounds, wall_s=samples[-1].t, committed_step=55)
    assert acc.lost_by_fault[1] == 0.0
    assert acc.lost_by_fault[0] == pytest.approx(0.5 + 1.4)


def test_a_regrow_is_not_charged_to_a_fault_that_reached_the_joiner_while_it_was_out() -> None:
    # n1's worker killed at 1.95 (n1 leaves to warm a spare), its agent killed at 4.0 while it is
    # out (its workers train on: nothing of the world changes), then n1 regrows at 6.0: the
    # regrow's pause is the kill-worker's recovery, not the agent kill's.
    samples = _steps(1.0, 1, 10) + _steps(2.5, 11, 35) + _steps(2.5 + 34 * 0.1 + 1.5, 46, 10)
    kill_worker = FaultRecord("kill-worker", "n1", injected_at=1.95)
    kill_agent = FaultRecord("kill-agent", "n1", injected_at=4.0)
    rounds = [RoundChange(0.5, 1, 3, "first round", members=("n0", "n1", "n2")),
              RoundChange(2.1, 2, 2, "node n1 worker failed", members=("n0", "n2")),
              RoundChange(6.0, 3, 3, "regrow (checkpoint at step 40 committed)", members=("n0", "n2", "n1"))]
    acc = account(samples, [kill_worker, kill_agent], rounds, wall_s=samples[-1].t, committed_step=55)
    assert acc.lost_by_fault[1] == 0.0
    assert acc.lost_by_fault[0] == pytest.approx(0.5 + 1.4)


def test_steps_redone_after_a_restore_without_a_pause_are_the_restores_fault_not_the_next_pauses() -> None:
    # n1 regrows at 4.05 and the world goes back from step 31 to 29 within a normal step (a fast
    # re-form); an agent killed at 5.0 then causes a pause. The three redone steps are the regrow's
    # (its culprit: the kill-worker that took n1 out), not the agent kill's.
    samples = _steps(1.0, 1, 31) + _steps(1.0 + 30 * 0.1 + 0.1, 29, 10, round_=2) \
        + _steps(1.0 + 30 * 0.1 + 0.1 + 9 * 0.1 + 0.6, 39, 10, round_=2)
    kill_worker = FaultRecord("kill-worker", "n1", injected_at=0.5)
    kill_agent = FaultRecord("kill-agent", "n1", injected_at=5.0)
    rounds = [RoundChange(0.2, 1, 3, "first round", members=("n0", "n1", "n2")),
              RoundChange(0.6, 2, 2, "node n1 worker failed", members=("n0", "n2")),
              RoundChange(4.05, 3, 3, "regrow (checkpoint at step 28 committed)", members=("n0", "n2", "n1"))]
    acc = account(samples, [kill_worker, kill_agent], rounds, wall_s=samples[-1].t, committed_step=48)
    assert acc.redone_by_fault == [3, 0]  # steps 29, 30 and 31 ran twice
    assert acc.lost_by_fault[1] == pytest.approx(0.5)


def test_a_pause_that_a_data_plane_fault_starts_just_after_a_daemon_kill_is_the_data_plane_faults() -> None:
    # steps every 0.1 s until 3.9; a daemon killed at 3.85, a worker hung at 4.05 (the step after
    # 3.9 was due at 4.0): the hang stopped the step, the daemon's absence only lengthened it
    samples = _paused_2s_after_step_30()
    daemon = FaultRecord("kill-daemon", "d0", injected_at=3.85, detected_at=5.5)
    hang = FaultRecord("hang-worker", "n1", injected_at=4.05, detected_at=5.6)
    acc = account(samples, [daemon, hang], [RoundChange(5.7, 2, 3, "node n1 worker failed")], wall_s=samples[-1].t,
                  committed_step=60)
    assert acc.lost_by_fault == [0.0, pytest.approx(1.9)]
    assert _total(acc) == pytest.approx(samples[-1].t)
    # a data-plane fault later than that (4.25: the gap was a pause by 4.1) did not start it
    late = FaultRecord("hang-worker", "n1", injected_at=4.25, detected_at=5.6)
    acc = account(samples, [daemon, late], [], wall_s=samples[-1].t, committed_step=60)
    assert acc.lost_by_fault == [pytest.approx(1.9), 0.0]
