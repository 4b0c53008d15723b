"""Constant global batch, exact data position and the step record: pure logic, no processes."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.trainer import (
    DataPosition,
    GlobalBatchSampler,
    InvalidWorldSize,
    TrainerConfig,
    accumulation_steps,
    committed_steps,
    valid_world_sizes,
)


def test_accumulation_keeps_the_global_batch() -> None:
    assert [accumulation_steps(24, 2, w) for w in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]


def test_invalid_world_size_lists_the_valid_ones() -> None:
    with pytest.raises(InvalidWorldSize) as info:
        accumulation_steps(12, 2, 4)
    assert info.value.valid_sizes == [1, 2, 3, 6] == valid_world_sizes(12, 2)
    assert info.value.world_size == 4


def test_config_rejects_a_global_batch_that_micro_batches_cannot_fill() -> None:
    with pytest.raises(ValueError):
        TrainerConfig(checkpoint_dir="x", global_batch=10, micro_batch=4, dataset_len=100)


def _epoch_use(worlds: list[int], steps_each: list[int], n: int = 60, g: int = 12, b: int = 2) -> list[int]:
    """Run segments at different world sizes, each resuming from the previous one's position."""
    position = DataPosition()
    step = 0
    used: list[int] = []
    for world, steps in zip(worlds, steps_each, strict=True):
        samplers = [GlobalBatchSampler(n, g, b, world, r, seed=3, position=position) for r in range(world)]
        for _ in range(steps):
            step += 1
            batches = [s.next_batch(step) for s in samplers]
            assert len({bt.samples for bt in batches}) == 1  # every rank agrees on the global batch
            for bt in batches:
                assert len(bt.micro_batches) == g // (b * world)
                used.extend(bt.local_samples)
        position = samplers[0].position
    return used


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 6]), st.integers(0, 3)), min_size=1, max_size=6))
def test_each_sample_once_per_epoch_across_resizes(segments: list[tuple[int, int]]) -> None:
    worlds = [w for w, _ in segments]
    steps = [s for _, s in segments]
    total = sum(steps)
    used = _epoch_use(worlds + [2], steps + [5 * 2 - total % 5])  # finish on a whole number of epochs
    counts = collections.Counter(used)
    assert set(counts) <= set(range(60))
    epochs = len(used) // 60
    assert len(used) % 60 == 0 and all(c == epochs for c in counts.values()) and len(counts) == 60


def test_epochs_have_different_orders_and_drop_the_remainder() -> None:
    s = GlobalBatchSampler(30, 12, 2, 1, 0, seed=0)
    first = [s.next_batch(k + 1) for k in range(2)]
    second = s.next_batch(3)
    assert second.epoch == 1 and [b.epoch for b in first] == [0, 0]
    assert len({i for b in first for i in b.samples}) == 24  # 6 samples of epoch 0 dropped
    assert s.position == DataPosition(1, 12)


def test_committed_steps_drop_lost_work_and_uncommitted_tail() -> None:
    events = [
        {"event": "restore", "step": 0},
        *({"event": "step", "step": k, "samples": [k]} for k in range(1, 8)),
        {"event": "commit", "step": 4},
        {"event": "restore", "step": 4},  # steps 5..7 were lost
        *({"event": "step", "step": k, "samples": [100 + k]} for k in range(5, 10)),
        {"event": "commit", "step": 8},
    ]
    out = committed_steps(events)
    assert sorted(out) == list(range(1, 9))
    assert [out[k]["samples"] for k in (4, 5, 8)] == [[4], [105], [108]]
