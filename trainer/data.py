"""A ``torch.utils.data`` batch sampler over the trainer's exact, resumable sample order.

A script keeps its ``Dataset``, ``collate_fn`` and DataLoader workers; only the batch sampler is
ours::

    sampler = StepBatchSampler(trainer)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=2)

    def step(engine, batch):                       # Trainer.train's step function
        for inputs in sampler.micro_batches(loader, batch):
            loss = engine(inputs)
            engine.backward(loss)
            engine.step()
        return loss.item()

The sampler yields this rank's micro batches of sample indices, step after step, in the order
:class:`~stalwart.trainer.batching.GlobalBatchSampler` gives the trainer, so the DataLoader's
workers can prefetch ahead of training. The order depends on the world (its size, this rank),
the data position and the skipped windows, all of which change at a re-form, a restore or a
rollback; :meth:`StepBatchSampler.micro_batches` notices (the trainer's sampler was replaced, or
the step is not the one planned next), drops the loader's iterator with its prefetched batches
and starts a new one at that step. Each micro batch it hands out is checked against the step's
indices (:class:`DataOrderError` otherwise), so the trainer's step record, which the chaos
runner checks for "every sample used exactly once", is what the loader really delivered.

A loader must keep its batches in order (``in_order=True``, DataLoader's default). Iterating the
loader directly (``for inputs in loader``) also works: it starts at the step after the
trainer's current one and runs to ``total_steps``, but nothing then follows a world change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import Sampler

from stalwart.trainer.batching import DataPosition, GlobalBatchSampler, StepBatch
from stalwart.trainer.errors import TrainerError


class DataOrderError(TrainerError):
    """The loader delivered micro batches out of the trainer's order (a loader with
    ``in_order=False``, its iterator used elsewhere, or a batch sampler shared by two loaders)."""


class _Config(Protocol):
    total_steps: int | None


class DataSource(Protocol):
    """What the sampler reads of a :class:`~stalwart.trainer.Trainer`: its sampler (replaced at
    every restore, re-form and rollback), the last finished step and ``config.total_steps``."""

    sampler: GlobalBatchSampler
    step: int
    config: _Config


@dataclass(frozen=True)
class _Plan:
    sampler: GlobalBatchSampler  # a fork, positioned at ``first_step``'s data
    first_step: int
    last_step: int | None


class StepBatchSampler(Sampler[list[int]]):
    """Batch sampler for ``DataLoader(batch_sampler=...)``: this rank's micro batches in the
    trainer's order. One per loader; not thread-safe (a DataLoader draws indices from its main
    thread only)."""

    def __init__(self, source: DataSource) -> None:
        self._source = source
        self._next_plan: _Plan | None = None
        self._issued: deque[tuple[int, int, tuple[int, ...]]] = deque()
        self._iter: Iterator[Any] | None = None
        self._owner: GlobalBatchSampler | None = None  # the trainer's sampler the iterator follows
        self._next_step = 0

    def _current_plan(self) -> _Plan:
        src = self._source
        return _Plan(src.sampler.fork(src.sampler.position), src.step + 1, src.config.total_steps)

    def __iter__(self) -> Iterator[list[int]]:
        plan, self._next_plan = self._next_plan or self._current_plan(), None
        self._issued.clear()
        step = plan.first_step
        while plan.last_step is None or step <= plan.last_step:
            batch = plan.sampler.next_batch(step)
            for i, indices in enumerate(batch.micro_batches):
                self._issued.append((step, i, indices))
                yield list(indices)
            step += 1

    def __len__(self) -> int:
        """Micro batches left to ``total_steps`` (a DataLoader's ``len``); TypeError without one."""
        plan = self._current_plan()
        if plan.last_step is None:
            raise TypeError("the trainer has no total_steps: the sampler is endless")
        return max(0, plan.last_step - plan.first_step + 1) * plan.sampler.accumulation

    def micro_batches(self, loader: Any, batch: StepBatch) -> Iterator[Any]:
        """The loader's items for ``batch``, one per micro batch of this rank, in order.

        ``loader`` must be the DataLoader built on this sampler. Starts a new iterator of it (its
        workers too, unless ``persistent_workers``) when the data moved since the last step: a
        restore, re-form or rollback. Raises :class:`DataOrderError` if what it delivers is not
        ``batch``'s micro batches.
        """
        if getattr(loader, "batch_sampler", None) is not self:
            raise DataOrderError("the loader was not built with this sampler (DataLoader(batch_sampler=sampler))")
        owner = self._source.sampler
        if self._iter is None or owner is not self._owner or batch.step != self._next_step:
            self._restart(loader, owner, batch)
        self._next_step = -1  # until this step's micro batches have all been handed out
        for i, expected in enumerate(batch.micro_batches):
            item = next(self._iter)  # type: ignore[arg-type]
            got = self._issued.popleft() if self._issued else None
            if got != (batch.step, i, expected):
                self._iter = None
                raise DataOrderError(f"step {batch.step} micro batch {i}: the loader delivered {got}, "
                                     f"the trainer's order has {expected}")
            yield item
        self._next_step = batch.step + 1

    def close(self) -> None:
        """Drop the loader's iterator now (its workers exit). Otherwise it lives as long as this
        sampler, which it refers back to: a garbage collection of the pair waits for the workers."""
        self._iter = None
        self._owner = None

    def _restart(self, loader: Any, owner: GlobalBatchSampler, batch: StepBatch) -> None:
        self._iter = None  # drop the old iterator (and its prefetched batches) first
        self._next_plan = _Plan(owner.fork(DataPosition(batch.epoch, batch.start)), batch.step,
                                self._source.config.total_steps)
        self._owner = owner
        self._iter = iter(loader)
