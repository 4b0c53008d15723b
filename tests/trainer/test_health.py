"""Pure tests of the training-health rules (no process group, no DeepSpeed engine): the fault
detector, the rollback limit and journal, data windows skipped by the sampler, the step record's
helpers, and ckpt's newest-checkpoint-at-or-below-a-step load that a rollback uses."""

from __future__ import annotations

import collections
import math
import random
from pathlib import Path

import pytest
import torch

from stalwart.ckpt import Checkpointer, SaveConfig, SingleCoordinator, load
from stalwart.trainer.batching import DataPosition, DataWindow, GlobalBatchSampler
from stalwart.trainer.health import (
    HealthConfig,
    HealthMonitor,
    Rollback,
    RollbackLedger,
    read_journal,
    spike_score,
    windows_of,
    write_journal,
)
from stalwart.trainer.record import committed_steps, skipped_samples

FAST = HealthConfig(spike_window=20, spike_min_history=5, spike_threshold=10.0, spike_rel_floor=0.05)


def _warm(monitor: HealthMonitor, losses: list[float]) -> None:
    for step, loss in enumerate(losses, 1):
        assert monitor.check(step, loss) is None
        monitor.accept(step, loss)


# --- the detector -------------------------------------------------------------------------------


def test_spike_score_is_distance_from_the_median_in_floored_mads() -> None:
    s = spike_score([1.0, 2.0, 3.0, 4.0, 100.0], 13.0, rel_floor=0.0)
    assert (s.median, s.mad, s.score) == (3.0, 1.0, 10.0)  # the outlier 100 moves neither
    flat = spike_score([2.0] * 10, 2.01, rel_floor=0.05)
    assert flat.mad == 0 and flat.scale == pytest.approx(0.1) and flat.score == pytest.approx(0.1)


def test_a_loss_far_above_the_recent_median_is_a_spike() -> None:
    m = HealthMonitor(FAST)
    _warm(m, [2.0 + 0.01 * (i % 3) for i in range(10)])
    fault = m.check(11, 40.0)
    assert fault is not None and fault.kind == "spike" and fault.step == 11
    assert "MADs above the median" in fault.reason


def test_no_spike_before_enough_history_and_never_for_a_drop() -> None:
    m = HealthMonitor(FAST)
    _warm(m, [2.0, 2.01, 2.02, 2.0])  # 4 < spike_min_history
    assert m.check(5, 1000.0) is None
    m.accept(5, 2.01)
    assert m.check(6, 1000.0) is not None
    assert m.check(6, 0.001) is None  # a loss that falls is progress, not a fault


def test_relative_floor_keeps_a_flat_plateau_from_calling_a_tiny_move_a_spike() -> None:
    no_floor = HealthMonitor(HealthConfig(spike_window=20, spike_min_history=5, spike_rel_floor=0.0))
    floored = HealthMonitor(FAST)
    for m in (no_floor, floored):
        _warm(m, [3.0] * 10)  # MAD 0
    assert no_floor.check(11, 3.001) is not None
    assert floored.check(11, 3.001) is None  # needs > 10 * 0.05 * 3.0 = 1.5 above the median
    assert floored.check(11, 4.6) is not None


def test_gaussian_noise_and_a_falling_trend_raise_no_fault_with_the_defaults() -> None:
    m = HealthMonitor(HealthConfig())
    rng = random.Random(7)
    faults = []
    for step in range(1, 20_001):
        loss = 4.0 * math.exp(-step / 3000) + 0.5 + rng.gauss(0.0, 0.08)
        fault = m.check(step, loss)
        if fault is not None:
            faults.append(fault)
        m.accept(step, loss)
    assert faults == []


@pytest.mark.parametrize("loss, grad_norm, kind", [(math.nan, 1.0, "nonfinite_loss"), (math.inf, 1.0, "nonfinite_loss"),
                                                   (2.0, math.nan, "nonfinite_grad_norm"),
                                                   (2.0, math.inf, "nonfinite_grad_norm")])
def test_non_finite_loss_or_gradient_norm_is_a_fault_from_the_first_step(loss: float, grad_norm: float,
                                                                         kind: str) -> None:
    fault = HealthMonitor(FAST).check(1, loss, grad_norm=grad_norm)
    assert fault is not None and fault.kind == kind


def test_a_nan_on_one_rank_is_a_fault_even_if_the_mean_looks_finite() -> None:
    fault = HealthMonitor(FAST).check(3, 2.0, loss_finite=False)
    assert fault is not None and fault.kind == "nonfinite_loss"


def test_gradient_norm_check_can_be_switched_off_and_none_means_unknown() -> None:
    m = HealthMonitor(HealthConfig(check_grad_norm=False))
    assert m.check(1, 2.0, grad_norm=math.inf) is None
    assert HealthMonitor(FAST).check(1, 2.0, grad_norm=None) is None


def test_fp16_overflow_steps_the_engine_skipped_are_not_faults_and_stay_out_of_the_history() -> None:
    m = HealthMonitor(FAST)
    _warm(m, [2.0 + 0.01 * (i % 3) for i in range(10)])
    # DeepSpeed's loss scaler dropped the update: grad norm inf, loss anything.
    for loss in (2.0, 80.0, math.inf, math.nan):
        assert m.check(11, loss, grad_norm=math.inf, update_skipped=True) is None
        m.accept(11, loss, update_skipped=True)
    assert len(m.history) == 10
    assert m.check(12, math.nan) is not None  # the same values on an applied update are faults


def test_a_long_run_of_skipped_updates_is_a_fault() -> None:
    """A loss scale that never recovers: the gradients are NaN whatever the scale."""
    m = HealthMonitor(HealthConfig(max_skipped_updates=3))
    for step in (1, 2):
        assert m.check(step, 2.0, grad_norm=math.inf, update_skipped=True) is None
        m.accept(step, 2.0, update_skipped=True)
    fault = m.check(3, 2.0, grad_norm=math.inf, update_skipped=True)
    assert fault is not None and fault.kind == "skipped_updates"
    m.accept(3, 2.0)  # an applied update ends the run
    assert m.check(4, 2.0, update_skipped=True) is None


def test_disabled_checks_never_fault() -> None:
    assert HealthMonitor(HealthConfig(enabled=False)).check(1, math.nan, grad_norm=math.nan) is None


def test_history_keeps_the_last_window_and_round_trips() -> None:
    m = HealthMonitor(FAST)
    _warm(m, [float(i) for i in range(30)])
    assert [s for s, _ in m.history] == list(range(11, 31))
    again = HealthMonitor(FAST, m.to_json())
    assert again.history == m.history


@pytest.mark.parametrize("kwargs, message", [
    ({"spike_window": 2}, "spike_window"),
    ({"spike_min_history": 200}, "spike_min_history"),
    ({"spike_threshold": 0}, "spike_threshold"),
    ({"spike_rel_floor": -1}, "spike_rel_floor"),
    ({"skip": "everything"}, "skip must be"),
    ({"skip_last": 0}, "skip_last"),
    ({"max_rollbacks": -1}, "max_rollbacks"),
    ({"rollback_window": 0}, "rollback_window"),
    ({"max_skipped_updates": 0}, "max_skipped_updates"),
])
def test_health_config_is_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HealthConfig(**kwargs)  # type: ignore[arg-type]


# --- the rollback limit and the journal ---------------------------------------------------------


def _rb(fault: int, restored: int, start: int) -> Rollback:
    return Rollback(fault, restored, "nan", (DataWindow(0, start, start + 12),), time=float(fault))


def test_limit_counts_rollbacks_within_the_window_on_either_side() -> None:
    cfg = HealthConfig(max_rollbacks=2, rollback_window=100)
    ledger = RollbackLedger()
    assert not ledger.exhausted(50, cfg)
    ledger.add(_rb(50, 40, 480))
    ledger.add(_rb(60, 40, 600))
    assert ledger.exhausted(70, cfg)  # a third fault within 100 steps: give up
    assert ledger.exhausted(10, cfg)  # after a restart from an older checkpoint, step numbers repeat
    assert not ledger.exhausted(200, cfg)
    assert RollbackLedger().exhausted(1, HealthConfig(max_rollbacks=0))


def test_ledger_merges_without_duplicates_and_round_trips(tmp_path: Path) -> None:
    a, b = _rb(50, 40, 480), _rb(60, 40, 600)
    ledger = RollbackLedger([a])
    ledger.merge([a, b, Rollback.from_json(a.to_json())])
    assert len(ledger) == 2 and ledger.windows() == [DataWindow(0, 480, 492), DataWindow(0, 600, 612)]
    write_journal(str(tmp_path), ledger)
    assert RollbackLedger.from_json(read_journal(str(tmp_path))).to_json() == ledger.to_json()


def test_a_missing_or_torn_journal_reads_as_empty(tmp_path: Path) -> None:
    assert read_journal(str(tmp_path)) == []
    (tmp_path / "health-rollbacks.json").write_text('{"format": 1, "rollb')
    assert read_journal(str(tmp_path)) == []


# --- skipped data windows -----------------------------------------------------------------------


def _sampler(position: DataPosition | None = None, skip: tuple[DataWindow, ...] = (), *, n: int = 100,
             g: int = 10, world: int = 2) -> GlobalBatchSampler:
    return GlobalBatchSampler(n, g, 1, world, 0, seed=3, position=position, skip=skip)


def test_without_windows_batches_are_the_plain_runs_with_their_positions() -> None:
    s = _sampler()
    order = s.epoch_order(0)
    for k in range(10):
        b = s.next_batch(k + 1)
        assert (b.start, b.end, b.samples) == (10 * k, 10 * k + 10, tuple(order[10 * k : 10 * k + 10]))
    assert s.next_batch(11).epoch == 1


def test_a_skipped_window_is_jumped_and_its_samples_never_handed_out() -> None:
    skip = (DataWindow(0, 30, 60),)
    s = _sampler(DataPosition(0, 30), skip)
    b = s.next_batch(4)
    assert (b.start, b.end) == (60, 70)
    used = collections.Counter(i for k in range(5, 8) for i in s.next_batch(k).samples) + collections.Counter(b.samples)
    order = s.epoch_order(0)
    assert set(used) == set(order[60:100]) and max(used.values()) == 1
    assert s.next_batch(8).epoch == 1  # 30 skipped + 30 before + 40 after: the epoch is used up


def test_every_sample_is_used_once_or_skipped_with_unaligned_windows() -> None:
    """Windows need not align with batches (the global batch may have changed since)."""
    skip = (DataWindow(0, 5, 12), DataWindow(0, 8, 20), DataWindow(0, 47, 53), DataWindow(1, 0, 4))
    s = _sampler(skip=skip, n=103, g=10)
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for k in range(1, 20):
        b = s.next_batch(k)
        per_epoch[b.epoch].update(b.samples)
    kept = [p for p in range(103) if not (5 <= p < 20 or 47 <= p < 53)]  # 82 positions: 8 batches
    order0 = s.epoch_order(0)
    assert per_epoch[0] == collections.Counter(order0[p] for p in kept[:80])  # the last 2 dropped (drop_last)
    order1 = s.epoch_order(1)
    assert set(per_epoch[1]) == {order1[p] for p in range(4, 94)}


def test_replaying_from_a_checkpoint_position_reproduces_the_batches() -> None:
    """The trainer finds the data to skip by replaying the sampler from the restored position."""
    first = _sampler(skip=(DataWindow(0, 20, 30),))
    batches = [first.next_batch(k) for k in range(1, 8)]
    restored = DataPosition(0, batches[2].end)
    replay = _sampler(restored, skip=(DataWindow(0, 20, 30),))
    assert [replay.next_batch(k) for k in range(4, 8)] == batches[3:]


def test_windows_of_batches_split_at_the_epoch_boundary() -> None:
    s = _sampler(DataPosition(0, 80))
    batches = [s.next_batch(k) for k in (9, 10, 11)]
    assert [b.epoch for b in batches] == [0, 0, 1]
    assert windows_of(batches) == (DataWindow(0, 80, 100), DataWindow(1, 0, 10))


def test_data_window_is_validated() -> None:
    with pytest.raises(ValueError):
        DataWindow(0, 10, 10)
    assert DataWindow.from_json(DataWindow(1, 2, 3).to_json()) == DataWindow(1, 2, 3)


# --- the step record ----------------------------------------------------------------------------


def _step(k: int, samples: list[int], loss: float = 1.0) -> dict[str, object]:
    return {"event": "step", "step": k, "epoch": 0, "loss": loss, "samples": samples}


def test_committed_steps_drop_the_steps_a_rollback_undid_and_skipped_samples_lists_its_data() -> None:
    events = [
        {"event": "restore", "step": 0},
        _step(1, [0, 1]), _step(2, [2, 3]), {"event": "commit", "step": 2},
        _step(3, [4, 5]),
        {"event": "fault", "step": 4, "samples": [6, 7], "loss": math.nan},
        {"event": "rollback", "step": 2, "fault_step": 4, "skipped_samples": [4, 5, 6, 7],
         "windows": [{"epoch": 0, "start": 4, "end": 8, "samples": [4, 5, 6, 7]}]},
        _step(3, [8, 9]), _step(4, [10, 11]), {"event": "commit", "step": 4}, _step(5, [12, 13]),
    ]
    committed = committed_steps(events)  # type: ignore[arg-type]
    assert sorted(committed) == [1, 2, 3, 4]  # contiguous; step 5 is not committed yet
    assert committed[3]["samples"] == [8, 9]
    assert skipped_samples(events) == {0: [4, 5, 6, 7]}  # type: ignore[arg-type]
    used = [i for e in committed.values() for i in e["samples"]]  # type: ignore[union-attr]
    assert sorted(used + skipped_samples(events)[0]) == list(range(12))  # type: ignore[arg-type]


# --- ckpt: newest good checkpoint at or below a step -------------------------------------------


def test_load_max_step_takes_the_newest_checkpoint_at_or_below_it(tmp_path: Path) -> None:
    root = str(tmp_path)
    saver = Checkpointer(root, SaveConfig(), coordinator=SingleCoordinator())
    for step in (2, 4, 6):
        saver.save(step, {"w": torch.full((3,), float(step))}, {"step": step})
        saver.wait()
    saver.close()
    out = torch.zeros(3)
    assert load(root, {"w": out}, max_step=5, coordinator=SingleCoordinator()).step == 4
    assert torch.equal(out, torch.full((3,), 4.0))
    assert load(root, {"w": out}, max_step=6, coordinator=SingleCoordinator()).step == 6
    from stalwart.ckpt import CheckpointNotFound

    with pytest.raises(CheckpointNotFound):
        load(root, {"w": out}, max_step=1, coordinator=SingleCoordinator())
