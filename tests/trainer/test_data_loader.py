"""StepBatchSampler under real DataLoaders (one with worker processes): every rank's loader
delivers exactly the trainer's micro batches, and the data position stays exact through a shrink,
a regrow, a restart that redoes uncommitted steps, an in-place re-form and a rollback window."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from stalwart.trainer import DataOrderError, DataPosition, DataWindow, GlobalBatchSampler, StepBatchSampler

N, G, B = 96, 24, 2  # 4 steps an epoch; world sizes 1, 2, 3, 4, 6, 12


class Indices(Dataset[dict[str, torch.Tensor]]):
    """A user's dataset: each item carries its own index, so what the loader delivered is known."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(i), "x": torch.full((3,), float(i))}


@dataclass
class _Config:
    total_steps: int | None


class Rank:
    """The part of a Trainer the sampler reads, driven as Trainer.batches/step_done drive it."""

    def __init__(self, world: int, rank: int, position: DataPosition, step: int, total: int,
                 skip: tuple[DataWindow, ...] = ()) -> None:
        self.config = _Config(total)
        self.resume(world, rank, position, step, skip)

    def resume(self, world: int, rank: int, position: DataPosition, step: int,
               skip: tuple[DataWindow, ...] = ()) -> None:
        self.sampler = GlobalBatchSampler(N, G, B, world, rank, seed=5, position=position, skip=skip)
        self.step = step


def _loader(sampler: StepBatchSampler, workers: int) -> DataLoader[dict[str, torch.Tensor]]:
    return DataLoader(Indices(), batch_sampler=sampler, num_workers=workers)


def _train(ranks: list[Rank], samplers: list[StepBatchSampler], loaders: list[DataLoader], steps: int,
           committed: dict[int, tuple[int, ...]]) -> None:
    """``steps`` global steps on every rank; records each step's samples as the loaders gave them."""
    for _ in range(steps):
        delivered: list[int] = []
        batches = []
        for r, s, dl in zip(ranks, samplers, loaders, strict=True):
            batch = r.sampler.next_batch(r.step + 1)
            batches.append(batch)
            for mb, item in zip(batch.micro_batches, s.micro_batches(dl, batch), strict=True):
                assert item["index"].tolist() == list(mb)
                delivered.extend(item["index"].tolist())
            r.step = batch.step
        assert sorted(delivered) == sorted(batches[0].samples)
        committed[batches[0].step] = tuple((batches[0].epoch, i) for i in delivered)


def test_every_sample_once_through_shrink_regrow_restart_and_reform() -> None:
    committed: dict[int, tuple[int, ...]] = {}
    # world 3, 5 steps (into epoch 1); rank 1's loader has worker processes
    ranks = [Rank(3, r, DataPosition(), 0, 14) for r in range(3)]
    samplers = [StepBatchSampler(r) for r in ranks]
    loaders = [_loader(s, 2 if i == 1 else 0) for i, s in enumerate(samplers)]
    _train(ranks, samplers, loaders, 5, committed)
    position, step = ranks[0].sampler.position, ranks[0].step
    # shrink in place to 2: the same sampler objects follow their rank's new sampler
    for i, r in enumerate(ranks[:2]):
        r.resume(2, i, position, step)
    _train(ranks[:2], samplers[:2], loaders[:2], 3, committed)
    checkpoint = (ranks[0].sampler.position, ranks[0].step)
    _train(ranks[:2], samplers[:2], loaders[:2], 1, committed)  # a step lost by the crash below
    for s in samplers:
        s.close()
    # regrow to 4 new processes from the checkpoint: step 9 is redone
    ranks = [Rank(4, r, *checkpoint, 14) for r in range(4)]
    samplers = [StepBatchSampler(r) for r in ranks]
    loaders = [_loader(s, 1 if i == 3 else 0) for i, s in enumerate(samplers)]
    _train(ranks, samplers, loaders, 14 - ranks[0].step, committed)
    for s in samplers:
        s.close()
    assert sorted(committed) == list(range(1, 15))
    used = [s for step in sorted(committed) for s in committed[step]]
    assert len(used) == len(set(used)) == 14 * G
    by_epoch = {e: sorted(i for ee, i in used if ee == e) for e in {e for e, _ in used}}
    assert by_epoch[0] == by_epoch[1] == by_epoch[2] == list(range(N))  # 3 whole epochs, then 2 steps


def test_a_rollback_window_is_skipped_by_the_loader_too() -> None:
    window = DataWindow(0, G, 2 * G)  # the second batch of epoch 0 led to a fault
    rank = Rank(1, 0, DataPosition(0, G), 1, 4, skip=(window,))
    sampler = StepBatchSampler(rank)
    committed: dict[int, tuple[int, ...]] = {}
    _train([rank], [sampler], [_loader(sampler, 0)], 2, committed)  # the rest of epoch 0
    order = rank.sampler.epoch_order(0)
    used = {i for step in committed.values() for _, i in step}
    assert used == set(order[2 * G :]) and not used & set(order[G : 2 * G])


def test_len_counts_the_micro_batches_left_and_plain_iteration_starts_after_the_current_step() -> None:
    rank = Rank(2, 1, DataPosition(), 0, 4)
    trainer_view = GlobalBatchSampler(N, G, B, 2, 1, seed=5)
    sampler = StepBatchSampler(rank)
    loader = _loader(sampler, 0)
    assert len(loader) == 4 * 6
    expected = [list(mb) for k in range(1, 5) for mb in trainer_view.next_batch(k).micro_batches]
    assert [item["index"].tolist() for item in loader] == expected


def test_a_loader_of_another_sampler_is_refused() -> None:
    rank = Rank(1, 0, DataPosition(), 0, 4)
    sampler = StepBatchSampler(rank)
    other = _loader(StepBatchSampler(rank), 0)
    batch = rank.sampler.next_batch(1)
    with pytest.raises(DataOrderError):
        next(sampler.micro_batches(other, batch))
