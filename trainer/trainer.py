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
5. Training health (``health.py``): the same all-reduce carries whether any rank saw a non-finite
   loss or gradient norm, so every rank judges the step alike. A fault (that, or a loss spike) is
   not recorded as progress and not saved: the trainer restores, in-process, the newest checkpoint
   before it, skips the data that led to it and goes on from the restored step (the next batch is
   the one after the skipped data). Too many faults raise :class:`TrainingDiverged`.
6. In-place re-form (``reform.py``): with :meth:`Trainer.train` the trainer runs the loop, so it
   can catch what a collective raises when a peer dies (gloo: "Connection closed by peer") or
   hangs (after ``collective_timeout_s``). It then waits for the agent's Reform (the new world's
   rank, size and master address), leaves the old process groups, joins the new world, rebuilds
   the DeepSpeed engine for the same model and restores the last committed checkpoint resharded
   to it, without restarting the process. A warm spare (``STALWART_SPARE=1``) waits in
   :meth:`Trainer.initialize` for its assignment and joins the same way. The old
   ``batches()``/``step_done()`` loop still works; it can only be restarted.

This module keeps the constructor, the world a trainer is attached to and the step loop; the rest
is in ``config.py``, ``engine.py``, ``restore.py``, ``saves.py``, ``rollback.py`` (training health),
``reforming.py`` (the in-place re-form) and ``spare.py``, composed into :class:`Trainer`.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from stalwart.ckpt import Checkpointer, CommitInfo, RetentionPolicy, SaveConfig, SaveHandle, TorchDistCoordinator
from stalwart.proto.contract import ENV_ROUND
from stalwart.trainer.agent_client import AgentClient
from stalwart.trainer.batching import DataPosition, GlobalBatchSampler, StepBatch, accumulation_steps
from stalwart.trainer.client_state import ClientStates
from stalwart.trainer.config import ReformTimings, RestoreInfo, StartupTimings, TrainerConfig, process_started_at
from stalwart.trainer.engine import _check_engine, _EngineRecipe, _grad_norm, _warm_up, backend_for_device
from stalwart.trainer.errors import StepOutOfOrder, UnsupportedConfig
from stalwart.trainer.health import HealthMonitor, RollbackLedger
from stalwart.trainer.jit_lock import guard_extension_builds
from stalwart.trainer.peer import PeerFill, PeerReplicas
from stalwart.trainer.record import StepRecorder
from stalwart.trainer.reform import ReformSpec, is_collective_error, is_spare, join_world, peer_hosts, store_ports
from stalwart.trainer.reforming import ReformingMixin
from stalwart.trainer.restore import RestoreMixin
from stalwart.trainer.rollback import RollbackMixin
from stalwart.trainer.saves import SavesMixin
from stalwart.trainer.spare import join_as_spare
from stalwart.trainer.world_sockets import world_sockets
from stalwart.trainer.zero_state import ZeroState

log = logging.getLogger(__name__)


class _ReformPending(Exception):
    """The agent sent a Reform between steps: leave the loop and re-form (not an error)."""


class Trainer(ReformingMixin, RestoreMixin, RollbackMixin, SavesMixin):
    """One per rank. Construct with :meth:`initialize`, or pass an engine you built yourself
    (its batch sizes must match ``config``; such a trainer cannot re-form in place). Raises
    :class:`InvalidWorldSize`, :class:`UnsupportedConfig`, :class:`IncompatibleCheckpoint`, or
    ckpt's :class:`~stalwart.ckpt.CheckpointNotFound` when checkpoints exist but none is loadable."""

    def __init__(self, engine: Any, config: TrainerConfig, *, agent: AgentClient | None = None,
                 save_config: SaveConfig | None = None, _recipe: _EngineRecipe | None = None,
                 _required: bool = False) -> None:
        if not dist.is_initialized():
            raise UnsupportedConfig("torch.distributed must be initialized (Trainer.initialize does it)")
        self.engine = engine
        self.config = config
        self._recipe = _recipe
        self._save_config = save_config
        self.round = int(os.environ.get(ENV_ROUND, "0"))
        self.agent = agent if agent is not None else AgentClient(rank=dist.get_rank())
        self.health = HealthMonitor(config.health)
        self.ledger = RollbackLedger()
        self.rollbacks = 0  # rollbacks done by this process
        self.reforms: list[ReformTimings] = []  # in-place re-forms done by this process
        self._injected: dict[int, list[tuple[str, float]]] = {}
        self._inject_lock = threading.Lock()
        self._reform_lock = threading.Lock()
        self._reform_spec: ReformSpec | None = None
        self._reform_event = threading.Event()
        # Some rank had a Reform when the last step closed: every rank leaves at this boundary.
        self._leave_agreed = False
        self._leaves = 0  # times this process began to leave a world (see _abort_if_stuck)
        self._reforming = False  # between leaving a world and being restored in the next
        self._left_world = threading.Event()
        self._step_thread = threading.get_ident()  # the thread that trains (see _abort_if_stuck)
        self._last_step_time = 0.0
        self._first_step_pending: ReformTimings | None = None
        self._startup_pending: StartupTimings | None = None  # set by initialize, written at the first step
        self._restore_bytes = (0, 0)
        self._restore_sources: dict[str, int] = {}  # the last restore's bytes by source (its record)
        self._restored_from = ""  # the last restore's source: "memory" or "storage"
        self._peer_fill = PeerFill()
        self.peers = PeerReplicas(config.peer) if config.peer.replicas > 0 else None
        self.client_state = ClientStates()  # see register_state
        self._attach(engine, self.round, os.environ.get("MASTER_ADDR", "127.0.0.1"))
        restored = self._restore(required=_required)
        assert restored is not None
        self._resume(restored)
        self.stopped = False
        self._sigterm = False
        self._closed = False
        # Python delivers signals to the main thread only; elsewhere the agent's SIGTERM is not seen.
        on_main = threading.current_thread() is threading.main_thread()
        self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm) if on_main else None
        set_fault_handler = getattr(self.agent, "set_fault_handler", None)
        if callable(set_fault_handler):  # the agent delivers chaos injections through it
            set_fault_handler(self.inject_fault)
        set_reform_handler = getattr(self.agent, "set_reform_handler", None)
        if callable(set_reform_handler) and self.cannot_reform is None:  # the agent delivers the next world
            set_reform_handler(self.request_reform)
        elif callable(set_reform_handler):  # the agent then restarts this worker at a round change
            log.info("rank %d: no in-place re-form: %s", self.rank, self.cannot_reform)
        # Whether a Reform can come at all: only from a stalwart agent (or a harness that plays
        # one). Under torchrun or plain processes nobody sends one, and a survivor that waited
        # for it would only delay the restart of the whole world.
        self.expects_reform = bool(getattr(self.agent, "enabled", False))

    def _attach(self, engine: Any, round_number: int, master_addr: str) -> None:
        """Everything that belongs to one world: rank, groups, ZeRO view, checkpointer. The same
        collectives in the same order on every rank, whether it starts, re-forms or was a spare.

        Under an agent the round number is the checkpoints' fencing token, claimed by rank 0 as
        the world forms: workers of an older round that the job left behind (their agent gone
        while the daemon formed a round without them) can never commit beside this world."""
        config = self.config
        self.engine = engine
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.accumulation = accumulation_steps(config.global_batch, config.micro_batch, self.world_size)
        _check_engine(engine, config, self.accumulation, self.world_size)
        self.state = ZeroState(engine)
        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        # The per-step agreement gets its own CPU group: it must not wait behind the persist
        # thread's commit traffic, and must not need a GPU tensor.
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        if self.peers is not None:
            self.peers.attach(self._control, self.rank, self.world_size, master_addr)
        self._coord = TorchDistCoordinator(config.commit_timeout_s)
        self.recorder = StepRecorder(config.record_path if self.rank == 0 else None)
        base = self._save_config or SaveConfig(commit_timeout_s=config.commit_timeout_s)
        retention = RetentionPolicy(keep_last=config.keep_last)
        under_agent = bool(getattr(self.agent, "enabled", False))
        fence = base.fence if base.fence is not None or not under_agent or round_number <= 0 else round_number
        self.checkpointer = Checkpointer(
            # keep_committed: the last committed snapshot stays in host memory, a re-form's first source.
            config.checkpoint_dir, SaveConfig(**{**base.__dict__, "retention": retention, "keep_committed": True,
                                                 "fence": fence}),
            coordinator=self._coord, on_commit=self._on_commit,
        )  # fmt: skip
        if self.rank == 0:
            self.checkpointer.claim_fence()

    def _resume(self, restored: RestoreInfo) -> None:
        """Continue from ``restored``: the step counter, data position and save bookkeeping."""
        self.restored = restored
        self.sampler = self._sampler(restored.position)
        self._skipped_seen = int(getattr(self.engine, "skipped_steps", 0))
        self.step = restored.step
        self._batch: StepBatch | None = None
        self._last_saved = -1 if restored.from_memory else restored.step  # finish() saves a step only in memory
        self._last_save_time = time.monotonic()
        self._step_started = time.perf_counter()
        self._pending: list[SaveHandle] = []

    @classmethod
    def initialize(cls, model: torch.nn.Module, ds_config: dict[str, Any], config: TrainerConfig, *,
                   agent: AgentClient | None = None, assignment: Callable[[], ReformSpec] | None = None,
                   **ds_kwargs: Any) -> Trainer:
        """Start torch.distributed if needed, check the world, then ``deepspeed.initialize``.

        ``ds_kwargs`` go to ``deepspeed.initialize`` (``optimizer``, ``model_parameters``,
        ``lr_scheduler``, ...). The batch sizes in ``ds_config`` are filled in for this world; any
        already there must agree with ``config``. What is passed is kept to build the engine again
        when the world changes (:meth:`reform`); a torch optimizer instance is rebuilt as one of
        the same class with the same parameter groups and hyperparameters.

        The world: under torchrun (its agent hosts the store) ``deepspeed.init_distributed``;
        otherwise, with ``MASTER_PORT`` set, a store of our own (:func:`~stalwart.trainer.reform.join_world`,
        so later rounds can reuse it). A warm spare (``STALWART_SPARE=1``) first waits for its
        assignment: ``assignment()`` where given, else the agent client's
        ``wait_for_assignment()``; it then joins that world like a re-forming rank and restores the
        checkpoint the survivors restore.
        """
        import deepspeed
        import torch.distributed.distributed_c10d as c10d

        startup = StartupTimings(process_started_at(), time.time())
        guard_extension_builds()  # DeepSpeed's C++ ops load while the world forms: a dead builder must not block it
        recipe = _EngineRecipe.capture(model, ds_config, ds_kwargs)  # before DeepSpeed re-points the optimizer
        spare = is_spare()
        backend = backend_for_device()
        if spare:
            if agent is None:
                agent = AgentClient(rank=0)
            # A ZeRO-3 warm-up partitions the model for a world of one: only where the next build
            # makes a new module from the model's structure (the recipe's skeleton)
            warm = int((ds_config.get("zero_optimization") or {}).get("stage", 0)) != 3 or recipe.skeleton is not None
            spec, engine = join_as_spare(agent, assignment, recipe, config, backend, warm=warm)
        elif not dist.is_initialized():
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "MASTER_PORT" not in os.environ:
                world_sockets.joining()
                c10d.default_pg_timeout = datetime.timedelta(seconds=config.collective_timeout_s)
                deepspeed.init_distributed(
                    dist_backend=backend, timeout=datetime.timedelta(seconds=config.collective_timeout_s)
                )
            else:
                spec = ReformSpec.from_env()
                stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
                if spec.round > 1 and (stage != 3 or recipe.skeleton is not None):
                    # A new process in a running job (a lost rank with no warm spare): pay the first
                    # engine build on its own, so the peers it joins wait for it in the arrival
                    # roster, which has no deadline, and not in the collectives after it, which do.
                    _warm_up(recipe, config, backend)
                join_world(spec, backend=backend, collective_timeout_s=config.collective_timeout_s,
                           join_timeout_s=config.dist_timeout_s)
        if not spare:
            startup.world_at = time.time()
            engine = recipe.build(config, dist.get_world_size())
            startup.engine_at = time.time()
        trainer = cls(engine, config, agent=agent, _recipe=recipe, _required=spare)
        if spare:
            trainer._tell_agent(spec.local_rank)
        else:  # a spare's start is its warm-up, long before a rank needs it
            startup.restored_at = time.time()
            trainer._startup_pending = startup
        return trainer

    # --- the loop ------------------------------------------------------------------------------

    def train(self, step_fn: Callable[[Any, StepBatch], float | torch.Tensor]) -> CommitInfo | None:
        """Run the training loop to ``total_steps``, re-forming in place when the world changes.

        ``step_fn(engine, batch)`` runs one global step: forward, ``engine.backward`` and
        ``engine.step`` for each of ``batch.micro_batches``, and returns this rank's mean loss. It
        must take the engine it is given (a re-form builds a new one). A collective error (a peer
        died or hung past ``collective_timeout_s``) makes this rank wait for the agent's Reform and
        re-form; a Reform is applied at the first step boundary whose closing all-reduce carries it
        from any rank, so that every rank of the old world leaves at the same step. Returns what
        :meth:`finish` returns. Raises :class:`ReformFailed` when re-forming is impossible, and
        whatever else ``step_fn`` raises.
        """
        while True:
            error_seen: float | None = None
            try:
                for batch in self.batches():
                    if self._leave_agreed:
                        raise _ReformPending("a rank had a Reform when the last step closed")
                    loss = step_fn(self.engine, batch)
                    self.step_done(loss)
                if self._leave_agreed or self._reform_event.is_set():
                    raise _ReformPending("a Reform came with the last step")
                return self.finish()
            except _ReformPending as pending:
                # Every rank leaves at the same step boundary (the one whose closing all-reduce
                # carried some rank's Reform): a rank that left on its own would leave its peers
                # blocked in the next step's collectives until the collective timeout.
                self._leave_agreed = False
                spec = self._take_reform() if self._reform_event.is_set() else self._await_reform(pending)
                cause = "reform"
            except Exception as exc:
                # With a Reform pending the world is changing anyway: a peer that left first
                # breaks this rank's step in whatever way DeepSpeed reports it.
                if not is_collective_error(exc) and not self._reform_event.is_set():
                    raise
                error_seen = time.time()
                world_sockets.cut()  # peers blocked on this rank fail now instead of at their timeout
                log.error("rank %d round %d step %d: collective failed: %s: %s", self.rank, self.round,
                          self.step, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                peer_lost = getattr(self.agent, "peer_lost", None)
                if callable(peer_lost) and not self._reform_event.is_set():
                    peer_lost(self.round, peer_hosts(exc), f"{type(exc).__name__}: {exc}")
                spec = self._await_reform(exc)
                cause = "collective_error"
            if spec is not None:
                self.reform(spec, cause=cause, error_seen_at=error_seen)

    def batches(self) -> Iterator[StepBatch]:
        """Each global step's data, from the restored position on, until ``total_steps``.

        Call :meth:`step_done` once per batch before taking the next.
        """
        while not self.stopped and (self.config.total_steps is None or self.step < self.config.total_steps):
            if self._batch is not None and self._batch.step != self.step:
                raise StepOutOfOrder(f"step {self._batch.step} was handed out but step_done was not called")
            self._batch = self.sampler.next_batch(self.step + 1)
            yield self._batch

    def _startup_done(self, startup: StartupTimings) -> None:
        """The first step of this process: say where its start went (rank 0 writes the record)."""
        self._startup_pending = None
        startup.first_step_at = time.time()
        phases = startup.phases()
        log.info("rank %d round %d step %d: first step %.2fs after the process started (%s)", self.rank, self.round,
                 self.step, startup.first_step_at - startup.process_started_at,
                 ", ".join(f"{name} {s:.2f}s" for name, s in phases.items()))
        self.recorder.write("startup", step=self.step, round=self.round, world_size=self.world_size,
                            timings=startup.to_json(), phases=phases)

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
        local_loss = self._injected_loss(batch.step, float(loss))
        grad_norm = _grad_norm(self.engine)
        skipped_now = int(getattr(self.engine, "skipped_steps", 0)) - self._skipped_seen
        time_due = (self.rank == 0 and cfg.save_every_seconds is not None
                    and time.monotonic() - self._last_save_time >= cfg.save_every_seconds)  # fmt: skip
        # One all-reduce (sum) for everything every rank must decide alike. A global gradient norm
        # is the same on every rank, so its sum over ranks / world is it (NaN and inf survive).
        flags = torch.tensor([
            local_loss if math.isfinite(local_loss) else 0.0, float(self._sigterm), float(time_due),
            float(not math.isfinite(local_loss)), grad_norm if grad_norm is not None else 0.0,
            float(grad_norm is not None), float(skipped_now > 0), float(self._reform_event.is_set()),
        ], dtype=torch.float64)  # fmt: skip
        dist.all_reduce(flags, group=self._control)
        if world_sockets.recording:  # the first step of a world: every group is connected now
            world_sockets.ready(store_ports())
        self._leave_agreed = flags[7].item() > 0
        loss_finite = flags[3].item() == 0
        mean_loss = flags[0].item() / self.world_size if loss_finite else math.nan
        agreed_norm = flags[4].item() / flags[5].item() if flags[5].item() > 0 else None
        update_skipped = flags[6].item() > 0
        self._skipped_seen += skipped_now
        now = time.perf_counter()
        step_time, self._step_started = now - self._step_started, now
        self._step_thread = threading.get_ident()
        self._last_step_time = step_time
        fault = self.health.check(batch.step, mean_loss, loss_finite=loss_finite, grad_norm=agreed_norm,
                                  update_skipped=update_skipped)
        if fault is not None:
            self._on_fault(batch, fault, mean_loss, agreed_norm)  # rolls back, or raises TrainingDiverged
        else:
            extra = {"update_skipped": True} if update_skipped else {}  # fp16 overflow: no weight changed
            self.recorder.write("step", step=self.step, epoch=batch.epoch, world_size=self.world_size,
                                loss=mean_loss, grad_norm=agreed_norm, samples=list(batch.samples), **extra)
            self.health.accept(self.step, mean_loss, update_skipped=update_skipped)
            self.agent.step(self.step, step_time, mean_loss)
        if self._startup_pending is not None:
            self._startup_done(self._startup_pending)
        if self._first_step_pending is not None:
            timing, self._first_step_pending = self._first_step_pending, None
            timing.first_step_at = time.time()
            log.warning("rank %d round %d step %d: first step after the re-form, %.3fs after it began", self.rank,
                        self.round, self.step, timing.first_step_at - timing.started_at)
        self._report_saves()
        if flags[1].item() > 0 and flags[7].item() > 0:
            # The agent is changing the world: the SIGTERM is for a rank that leaves it, not for the
            # job. No final checkpoint (the survivors would not take part in it): the rank that
            # got it exits, the others re-form at the next step boundary.
            log.warning("rank %d step %d: a rank leaves for a new round: no final checkpoint", self.rank, self.step)
            if self._sigterm:
                self.stopped = True
                self._closed = True
                self.checkpointer.abandon()
                if cfg.exit_on_sigterm:
                    raise SystemExit(0)
        elif flags[1].item() > 0:
            log.warning("rank %d step %d: SIGTERM: final checkpoint, then exit", self.rank, self.step)
            self.finish()
            self.stopped = True
            if cfg.exit_on_sigterm:
                raise SystemExit(0)
        elif fault is None and (
            flags[2].item() > 0 or (cfg.save_every_steps is not None and self.step % cfg.save_every_steps == 0)
        ):
            self.save()
        elif fault is None and self._memory_due():
            self._keep_generation()
        return mean_loss

    # --- internals -----------------------------------------------------------------------------

    def _sampler(self, position: DataPosition) -> GlobalBatchSampler:
        c = self.config
        return GlobalBatchSampler(
            c.dataset_len, c.global_batch, c.micro_batch, self.world_size, self.rank, seed=c.seed,
            shuffle=c.shuffle, position=position, skip=self.ledger.windows(),
        )  # fmt: skip

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._sigterm = True  # acted on at the next step boundary, on every rank at once
