"""A DeepSpeed script that keeps its own Dataset, collate_fn and DataLoader workers, under stalwart.

Runs under plain torchrun (or the stalwart agent, which sets the same environment)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/train_dataloader.py \\
        --ckpt-dir /tmp/dl-ckpt --steps 40 --steps-log /tmp/dl-steps.jsonl

What differs from a plain DeepSpeed script is marked ``# stalwart``: ``Trainer.initialize``
instead of ``deepspeed.initialize``, a :class:`~stalwart.trainer.StepBatchSampler` as the
DataLoader's ``batch_sampler`` (instead of a ``DistributedSampler`` and ``batch_size``), and
``Trainer.train`` running the step function. The data order is then exact through restarts,
shrinks, regrows and rollbacks: each sample is trained on once per epoch of committed progress,
whatever the world size, with the DataLoader's workers prefetching as usual. The chaos scenario
``dataloader`` (``stalwart chaos run dataloader``) runs this script through the demo's faults.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from stalwart.trainer import (  # stalwart
    EXIT_DIVERGED,
    HealthConfig,
    StepBatch,
    StepBatchSampler,
    Trainer,
    TrainerConfig,
    TrainingDiverged,
)


class TokenWindows(Dataset[dict[str, torch.Tensor]]):
    """Sample ``i``: the ``context + 1`` tokens of a synthetic corpus from position ``i``."""

    def __init__(self, length: int, context: int, vocab: int, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        n = length + context + 1
        noise = torch.randint(0, vocab, (n,), generator=gen)
        keep = torch.rand(n, generator=gen) < 0.8
        tokens = noise.clone()
        for i in range(1, n):  # mostly next = (3 * prev + 1) % vocab: learnable
            if keep[i]:
                tokens[i] = (3 * tokens[i - 1] + 1) % vocab
        self.tokens, self.length, self.context = tokens, length, context

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[i : i + self.context + 1]}


def collate(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.stack([item["tokens"] for item in items])
    return seq[:, :-1], seq[:, 1:]


class TinyLM(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1]))
        logits = self.head(x + self.mlp(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def simulated_compute(seconds: float, tick: float = 0.005) -> None:
    """``seconds`` of pretend accelerator work that counts only time the process ran (a stopped,
    throttled worker is slower, as a slow GPU would be)."""
    done = 0.0
    while done < seconds:
        start = time.monotonic()
        time.sleep(tick)
        done += min(time.monotonic() - start, 1.5 * tick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=40, help="total global steps")
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dataset-len", type=int, default=240, help="number of samples")
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--zero-stage", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--steps-log", default=None, help="rank 0 appends the step record here")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="simulated accelerator seconds per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0, help="accepted for the chaos runner; unused")
    parser.add_argument("--max-rollbacks", type=int, default=HealthConfig.max_rollbacks)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"),
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(name)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)
    vocab = 64
    dataset = TokenWindows(args.dataset_len, args.context, vocab)
    model = TinyLM(vocab, args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ds_config = {
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 10}},
    }
    # stalwart: the batch sizes go to TrainerConfig (it fills them into ds_config for each world)
    config = TrainerConfig(
        checkpoint_dir=args.ckpt_dir, global_batch=args.global_batch, micro_batch=args.micro_batch,
        dataset_len=len(dataset), total_steps=args.steps, seed=args.seed, save_every_steps=args.save_every,
        record_path=args.steps_log, health=HealthConfig(max_rollbacks=args.max_rollbacks),
    )  # fmt: skip
    trainer = Trainer.initialize(model, ds_config, config, optimizer=optimizer)  # stalwart
    sampler = StepBatchSampler(trainer)  # stalwart
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=args.num_workers)

    def step(engine: object, batch: StepBatch) -> float:
        losses = []
        for inputs, targets in sampler.micro_batches(loader, batch):  # stalwart: this step's micro batches
            loss = engine(inputs, targets)  # type: ignore[operator]
            engine.backward(loss)  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
            losses.append(loss.item())
        if args.step_sleep:
            simulated_compute(args.step_sleep)
        return sum(losses) / len(losses)

    try:
        trainer.train(step)  # stalwart: restores, checkpoints, re-forms in place when the world changes
    except TrainingDiverged as exc:
        logging.getLogger("train_dataloader").error("rank %d: stopping: %s", trainer.rank, exc)
        sys.exit(EXIT_DIVERGED)
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
