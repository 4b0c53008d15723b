"""The training-loop side of stalwart: restore, data in order, async checkpoints, SIGTERM, progress.

The script keeps calling DeepSpeed itself; the trainer only wraps what must be exact across
failures. A typical loop::

    trainer = Trainer.initialize(model, ds_config, TrainerConfig(...), model_parameters=...)
    engine = trainer.engine
    for batch in trainer.batches():
        for indices in batch.micro_batches:
            loss = engine(make_batch(indices))
            engine.backward(loss)
            engine.step()
        trainer.step_done(mean_loss_of_this_rank)
    trainer.finish()

Order of events on every rank (all ranks must call the same methods in the same order):

1. ``initialize`` starts torch.distributed (NCCL with CUDA, else gloo), checks that the global
   batch splits over this world (:class:`InvalidWorldSize` otherwise), fills the batch sizes into
   the DeepSpeed config and calls ``deepspeed.initialize``.
2. The constructor restores the newest good checkpoint (ZeRO partitions resharded to this world,
   optimizer, scheduler, loss scaler, counters, data position, RNG), or starts fresh if none exists.
3. ``batches()`` yields each global step's samples; ``step_done()`` closes the step: one small
   all-reduce agrees on the mean loss, a pending SIGTERM and a time-based checkpoint, then the step
   is recorded, reported to the agent and, every N steps or T seconds, saved asynchronously.
4. On SIGTERM (on any rank) the next ``step_done`` saves, waits for the commit and exits 0.
   ``finish()`` saves the last step and waits for its commit.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.ckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFound,
    CommitInfo,
    LayoutMismatch,
    RetentionPolicy,
    SaveConfig,
    SaveHandle,
    TorchDistCoordinator,
    list_checkpoints,
    load,
    read_manifest,
)
from stalwart.ckpt.storage import set_aside
from stalwart.trainer.agent_client import AgentClient
from stalwart.trainer.batching import DataPosition, GlobalBatchSampler, StepBatch, accumulation_steps
from stalwart.trainer.errors import IncompatibleCheckpoint, StepOutOfOrder, UnsupportedConfig
from stalwart.trainer.record import StepRecorder
from stalwart.trainer.zero_state import ZeroState

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer needs beyond DeepSpeed's config. Validated on construction.

    ``save_every_steps`` / ``save_every_seconds``: checkpoint when either is due (``None``: never
    for that rule); the time rule follows rank 0's clock. ``total_steps``: ``batches()`` ends there
    (``None``: never). ``record_path``: rank 0 appends the step record there (see ``record.py``).
    """

    checkpoint_dir: str
    global_batch: int
    micro_batch: int
    dataset_len: int
    total_steps: int | None = None
    seed: int = 0
    shuffle: bool = True
    save_every_steps: int | None = 100
    save_every_seconds: float | None = None
    keep_last: int = 3
    record_path: str | None = None
    exit_on_sigterm: bool = True
    dist_timeout_s: float = 600.0
    commit_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ValueError("checkpoint_dir must be set")
        if self.micro_batch < 1 or self.global_batch < self.micro_batch or self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be a positive multiple of micro_batch ({self.micro_batch})"
            )
        if self.dataset_len < self.global_batch:
            raise ValueError(f"dataset_len ({self.dataset_len}) must hold one global batch ({self.global_batch})")
        if self.total_steps is not None and self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {self.total_steps}")
        if self.save_every_steps is not None and self.save_every_steps < 1:
            raise ValueError(f"save_every_steps must be >= 1 or None, got {self.save_every_steps}")
        if self.save_every_seconds is not None and self.save_every_seconds <= 0:
            raise ValueError(f"save_every_seconds must be positive or None, got {self.save_every_seconds}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.dist_timeout_s <= 0 or self.commit_timeout_s <= 0:
            raise ValueError("dist_timeout_s and commit_timeout_s must be positive")


@dataclass(frozen=True)
class RestoreInfo:
    """Where this run started: checkpoint ``step`` (0 and ``saved_world_size`` 0 for a fresh start)."""

    step: int
    position: DataPosition
    saved_world_size: int
    skipped: list[tuple[int, str]] = field(default_factory=list)


def backend_for_device() -> str:
    """NCCL where CUDA exists (production), gloo on CPU (tests, laptops)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class Trainer:
    """One per rank. Construct with :meth:`initialize`, or pass an engine you built yourself
    (its batch sizes must match ``config``). Raises :class:`InvalidWorldSize`,
    :class:`UnsupportedConfig`, :class:`IncompatibleCheckpoint`, or ckpt's
    :class:`~stalwart.ckpt.CheckpointNotFound` when checkpoints exist but none is loadable."""

    def __init__(self, engine: Any, config: TrainerConfig, *, agent: AgentClient | None = None,
                 save_config: SaveConfig | None = None) -> None:
        if not dist.is_initialized():
            raise UnsupportedConfig("torch.distributed must be initialized (Trainer.initialize does it)")
        self.engine = engine
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.accumulation = accumulation_steps(config.global_batch, config.micro_batch, self.world_size)
        self._check_engine()
        self.state = ZeroState(engine)
        timeout = datetime.timedelta(seconds=config.dist_timeout_s)
        # The per-step agreement gets its own CPU group: it must not wait behind the persist
        # thread's commit traffic, and must not need a GPU tensor.
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        self._coord = TorchDistCoordinator(config.commit_timeout_s)
        self.recorder = StepRecorder(config.record_path if self.rank == 0 else None)
        self.agent = agent if agent is not None else AgentClient(rank=self.rank)
        self.restored = self._restore()
        self.sampler = GlobalBatchSampler(
            config.dataset_len, config.global_batch, config.micro_batch, self.world_size, self.rank,
            seed=config.seed, shuffle=config.shuffle, position=self.restored.position,
        )  # fmt: skip
        base = save_config or SaveConfig(commit_timeout_s=config.commit_timeout_s)
        retention = RetentionPolicy(keep_last=config.keep_last)
        self.checkpointer = Checkpointer(
            config.checkpoint_dir, SaveConfig(**{**base.__dict__, "retention": retention}),
            coordinator=self._coord, on_commit=self._on_commit,
        )  # fmt: skip
        self.step = self.restored.step
        self.stopped = False
        self._batch: StepBatch | None = None
        self._last_saved = self.restored.step
        self._last_save_time = time.monotonic()
        self._step_started = time.perf_counter()
        self._pending: list[SaveHandle] = []
        self._sigterm = False
        self._closed = False
        # Python delivers signals to the main thread only; elsewhere the agent's SIGTERM is not seen.
        on_main = threading.current_thread() is threading.main_thread()
        self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm) if on_main else None

    @classmethod
    def initialize(cls, model: torch.nn.Module, ds_config: dict[str, Any], config: TrainerConfig, *,
                   agent: AgentClient | None = None, **ds_kwargs: Any) -> Trainer:
        """Start torch.distributed if needed, check the world, then ``deepspeed.initialize``.

        ``ds_kwargs`` go to ``deepspeed.initialize`` (``optimizer``, ``model_parameters``,
        ``lr_scheduler``, ...). The batch sizes in ``ds_config`` are filled in for this world; any
        already there must agree with ``config``.
        """
        import deepspeed

        if not dist.is_initialized():
            deepspeed.init_distributed(
                dist_backend=backend_for_device(), timeout=datetime.timedelta(seconds=config.dist_timeout_s)
            )
        world = dist.get_world_size()
        gas = accumulation_steps(config.global_batch, config.micro_batch, world)  # fail before any work
        wanted = {"train_batch_size": config.global_batch, "train_micro_batch_size_per_gpu": config.micro_batch}
        for key, value in wanted.items():
            if key in ds_config and ds_config[key] != value:
                raise ValueError(f"ds_config[{key!r}] = {ds_config[key]} disagrees with TrainerConfig ({value})")
        ds_config = {**ds_config, **wanted, "gradient_accumulation_steps": gas}
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, **ds_kwargs)
        return cls(engine, config, agent=agent)

    # --- the loop ------------------------------------------------------------------------------

    def batches(self) -> Iterator[StepBatch]:
        """Each global step's data, from the restored position on, until ``total_steps``.

        Call :meth:`step_done` once per batch before taking the next.
        """
        while not self.stopped and (self.config.total_steps is None or self.step < self.config.total_steps):
            if self._batch is not None and self._batch.step != self.step:
                raise StepOutOfOrder(f"step {self._batch.step} was handed out but step_done was not called")
            self._batch = self.sampler.next_batch(self.step + 1)
            yield self._batch

    def step_done(self, loss: float | torch.Tensor) -> float:
        """Close the step whose batch was handed out last; returns the mean loss over all ranks.

        ``loss`` is this rank's mean loss over its micro batches. Collective. May checkpoint; on a
        SIGTERM seen by any rank it saves, waits for the commit and raises ``SystemExit(0)``
        (``exit_on_sigterm``) or sets :attr:`stopped`.
        """
        batch = self._batch
        if batch is None or batch.step != self.step + 1:
            raise StepOutOfOrder("step_done without a batch from batches()")
        if int(self.engine.global_steps) != batch.step:
            raise StepOutOfOrder(
                f"engine is at step {self.engine.global_steps} after batch {batch.step}: "
                f"call engine.step() once per micro batch ({self.accumulation} per step)"
            )
        self.step = batch.step
        cfg = self.config
        time_due = (self.rank == 0 and cfg.save_every_seconds is not None
                    and time.monotonic() - self._last_save_time >= cfg.save_every_seconds)  # fmt: skip
        flags = torch.tensor([float(loss), float(self._sigterm), float(time_due)], dtype=torch.float64)
        dist.all_reduce(flags, group=self._control)
        mean_loss = flags[0].item() / self.world_size
        now = time.perf_counter()
        step_time, self._step_started = now - self._step_started, now
        self.recorder.write("step", step=self.step, epoch=batch.epoch, world_size=self.world_size, loss=mean_loss,
                            samples=list(batch.samples))
        self.agent.step(self.step, step_time, mean_loss)
        self._report_saves()
        if flags[1].item() > 0:
            log.warning("rank %d step %d: SIGTERM: final checkpoint, then exit", self.rank, self.step)
            self.finish()
            self.stopped = True
            if cfg.exit_on_sigterm:
                raise SystemExit(0)
        elif flags[2].item() > 0 or (cfg.save_every_steps is not None and self.step % cfg.save_every_steps == 0):
            self.save()
        return mean_loss

    def save(self) -> SaveHandle:
        """Checkpoint the current step asynchronously (returns after the snapshot). Collective."""
        self.state.ensure_optimizer_state()
        meta = {"trainer": self._trainer_meta(), "rng": _rng_state()}
        handle = self.checkpointer.save(self.step, self.state.save_tensors(), meta)
        self._pending.append(handle)
        self._last_saved = self.step
        self._last_save_time = time.monotonic()
        return handle

    def finish(self) -> CommitInfo | None:
        """Save the current step unless saved already, wait for its commit, release resources.

        Raises what the last save raised (e.g. :class:`~stalwart.ckpt.CommitFailed`).
        """
        if self._closed:
            return None
        try:
            if self._last_saved != self.step:
                self.save()
            return self.checkpointer.wait()
        finally:
            self._closed = True
            self._report_saves()
            self.checkpointer.close()
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
            self.agent.close("finished" if not self._sigterm else "sigterm")

    # --- internals -----------------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._sigterm = True  # acted on at the next step boundary, on every rank at once

    def _on_commit(self, info: CommitInfo) -> None:
        self.recorder.write("commit", step=info.step)

    def _report_saves(self) -> None:
        for handle in [h for h in self._pending if h.done()]:
            self._pending.remove(handle)
            exc = handle.exception()
            if exc is None:
                info = handle.result()
                self.agent.checkpoint(info.step, info.path, True, info.snapshot_s)
            else:
                log.error("rank %d step %d: checkpoint not committed: %s", self.rank, handle.step, exc)
                self.recorder.write("save_failed", step=handle.step, error=str(exc))
                self.agent.checkpoint(handle.step, "", False)

    def _check_engine(self) -> None:
        e = self.engine
        got = (int(e.train_batch_size()), int(e.train_micro_batch_size_per_gpu()), int(e.gradient_accumulation_steps()))
        want = (self.config.global_batch, self.config.micro_batch, self.accumulation)
        if got != want:
            raise UnsupportedConfig(f"engine batch sizes (global, micro, accumulation) {got} differ from {want}")
        if int(getattr(e, "dp_world_size", self.world_size)) != self.world_size:
            raise UnsupportedConfig("tensor/pipeline parallelism is not supported (data parallel only)")

    def _trainer_meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "format": FORMAT, "step": self.step, "world_size": self.world_size, "global_batch": c.global_batch,
            "micro_batch": c.micro_batch, "dataset_len": c.dataset_len, "seed": c.seed, "shuffle": c.shuffle,
            "position": self.sampler.position.to_json(), "zero": self.state.metadata(),
        }  # fmt: skip

    def _restore(self) -> RestoreInfo:
        root = self.config.checkpoint_dir
        if self.rank == 0:
            any_committed = any(c.committed for c in list_checkpoints(root))
            self._coord.broadcast(json.dumps(any_committed).encode(), self.config.commit_timeout_s)
        else:
            any_committed = json.loads(self._coord.broadcast(None, self.config.commit_timeout_s))
        if not any_committed:
            log.info("rank %d: no checkpoint under %s: starting at step 0", self.rank, root)
            self.recorder.write("restore", step=0, world_size=self.world_size, saved_world_size=0)
            return RestoreInfo(0, DataPosition(), 0)
        self.state.ensure_optimizer_state()
        targets, staged = self.state.load_targets()
        try:
            result = load(root, targets, coordinator=self._coord, timeout_s=self.config.commit_timeout_s)
        except LayoutMismatch as exc:
            raise self._incompatible(None) or IncompatibleCheckpoint(str(exc)) from exc
        except CheckpointNotFound:
            log.error("rank %d: checkpoints exist under %s but none is loadable", self.rank, root)
            raise
        mismatch = self._incompatible(result.step)
        if mismatch is not None:
            raise mismatch
        for step, reason in result.skipped:
            log.warning("rank %d: skipped checkpoint step %d: %s", self.rank, step, reason)
        if result.skipped:
            # The re-run after this fall-back saves those steps again: free their numbers first.
            if self.rank == 0:
                for step, _ in result.skipped:
                    set_aside(root, step)
            if dist.is_initialized():
                dist.barrier()
        self.state.apply_loaded(staged)
        meta = result.metadata[0]["trainer"]
        self._check_data(meta, result.step)
        self.state.apply_metadata(meta["zero"])
        saved_world = result.world_size
        if self.rank < saved_world:
            _set_rng_state(result.metadata[self.rank]["rng"])
        else:
            _seed_rng(self.config.seed * 1_000_003 + result.step * 1009 + self.rank)
        log.info("rank %d: restored step %d (saved by %d ranks, now %d)", self.rank, result.step, saved_world,
                 self.world_size)
        self.recorder.write("restore", step=result.step, world_size=self.world_size, saved_world_size=saved_world,
                            skipped=[s for s, _ in result.skipped])
        return RestoreInfo(result.step, DataPosition.from_json(meta["position"]), saved_world, result.skipped)

    def _check_data(self, meta: dict[str, Any], step: int) -> None:
        c = self.config
        for key in ("dataset_len", "seed", "shuffle"):
            if meta[key] != getattr(c, key):
                raise IncompatibleCheckpoint(
                    f"checkpoint step {step} was trained with {key}={meta[key]!r}, this run has {getattr(c, key)!r}: "
                    "the data order would change", step=step,
                )  # fmt: skip
        if meta["global_batch"] != c.global_batch:
            log.warning("rank %d: global batch changed from %d to %d at step %d", self.rank, meta["global_batch"],
                        c.global_batch, step)

    def _incompatible(self, step: int | None) -> IncompatibleCheckpoint | None:
        """The first tensor (model order) where checkpoint ``step`` (default: newest readable) differs."""
        steps = [step] if step is not None else [c.step for c in reversed(list_checkpoints(self.config.checkpoint_dir))
                                                 if c.committed]
        for s in steps:
            try:
                manifest = read_manifest(self.config.checkpoint_dir, s)
            except CheckpointError:
                continue
            expected = self.state.logical_shapes()
            for name, shape in expected:
                rec = manifest.tensors.get(name)
                if rec is None:
                    return IncompatibleCheckpoint(f"checkpoint step {s} has no tensor {name!r} (model: {list(shape)})",
                                                  tensor=name, step=s)
                if tuple(rec.shape) != shape:
                    return IncompatibleCheckpoint(
                        f"tensor {name!r}: checkpoint step {s} has shape {list(rec.shape)}, model has {list(shape)}",
                        tensor=name, step=s,
                    )  # fmt: skip
            names = {n for n, _ in expected}
            extra = sorted(n for n in manifest.tensors if n.startswith(("fp32/", "frozen/")) and n not in names)
            if extra:
                return IncompatibleCheckpoint(f"checkpoint step {s} has tensor {extra[0]!r}, which the model lacks",
                                              tensor=extra[0], step=s)
            return None
        return None


def _rng_state() -> dict[str, Any]:
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": bytes(torch.get_rng_state().numpy()),
        "cuda": [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def _seed_rng(seed: int) -> None:
    """A rank with no saved RNG stream (the world grew) gets a fresh, reproducible one."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
