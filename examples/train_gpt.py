"""A tiny GPT-style model on synthetic token data, trained with stalwart's DeepSpeed trainer.

Runs under plain torchrun (or under the stalwart agent, which sets the same environment)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/train_gpt.py \\
        --ckpt-dir /tmp/gpt-ckpt --steps 50 --steps-log /tmp/gpt-steps.jsonl

Kill it and start it again, at the same or another world size that divides the global batch:
it resumes from the newest good checkpoint and continues with the very samples that were next.
With ``--steps-log``, rank 0 appends one JSON line per step (step, loss, world size, the sample
indices of the step) plus restore and commit events (see ``stalwart.trainer.record``).

Training health: a non-finite loss or gradient norm, or a loss spike (``--spike-*``), rolls back
to the checkpoint before it and skips that data (``--skip``); ``--inject-nan-step`` and
``--inject-spike-step`` fake such faults on one rank. More than ``--max-rollbacks`` faults within
``--rollback-window`` steps stop the job with exit status 3 (``stalwart.trainer.EXIT_DIVERGED``).

The loop is ``Trainer.train`` (``--loop train``, the default): a worker whose peer dies or hangs
re-forms in place when its agent sends the next round, instead of being restarted.
``--loop batches`` is the script's own loop (restart only); both give the same losses.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.trainer import (
    EXIT_DIVERGED,
    HealthConfig,
    PeerConfig,
    StepBatch,
    Trainer,
    TrainerConfig,
    TrainingDiverged,
)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, context: int = 16,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_corpus(length: int, vocab: int, seed: int = 1234) -> torch.Tensor:
    """Tokens with learnable structure: mostly ``next = (3 * prev + 1) % vocab``, sometimes random."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, vocab, (length,), generator=gen)
    keep = torch.rand(length, generator=gen) < 0.8
    out = torch.empty(length, dtype=torch.long)
    out[0] = noise[0]
    for i in range(1, length):
        out[i] = (3 * out[i - 1] + 1) % vocab if keep[i] else noise[i]
    return out


def simulated_compute(seconds: float, tick: float = 0.005) -> None:
    """Stand in for ``seconds`` of accelerator work without burning CPU: sleep in short ticks and
    count only the time the process was running. A plain sleep would run on while the process is
    stopped, so a throttled (slow) worker would not be slower; this one is, like a slow GPU."""
    done = 0.0
    while done < seconds:
        start = time.monotonic()
        time.sleep(tick)
        done += min(time.monotonic() - start, 1.5 * tick)  # a tick that spanned a stop counts once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=50, help="total global steps")
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dataset-len", type=int, default=240, help="number of samples (sequences)")
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling")
    parser.add_argument("--offload", action="store_true", help="offload_optimizer to cpu (DeepSpeedCPUAdam)")
    parser.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--save-every-seconds", type=float, default=None)
    parser.add_argument("--final-save-retry", type=float, default=TrainerConfig.final_save_retry_s,
                        help="seconds the last save is tried again while it does not commit (a full disk)")
    parser.add_argument("--steps-log", default=None, help="rank 0 appends the step record here")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="simulated accelerator seconds per step (to watch it; a throttled worker is slower)")
    parser.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL one rank after this step")
    parser.add_argument("--crash-rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="0 makes the loss independent of the world size (dropout masks follow the ranks)")
    parser.add_argument("--initial-scale-power", type=int, default=12, help="fp16: initial loss scale 2**N")
    parser.add_argument("--loop", choices=("train", "batches"), default="train",
                        help="train: Trainer.train runs the loop and re-forms in place when a peer is lost; "
                             "batches: the script's own loop (a lost peer ends the process)")
    parser.add_argument("--peer-replicas", type=int, default=PeerConfig.replicas,
                        help="buddy copies of each rank's checkpoint part on other nodes (0: none)")
    parser.add_argument("--memory-every", type=int, default=PeerConfig.memory_every,
                        help="a memory generation (a restore point in peers' memory, never written) after every "
                             "N steps that are not saves (0: none)")
    parser.add_argument("--restore-read-mbps", type=float, default=None,
                        help="budget of a restore's reads from storage, MB/s per rank (default: none)")
    parser.add_argument("--collective-timeout", type=float, default=TrainerConfig.collective_timeout_s,
                        help="seconds a collective waits for a hung peer")
    health = parser.add_argument_group("training health (see stalwart.trainer.health)")
    health.add_argument("--no-health", action="store_true", help="no health checks, no rollbacks")
    health.add_argument("--spike-window", type=int, default=HealthConfig.spike_window)
    health.add_argument("--spike-threshold", type=float, default=HealthConfig.spike_threshold, help="in MADs")
    health.add_argument("--spike-min-history", type=int, default=HealthConfig.spike_min_history)
    health.add_argument("--spike-rel-floor", type=float, default=HealthConfig.spike_rel_floor)
    health.add_argument("--skip", choices=("since_checkpoint", "last_k"), default=HealthConfig.skip)
    health.add_argument("--skip-last", type=int, default=HealthConfig.skip_last, help="batches, with --skip last_k")
    health.add_argument("--max-rollbacks", type=int, default=HealthConfig.max_rollbacks)
    health.add_argument("--rollback-window", type=int, default=HealthConfig.rollback_window, help="steps")
    health.add_argument("--max-skipped-updates", type=int, default=HealthConfig.max_skipped_updates,
                        help="fp16 overflow: this many skipped updates in a row are a fault")
    health.add_argument("--inject-nan-step", type=int, action="append", default=[],
                        help="the loss of this step becomes NaN on --inject-rank (once; repeatable)")
    health.add_argument("--inject-spike-step", type=int, action="append", default=[],
                        help="the loss of this step is multiplied by --spike-factor on --inject-rank")
    health.add_argument("--spike-factor", type=float, default=100.0)
    health.add_argument("--inject-rank", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO"),
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(name)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)
    vocab = 64
    model = TinyGPT(vocab=vocab, context=args.context, dropout=args.dropout)
    corpus = synthetic_corpus(args.dataset_len + args.context + 1, vocab)
    ds_config: dict = {
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 10}},
    }
    if args.fp16:
        ds_config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": args.initial_scale_power}
    optimizer = None
    if args.offload:
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        ds_config["optimizer"] = {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.01}}
    else:
        # A torch optimizer needs no compiled DeepSpeed op (FusedAdam would be built on first use).
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    config = TrainerConfig(
        checkpoint_dir=args.ckpt_dir, global_batch=args.global_batch, micro_batch=args.micro_batch,
        dataset_len=args.dataset_len, total_steps=args.steps, seed=args.seed, save_every_steps=args.save_every,
        save_every_seconds=args.save_every_seconds, record_path=args.steps_log,
        final_save_retry_s=args.final_save_retry,
        collective_timeout_s=args.collective_timeout,
        peer=PeerConfig(replicas=args.peer_replicas, memory_every=args.memory_every),
        restore_read_bytes_per_s=args.restore_read_mbps * 1e6 if args.restore_read_mbps else None,
        health=HealthConfig(
            enabled=not args.no_health, spike_window=args.spike_window, spike_threshold=args.spike_threshold,
            spike_min_history=args.spike_min_history, spike_rel_floor=args.spike_rel_floor, skip=args.skip,
            skip_last=args.skip_last, max_rollbacks=args.max_rollbacks, rollback_window=args.rollback_window,
            max_skipped_updates=args.max_skipped_updates,
        ),
    )  # fmt: skip
    trainer = Trainer.initialize(model, ds_config, config, optimizer=optimizer)
    if trainer.rank == args.inject_rank:
        for step in args.inject_nan_step:
            trainer.inject_fault("nan", step)
        for step in args.inject_spike_step:
            trainer.inject_fault("spike", step, args.spike_factor)
    try:
        (train if args.loop == "train" else train_batches)(trainer, corpus, args)
    except TrainingDiverged as exc:
        logging.getLogger("train_gpt").error("rank %d: stopping: %s", trainer.rank, exc)
        sys.exit(EXIT_DIVERGED)


def run_step(engine: object, batch: StepBatch, corpus: torch.Tensor, context: int) -> float:
    """One global step: every micro batch of this rank; returns this rank's mean loss."""
    losses = []
    for indices in batch.micro_batches:
        starts = torch.tensor(indices)
        window = starts[:, None] + torch.arange(context + 1)
        seq = corpus[window]
        loss = engine(seq[:, :-1], seq[:, 1:])  # type: ignore[operator]
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        losses.append(loss.item())
    return sum(losses) / len(losses)


def maybe_crash(trainer: Trainer, args: argparse.Namespace) -> None:
    if args.crash_at_step == trainer.step and trainer.rank == args.crash_rank:
        # Let the checkpoint in flight commit first, so a test knows where the restart resumes;
        # then the worker dies: no cleanup, no final checkpoint.
        trainer.checkpointer.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def train(trainer: Trainer, corpus: torch.Tensor, args: argparse.Namespace) -> None:
    """Trainer.train runs the loop (and re-forms in place); the numerics are those of train_batches."""

    def step(engine: object, batch: StepBatch) -> float:
        if batch.step > trainer.restored.step + 1:  # after the previous step_done, as train_batches does
            if args.step_sleep:
                simulated_compute(args.step_sleep)
            maybe_crash(trainer, args)
        return run_step(engine, batch, corpus, args.context)

    trainer.train(step)
    if args.step_sleep:
        simulated_compute(args.step_sleep)
    maybe_crash(trainer, args)


def train_batches(trainer: Trainer, corpus: torch.Tensor, args: argparse.Namespace) -> None:
    for batch in trainer.batches():
        trainer.step_done(run_step(trainer.engine, batch, corpus, args.context))
        if args.step_sleep:
            simulated_compute(args.step_sleep)
        maybe_crash(trainer, args)
    trainer.finish()


if __name__ == "__main__":
    main()
