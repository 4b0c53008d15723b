"""Constant global batch and exact data position: pure logic, no DeepSpeed, no process group.

The global batch ``G`` never changes when the world does; each data-parallel rank gets
``G / dp_size`` samples per step, fed as ``accumulation_steps`` micro batches of ``micro_batch``.
Every epoch has one deterministic order of the sample indices (a permutation seeded by
``(seed, epoch)``); global step ``k`` of an epoch uses the ``k``-th run of ``G`` indices in that
order, whatever the world size. The position saved in a checkpoint is therefore just
``(epoch, consumed)``, and after a restore at another world size the remaining samples of the
epoch are split among the new ranks: each sample contributes to committed progress once per
epoch. Samples that do not fill a last global batch are dropped (as ``drop_last``).

A rollback after a training-health fault skips the data that led to it: :class:`DataWindow`
ranges of positions in an epoch's order that no batch takes. Batches are built from the positions
outside the windows, in order, so with no window the batches are exactly the runs described above.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.trainer.errors import InvalidWorldSize


def valid_world_sizes(global_batch: int, micro_batch: int) -> list[int]:
    """Data-parallel sizes over which ``global_batch`` splits into whole micro batches."""
    if global_batch <= 0 or micro_batch <= 0 or global_batch % micro_batch:
        return []
    per_micro = global_batch // micro_batch
    return [w for w in range(1, per_micro + 1) if per_micro % w == 0]


def accumulation_steps(global_batch: int, micro_batch: int, dp_size: int) -> int:
    """Gradient accumulation steps for this world; raises :class:`InvalidWorldSize`."""
    valid = valid_world_sizes(global_batch, micro_batch)
    if dp_size not in valid:
        raise InvalidWorldSize(dp_size, global_batch, micro_batch, valid)
    return global_batch // (micro_batch * dp_size)


@dataclass(frozen=True)
class DataPosition:
    """Where the data stands after the last completed step: ``consumed`` samples of ``epoch``'s order."""

    epoch: int = 0
    consumed: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    @classmethod
    def from_json(cls, obj: dict[str, int]) -> DataPosition:
        return cls(epoch=int(obj["epoch"]), consumed=int(obj["consumed"]))


@dataclass(frozen=True, order=True)
class DataWindow:
    """Positions ``[start, end)`` of ``epoch``'s sample order that are skipped (never trained on)."""

    epoch: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.epoch < 0 or not 0 <= self.start < self.end:
            raise ValueError(f"bad data window: epoch {self.epoch}, positions [{self.start}, {self.end})")

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> DataWindow:
        return cls(epoch=int(obj["epoch"]), start=int(obj["start"]), end=int(obj["end"]))


@dataclass(frozen=True)
class StepBatch:
    """The data of one global step.

    ``samples`` is the whole global batch (every rank's), in order; ``micro_batches`` is this
    rank's share, one tuple of indices per accumulation step. ``start``/``end`` are the positions
    in the epoch's order of its first sample and just past its last (``end - start`` exceeds the
    batch only when a skipped window lies in between).
    """

    step: int
    epoch: int
    samples: tuple[int, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    start: int = 0
    end: int = 0

    @property
    def local_samples(self) -> tuple[int, ...]:
        return tuple(i for mb in self.micro_batches for i in mb)


class GlobalBatchSampler:
    """Deterministic, resumable distributed sampler with a constant global batch.

    Not thread-safe; one per rank. Every rank computes the same order, so no communication is
    needed to agree on the data of a step.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch: int,
        micro_batch: int,
        dp_size: int,
        dp_rank: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        position: DataPosition | None = None,
        skip: Iterable[DataWindow] = (),
    ) -> None:
        if dataset_len < global_batch:
            raise ValueError(f"dataset_len {dataset_len} is smaller than one global batch {global_batch}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in a world of {dp_size}")
        self.dataset_len = dataset_len
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.accumulation = accumulation_steps(global_batch, micro_batch, dp_size)
        self._position = position or DataPosition()
        self._order_epoch = -1
        self._order: list[int] = []
        self._skip: dict[int, list[tuple[int, int]]] = {}
        for w in skip:
            self._skip.setdefault(w.epoch, []).append((w.start, w.end))
        for windows in self._skip.values():
            windows.sort()

    @property
    def position(self) -> DataPosition:
        return self._position

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch

    def fork(self, position: DataPosition) -> GlobalBatchSampler:
        """An independent sampler of the same order, world and skipped windows, at ``position``
        (a data loader plans ahead from it without moving this one)."""
        other = GlobalBatchSampler.__new__(GlobalBatchSampler)
        other.__dict__.update(self.__dict__)
        other._position = position
        other._skip = {e: list(ws) for e, ws in self._skip.items()}
        return other

    def epoch_order(self, epoch: int) -> list[int]:
        """The order of all sample indices in ``epoch`` (the same on every rank and every run)."""
        if epoch != self._order_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.dataset_len, generator=gen).tolist()
            else:
                self._order = list(range(self.dataset_len))
            self._order_epoch = epoch
        return self._order

    def next_batch(self, step: int) -> StepBatch:
        """The batch of global step ``step``; advances the position past it."""
        pos = self._position
        taken = self._take(pos.epoch, pos.consumed)
        while taken is None:  # the rest of the epoch does not fill a batch
            pos = DataPosition(pos.epoch + 1, 0)
            taken = self._take(pos.epoch, 0)
        order = self.epoch_order(pos.epoch)
        samples = tuple(order[p] for p in taken)
        per_rank = self.global_batch // self.dp_size
        mine = samples[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        micro = tuple(mine[i : i + self.micro_batch] for i in range(0, per_rank, self.micro_batch))
        end = taken[-1] + 1
        self._position = DataPosition(pos.epoch, end)
        return StepBatch(step=step, epoch=pos.epoch, samples=samples, micro_batches=micro, start=taken[0], end=end)

    def _take(self, epoch: int, start: int) -> list[int] | None:
        """The next ``global_batch`` positions of ``epoch`` from ``start`` outside skipped windows."""
        want, p = self.global_batch, start
        out: list[int] = []
        for ws, we in self._skip.get(epoch, ()):
            if we <= p:
                continue
            n = min(ws - p, want - len(out))
            if n > 0:
                out.extend(range(p, p + n))
                if len(out) == want:
                    return out
            p = max(p, we)
        n = min(self.dataset_len - p, want - len(out))
        if n > 0:
            out.extend(range(p, p + n))
        return out if len(out) == want else None
