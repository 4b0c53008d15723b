"""The leader's goodput bookkeeping: productive time, redone steps as badput, each fault's cost."""

from __future__ import annotations

from stalwart.daemon.goodput import GoodputTracker


def _train(t: GoodputTracker, steps: range, start: float, step_time: float = 1.0) -> float:
    now = start
    for step in steps:
        now = start + (step - steps.start + 1) * step_time
        t.progress(step, now)
    return now


def test_steady_training_is_all_goodput() -> None:
    t = GoodputTracker()
    t.started(0.0)
    now = _train(t, range(1, 101), 0.0)
    g = t.summary(now)
    assert g.step == 100 and g.step_time == 1.0
    assert g.ratio is not None and 0.98 <= g.ratio <= 1.0


def test_a_fault_costs_the_standstill_and_the_steps_trained_again() -> None:
    t = GoodputTracker()
    t.started(0.0)
    now = _train(t, range(1, 51), 0.0)  # step 50 at t=50
    t.fault("n2", "worker-failed", now)
    t.round_opened(now + 5.0)  # 5 s to re-form, then the world restores step 40 and trains on
    end = _train(t, range(41, 71), now + 5.0)  # step 50 again at t=65, step 70 at t=85
    g = t.summary(end)
    assert g.step == 70
    (fault,) = g.faults
    assert fault.node == "n2" and fault.kind == "worker-failed" and fault.step == 50
    # passed step 50 at step 51, t=66: 16 s after the fault, less the one step beyond it
    assert fault.cost == 15.0
    # 70 useful steps of 1 s in 85 s
    assert abs(g.productive - 69.0) < 1e-9 and g.ratio is not None and abs(g.ratio - 69 / 85) < 1e-9


def test_a_new_leader_carries_the_totals_over() -> None:
    t = GoodputTracker()
    t.resume(productive=90.0, elapsed=100.0, step=90, now=1000.0)
    t.progress(90, 1000.0)
    t.progress(100, 1010.0)
    g = t.summary(1010.0)
    assert g.elapsed == 110.0 and g.step == 100 and abs(g.productive - 100.0) < 1e-9
