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
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.ckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointNotFound,
    CommitFailed,
    CommitInfo,
    CommittedSnapshot,
    LayoutMismatch,
    RetentionPolicy,
    SaveConfig,
    SaveHandle,
    TorchDistCoordinator,
    list_checkpoints,
    load,
    read_manifest,
    set_aside,
)
from stalwart.proto.contract import ENV_ROUND, ENV_SPARE
from stalwart.trainer.agent_client import AgentClient
from stalwart.trainer.batching import DataPosition, GlobalBatchSampler, StepBatch, accumulation_steps
from stalwart.trainer.client_state import ClientStates
from stalwart.trainer.errors import (
    IncompatibleCheckpoint,
    ReformFailed,
    StepOutOfOrder,
    TrainerError,
    TrainingDiverged,
    UnsupportedConfig,
)
from stalwart.trainer.health import (
    SKIP_LAST_K,
    Fault,
    HealthConfig,
    HealthMonitor,
    Rollback,
    RollbackLedger,
    read_journal,
    windows_of,
    write_journal,
)
from stalwart.trainer.peer import Part, PeerConfig, PeerFill, PeerReplicas, fill_from_parts
from stalwart.trainer.record import StepRecorder
from stalwart.trainer.reform import (
    JoinSuperseded,
    ReformSpec,
    is_collective_error,
    is_spare,
    join_world,
    leave_world,
    peer_hosts,
    store_ports,
)
from stalwart.trainer.world_sockets import world_sockets
from stalwart.trainer.zero_state import ZeroState

log = logging.getLogger(__name__)
FORMAT = 1


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer needs beyond DeepSpeed's config. Validated on construction.

    ``save_every_steps`` / ``save_every_seconds``: checkpoint when either is due (``None``: never
    for that rule); the time rule follows rank 0's clock. ``total_steps``: ``batches()`` ends there
    (``None``: never). ``record_path``: rank 0 appends the step record there (see ``record.py``).
    ``health``: the training-health checks and rollback policy (:class:`HealthConfig`).

    ``collective_timeout_s`` is the process groups' timeout (gloo's, and torch's default for groups
    made later, such as DeepSpeed's): how long a collective waits for a peer. A dead peer is seen
    at once (its connection closes); a hung one (deadlock, SIGSTOP, its connection still open)
    only when this runs out. So with :meth:`Trainer.train`, a survivor of a hung peer is out within
    ``collective_timeout_s`` + the re-form time (joining, engine rebuild, restore: about a second
    on a small model), once the agent's Reform has arrived. ``reform_wait_s``: after a collective
    error, how long a survivor waits for that Reform before it raises :class:`ReformFailed`.
    ``dist_timeout_s``: how long joining a world waits for its peers (store and rendezvous).
    ``abort_stuck_after_s``: when a Reform finds this rank still in a step that has run this long,
    its main thread is taken to be stuck in a collective on a lost peer (one behind a cut link or
    hung: its connections stay open, so nothing fails before ``collective_timeout_s``), and the
    old world is aborted so that the collective raises and the rank re-forms at once: NCCL aborts
    every process group (``ncclCommAbort``), gloo, which has no abort, shuts down the old world's
    connections. ``None``: 3 × the last step time, at least 1 s (a rank that is not stuck applies
    the Reform at the next step boundary, well within that).
    ``restore_read_bytes_per_s``: a budget for each restore's reads from storage, per rank
    (``None``: none), so that a whole world restoring at once does not saturate a shared file system.
    ``peer``: buddy replicas of each rank's checkpoint part in other nodes' host memory, the
    first source of a restore (:mod:`~stalwart.trainer.peer`; ``PeerConfig(replicas=0)``: off).
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
    collective_timeout_s: float = 30.0
    reform_wait_s: float = 60.0
    abort_stuck_after_s: float | None = None
    health: HealthConfig = field(default_factory=HealthConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    restore_read_bytes_per_s: float | None = None

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
        if min(self.dist_timeout_s, self.commit_timeout_s, self.collective_timeout_s, self.reform_wait_s) <= 0:
            raise ValueError("dist_timeout_s, commit_timeout_s, collective_timeout_s and reform_wait_s "
                             "must be positive")
        if self.abort_stuck_after_s is not None and self.abort_stuck_after_s <= 0:
            raise ValueError(f"abort_stuck_after_s must be positive or None, got {self.abort_stuck_after_s}")
        if not isinstance(self.health, HealthConfig):
            raise ValueError(f"health must be a HealthConfig, got {type(self.health).__name__}")
        if self.restore_read_bytes_per_s is not None and self.restore_read_bytes_per_s <= 0:
            raise ValueError(f"restore_read_bytes_per_s must be positive or None, got {self.restore_read_bytes_per_s}")
        if not isinstance(self.peer, PeerConfig):
            raise ValueError(f"peer must be a PeerConfig, got {type(self.peer).__name__}")


@dataclass(frozen=True)
class RestoreInfo:
    """Where this run started: checkpoint ``step`` (0 and ``saved_world_size`` 0 for a fresh start)."""

    step: int
    position: DataPosition
    saved_world_size: int
    skipped: list[tuple[int, str]] = field(default_factory=list)


def _abort_all_groups() -> None:
    """Abort every process group (NCCL: ``ncclCommAbort``); experimental in torch."""
    from torch.distributed.distributed_c10d import _abort_process_group

    try:
        _abort_process_group()
    except Exception as exc:  # noqa: BLE001 - the collective timeout still bounds the wait
        log.error("aborting the process groups failed: %s: %s", type(exc).__name__, exc)


def _cut_old_world() -> None:
    """gloo's stand-in for an abort: its blocked receives fail once their connections are shut."""
    world_sockets.cut(keep_ports=store_ports())


def backend_for_device() -> str:
    """NCCL where CUDA exists (production), gloo on CPU (tests, laptops)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class _OptimizerRecipe:
    """How to build a torch optimizer like the one passed to :meth:`Trainer.initialize` again:
    same class, same parameter groups (as indices into ``model.parameters()``), same
    hyperparameters as at construction (the restored checkpoint sets the current ones)."""

    cls: type
    groups: list[tuple[list[int], dict[str, Any]]]

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> _OptimizerRecipe:
        index = {id(p): i for i, p in enumerate(model.parameters())}
        groups = []
        for g in optimizer.param_groups:
            missing = [p for p in g["params"] if id(p) not in index]
            if missing:
                raise UnsupportedConfig("the optimizer holds tensors that are not parameters of the model")
            hyper = {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            groups.append(([index[id(p)] for p in g["params"]], hyper))
        return cls(type(optimizer), groups)

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        params = list(model.parameters())
        return self.cls([{**copy.deepcopy(h), "params": [params[i] for i in idx]} for idx, h in self.groups])


@dataclass
class _EngineRecipe:
    """What :meth:`Trainer.initialize` gave ``deepspeed.initialize``, kept to build the engine again
    for another world without the user's help. ``unsupported`` says why that is impossible."""

    model: torch.nn.Module
    ds_config: dict[str, Any]
    ds_kwargs: dict[str, Any]
    optimizer: _OptimizerRecipe | None
    unsupported: str | None = None

    @classmethod
    def capture(cls, model: torch.nn.Module, ds_config: dict[str, Any], ds_kwargs: dict[str, Any]) -> _EngineRecipe:
        kwargs = dict(ds_kwargs)
        optimizer = kwargs.pop("optimizer", None)
        unsupported = None
        recipe = None
        if isinstance(optimizer, torch.optim.Optimizer):
            recipe = _OptimizerRecipe.capture(optimizer, model)
        elif optimizer is not None:  # a callable(params) -> optimizer can simply be called again
            kwargs["optimizer"] = optimizer
        if "model_parameters" in kwargs and kwargs["model_parameters"] is not None:
            kwargs["model_parameters"] = list(kwargs["model_parameters"])
        sched = kwargs.get("lr_scheduler")
        if sched is not None and not callable(sched) and (recipe is None or getattr(sched, "optimizer", None)
                                                          is not optimizer):
            # An instance is re-pointed at each optimizer built from the recipe (see build); one
            # that drives anything else cannot follow the engine to another world.
            unsupported = ("an lr_scheduler instance must drive the torch optimizer instance passed with it "
                           "(or pass a callable(optimizer))")
        return cls(model, copy.deepcopy(ds_config), kwargs, recipe, unsupported)

    def build(self, config: TrainerConfig, world: int) -> Any:
        import deepspeed

        gas = accumulation_steps(config.global_batch, config.micro_batch, world)  # fail before any work
        wanted = {"train_batch_size": config.global_batch, "train_micro_batch_size_per_gpu": config.micro_batch}
        for key, value in wanted.items():
            if key in self.ds_config and self.ds_config[key] != value:
                raise ValueError(f"ds_config[{key!r}] = {self.ds_config[key]} disagrees with TrainerConfig ({value})")
        ds_config = {**copy.deepcopy(self.ds_config), **wanted, "gradient_accumulation_steps": gas}
        kwargs = dict(self.ds_kwargs)
        if self.optimizer is not None:
            kwargs["optimizer"] = self.optimizer.build(self.model)
            sched = kwargs.get("lr_scheduler")
            if sched is not None and not callable(sched):
                # The scheduler instance drives the optimizer built here (its state, like the
                # optimizer's, comes from the checkpoint restored next).
                sched.optimizer = kwargs["optimizer"]
        engine, *_ = deepspeed.initialize(model=self.model, config=ds_config, **kwargs)
        return engine


@dataclass
class ReformTimings:
    """Where the time of one in-place re-form went; wall-clock ``time.time()`` stamps, so a
    harness can subtract them from the moment it killed a peer. ``first_step_at`` is set when the
    first step after the re-form is done."""

    round: int
    world_size: int
    rank: int
    cause: str
    error_seen_at: float | None
    started_at: float
    left_at: float = 0.0  # the old world's groups, engine and in-flight save dropped
    group_up_at: float = 0.0
    engine_built_at: float = 0.0
    restored_at: float = 0.0
    first_step_at: float | None = None
    restored_step: int = 0
    left_step: int = 0  # the last step this rank finished in the old world
    host_bytes: int = 0  # state restored from this process's host copy of the last committed save
    peer_bytes: int = 0  # from the copies of other ranks' parts held here or pulled from peers
    disk_bytes: int = 0  # read from the checkpoint files (what no live process held)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _ReformPending(Exception):
    """The agent sent a Reform between steps: leave the loop and re-form (not an error)."""


class Trainer:
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
        self._last_step_time = 0.0
        self._first_step_pending: ReformTimings | None = None
        self._restore_bytes = (0, 0)
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
        self._check_engine()
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
        self._last_saved = restored.step
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

        recipe = _EngineRecipe.capture(model, ds_config, ds_kwargs)  # before DeepSpeed re-points the optimizer
        spare = is_spare()
        backend = backend_for_device()
        if spare:
            if agent is None:
                agent = AgentClient(rank=0)
            source = assignment or getattr(agent, "wait_for_assignment", None)
            if source is None:
                raise ReformFailed("a spare (STALWART_SPARE=1) needs an assignment: the agent client's "
                                   "wait_for_assignment or Trainer.initialize(assignment=...)")
            started = time.perf_counter()
            if int((ds_config.get("zero_optimization") or {}).get("stage", 0)) != 3:
                _warm_up(recipe, config, backend)  # ZeRO-3 would partition the model for a world of one
            log.info("spare pid %d: model built, engine warmed up in %.2fs, waiting for an assignment",
                     os.getpid(), time.perf_counter() - started)
            spec = source()
            log.warning("spare pid %d: assigned rank %d of %d in round %d", os.getpid(), spec.rank,
                        spec.world_size, spec.round)
            os.environ.pop(ENV_SPARE, None)
            has_newer = getattr(agent, "has_newer_reform", lambda _round: False)
            joining = getattr(agent, "joining", None)
            while True:
                if callable(joining):
                    joining(spec.round, 0, spec.world_size)
                try:
                    join_world(spec, backend=backend, collective_timeout_s=config.collective_timeout_s,
                               join_timeout_s=config.dist_timeout_s,
                               superseded=lambda r=spec.round: has_newer(r),  # type: ignore[misc]
                               on_wait=(lambda n, w, r=spec.round: joining(r, n, w)) if callable(joining) else None)
                    break
                except JoinSuperseded:
                    newer = agent.take_newer_reform(spec.round)
                    assert newer is not None
                    log.warning("spare pid %d: round %d superseded while joining; joining round %d as rank %d",
                                os.getpid(), spec.round, newer.round, newer.rank)
                    spec = newer
                except Exception as exc:
                    newer = _newer_after_broken_join(agent, spec, exc, config.reform_wait_s)
                    if newer is None:
                        raise ReformFailed(f"spare cannot join round {spec.round}: {exc}", round=spec.round) from exc
                    spec = newer
        elif not dist.is_initialized():
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or "MASTER_PORT" not in os.environ:
                world_sockets.joining()
                c10d.default_pg_timeout = datetime.timedelta(seconds=config.collective_timeout_s)
                deepspeed.init_distributed(
                    dist_backend=backend, timeout=datetime.timedelta(seconds=config.collective_timeout_s)
                )
            else:
                spec = ReformSpec.from_env()
                if spec.round > 1 and int((ds_config.get("zero_optimization") or {}).get("stage", 0)) != 3:
                    # A new process in a running job (a lost rank with no warm spare): pay the first
                    # engine build on its own, so the peers it joins wait for it in the arrival
                    # roster, which has no deadline, and not in the collectives after it, which do.
                    _warm_up(recipe, config, backend)
                join_world(spec, backend=backend, collective_timeout_s=config.collective_timeout_s,
                           join_timeout_s=config.dist_timeout_s)
        engine = recipe.build(config, dist.get_world_size())
        trainer = cls(engine, config, agent=agent, _recipe=recipe, _required=spare)
        if spare:
            trainer._tell_agent(spec.local_rank)
        return trainer

    def _tell_agent(self, local_rank: int) -> None:
        """Acknowledge the new round and rank to the agent (it kills a worker that does not)."""
        reformed = getattr(self.agent, "reformed", None)
        if callable(reformed):
            reformed(self.round, self.rank, local_rank)

    # --- in-place re-form ----------------------------------------------------------------------

    def request_reform(self, spec: ReformSpec) -> None:
        """Ask this rank to move to ``spec``'s world at the next step boundary (or at once, when a
        collective failed). The agent client's Reform handler; thread-safe. A round not newer
        than this rank's is ignored."""
        with self._reform_lock:
            pending = self._reform_spec
            if spec.round <= self.round or (pending is not None and spec.round <= pending.round):
                log.info("rank %d round %d: ignoring a Reform for round %d", self.rank, self.round, spec.round)
                return
            self._reform_spec = spec
            self._reform_event.set()
            leaves = self._leaves
        log.warning("rank %d round %d step %d: Reform to rank %d of %d in round %d", self.rank, self.round,
                    self.step, spec.rank, spec.world_size, spec.round)
        abort = _abort_all_groups if backend_for_device() == "nccl" else _cut_old_world
        threading.Thread(target=self._abort_if_stuck, args=(leaves, abort), daemon=True,
                         name="stalwart-stuck-abort").start()

    def _abort_if_stuck(self, leaves: int, abort: Callable[[], object]) -> bool:
        """After a Reform: if this rank's current step runs ``abort_stuck_after_s`` without the
        rank beginning to leave the old world (``leaves`` unchanged), its main thread is stuck in a
        collective on a lost peer: ``abort`` the old world (NCCL: every process group; gloo: its
        connections) so that the collective raises and :meth:`train` re-forms. A rank already
        re-forming is left alone: its join gives way to a newer round by itself. Returns whether
        it aborted."""
        wait = self.config.abort_stuck_after_s
        if wait is None:
            wait = max(1.0, 3.0 * self._last_step_time)
        remaining = self._step_started + wait - time.perf_counter()
        if remaining > 0 and self._left_world.wait(remaining) and self._leaves != leaves:
            return False
        with self._reform_lock:  # held while aborting: the main thread cannot begin a join meanwhile
            if self._leaves != leaves or self._reforming:
                return False
            log.error("rank %d round %d step %d: stuck in its step %.1f s, past %.1f s, after a Reform: "
                      "aborting the old world", self.rank, self.round, self.step,
                      time.perf_counter() - self._step_started, wait)
            abort()
        return True

    @property
    def cannot_reform(self) -> str | None:
        """Why this process cannot move to another world in place (None: it can). A worker that
        cannot does not tell the agent it can, so the agent restarts it at a round change instead
        of sending it a Reform it would refuse."""
        if self._recipe is None:
            return "the engine was not built by Trainer.initialize, so it cannot be rebuilt"
        if self._recipe.unsupported:
            return f"cannot rebuild the engine: {self._recipe.unsupported}"
        if self.state.stage == 3:
            return "in-place re-form supports ZeRO stage 1 and 2 (stage 3 partitions the module itself)"
        return None

    def _take_reform(self) -> ReformSpec | None:
        with self._reform_lock:
            spec, self._reform_spec = self._reform_spec, None
            self._reform_event.clear()
            return spec

    def _await_reform(self, cause: BaseException) -> ReformSpec:
        """After a collective failed: the agent's Reform, or :class:`ReformFailed`; without an
        agent (``expects_reform`` false) the collective's error itself, at once."""
        if not self.expects_reform and not self._reform_event.is_set():
            raise cause
        deadline = time.monotonic() + self.config.reform_wait_s
        while not self._reform_event.wait(0.05) and time.monotonic() < deadline:
            if self._sigterm:
                # Stopped while its world is broken: there is nothing to save (the peers are gone),
                # and waiting for the agent's kill would hold its main loop up.
                log.warning("rank %d round %d step %d: SIGTERM while waiting for a Reform: exiting", self.rank,
                            self.round, self.step)
                raise SystemExit(0)
        if not self._reform_event.is_set():
            raise ReformFailed(
                f"rank {self.rank} round {self.round} step {self.step}: a collective failed ({cause}) and no "
                f"Reform arrived within {self.config.reform_wait_s:g}s", round=self.round,
            ) from cause  # fmt: skip
        spec = self._take_reform()
        assert spec is not None
        return spec

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

    def reform(self, spec: ReformSpec, *, cause: str = "reform", error_seen_at: float | None = None) -> ReformTimings:
        """Move this process to ``spec``'s world without restarting it.

        Leaves the old world (the in-flight save is abandoned if it is not done: a lost peer means
        it cannot commit; the old engine's hooks are removed; every process group and DeepSpeed's
        cached groups are destroyed), joins the new one (:func:`~stalwart.trainer.reform.join_world`),
        builds a DeepSpeed engine for the same model and optimizer recipe, and restores the newest
        committed checkpoint resharded to the new world (not capped at ``spec.restore_step``: the
        daemon learns of commits later than the disk has them, and a save committed meanwhile
        is progress to keep, and a step number the re-run would collide with): weights,
        optimizer, scheduler, loss scaler, counters, data position and RNG, exactly as a freshly
        started process of the new world would. The parts this process saved itself come from its
        host copy of that checkpoint's snapshot; the rest is read from disk and verified.
        Collective over the new world: every rank of it must be re-forming (or be a spare joining).
        Raises :class:`ReformFailed` (the agent then replaces this process).
        """
        timing = ReformTimings(round=spec.round, world_size=spec.world_size, rank=spec.rank, cause=cause,
                               error_seen_at=error_seen_at, started_at=time.time(), left_step=self.step)
        with self._reform_lock:
            self._leaves += 1
            self._reforming = True
        self._left_world.set()
        self._left_world.clear()
        try:
            return self._reform(spec, timing, cause)
        finally:
            with self._reform_lock:
                self._reforming = False

    def _reform(self, spec: ReformSpec, timing: ReformTimings, cause: str) -> ReformTimings:
        if self.cannot_reform is not None:
            raise ReformFailed(self.cannot_reform, round=spec.round)
        self._check_world(spec)
        log.warning("rank %d round %d step %d: re-forming as rank %d of %d (round %d, master %s:%d, cause %s)",
                    self.rank, self.round, self.step, spec.rank, spec.world_size, spec.round, spec.master_addr,
                    spec.master_port, cause)
        host = self.checkpointer.committed_snapshot()
        if self.peers is not None and host is not None:
            self.peers.keep_own(host, self.rank)  # a commit that step_done has not seen yet
        self._leave()
        timing.left_at = time.time()
        try:
            while True:
                try:
                    spec = self._join_newest(spec)
                    timing.round, timing.world_size, timing.rank = spec.round, spec.world_size, spec.rank
                    timing.group_up_at = time.time()
                    engine = self._recipe.build(self.config, spec.world_size)
                    timing.engine_built_at = time.time()
                    self._attach(engine, spec.round, spec.master_addr)
                    self.round = spec.round
                    restored = self._restore(required=True, host=host)
                    assert restored is not None
                    self._resume(restored)
                    break
                except (ReformFailed, TrainerError):
                    raise
                except Exception as exc:
                    # The restore's coordination (ckpt wraps it as CommitFailed) breaks like the
                    # join's collectives when a peer of the forming world is lost.
                    seen = exc.__cause__ if isinstance(exc, CheckpointError) else exc
                    if seen is None or (isinstance(exc, CheckpointError) and not isinstance(exc, CommitFailed)):
                        raise
                    timed_out = "timed out" in str(seen).lower() or "timeout" in str(seen).lower()
                    if not (self.expects_reform and is_collective_error(seen)) or timed_out:
                        raise  # a peer that never came (a timeout) fails this rank, as before
                    # A peer of the new round died while it formed (its store host, or a rank in
                    # the collectives after the roster): the round is lost, not this process.
                    # The daemon opens another; wait for it instead of failing as well.
                    log.error("rank %d: round %d broke while it formed (%s: %s); waiting for the next round",
                              spec.rank, spec.round, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                    self._drop_partial_world()
                    spec = self._await_newer_reform(spec, exc)
        except ReformFailed:
            raise
        except (TrainerError, CheckpointError) as exc:
            raise ReformFailed(f"rank {spec.rank} cannot re-form into round {spec.round}: {exc}",
                               round=spec.round) from exc
        except Exception as exc:
            raise ReformFailed(f"rank {spec.rank} cannot re-form into round {spec.round}: "
                               f"{type(exc).__name__}: {exc}", round=spec.round) from exc
        timing.restored_at = time.time()
        timing.restored_step = self.step
        timing.host_bytes, timing.disk_bytes = self._restore_bytes
        timing.peer_bytes = self._peer_fill.held_bytes + self._peer_fill.pulled_bytes
        self.reforms.append(timing)
        self._first_step_pending = timing
        log.warning("rank %d round %d: re-formed at step %d in %.3fs (group %.3fs, engine %.3fs, restore %.3fs)",
                    self.rank, self.round, self.step, timing.restored_at - timing.started_at,
                    timing.group_up_at - timing.started_at, timing.engine_built_at - timing.group_up_at,
                    timing.restored_at - timing.engine_built_at)
        self.recorder.write("reform", step=self.step, round=spec.round, world_size=self.world_size, cause=cause,
                            timings=timing.to_json())
        self._tell_agent(spec.local_rank)
        return timing

    def _join_newest(self, spec: ReformSpec) -> ReformSpec:
        """Join ``spec``'s world, or a newer one that the agent sends while its peers are still
        arriving (the round was superseded: nobody will complete it). Returns the spec joined."""
        joining = getattr(self.agent, "joining", None)
        while True:
            if callable(joining):
                joining(spec.round, 0, spec.world_size)
            try:
                join_world(spec, backend=backend_for_device(), collective_timeout_s=self.config.collective_timeout_s,
                           join_timeout_s=self.config.dist_timeout_s,
                           superseded=lambda r=spec.round: self._newer_reform(r),  # type: ignore[misc]
                           on_wait=(lambda n, w, r=spec.round: joining(r, n, w)) if callable(joining) else None)
                return spec
            except JoinSuperseded:
                newer = self._take_reform()
                assert newer is not None
                log.warning("rank %d: round %d superseded while joining; joining round %d as rank %d of %d",
                            spec.rank, spec.round, newer.round, newer.rank, newer.world_size)
                self._check_world(newer)
                spec = newer

    def _drop_partial_world(self) -> None:
        """Leave a world that broke while it formed (nothing of it was trained on); never raises."""
        if self.engine is not None:
            _release_engine(self.engine, self.rank)
            self.engine = None
            try:
                self.checkpointer.close()  # the new world's: nothing saved yet
            except Exception as exc:  # noqa: BLE001 - a broken world may refuse a clean close
                log.warning("rank %d: closing the broken world's checkpointer: %s", self.rank, exc)
        self.state = None  # type: ignore[assignment]
        self._control = None
        world_sockets.cut()
        leave_world()

    def _await_newer_reform(self, spec: ReformSpec, cause: BaseException) -> ReformSpec:
        """The agent's Reform for a round after ``spec``'s, within ``reform_wait_s``; raises
        :class:`ReformFailed` without one, or ``SystemExit(0)`` on SIGTERM meanwhile."""
        deadline = time.monotonic() + self.config.reform_wait_s
        while not self._newer_reform(spec.round):
            if self._sigterm:
                raise SystemExit(0)
            if time.monotonic() > deadline:
                raise ReformFailed(f"rank {spec.rank} cannot re-form into round {spec.round}: it broke while it formed "
                                   f"({cause}) and no newer round came within {self.config.reform_wait_s:g}s",
                                   round=spec.round)
            time.sleep(0.05)
        newer = self._take_reform()
        assert newer is not None
        self._check_world(newer)
        return newer

    def _check_world(self, spec: ReformSpec) -> None:
        try:
            accumulation_steps(self.config.global_batch, self.config.micro_batch, spec.world_size)
        except TrainerError as exc:  # before joining: the peers would wait for this rank in vain
            raise ReformFailed(f"cannot re-form into round {spec.round}: {exc}", round=spec.round) from exc

    def _newer_reform(self, round_number: int) -> bool:
        with self._reform_lock:
            return self._reform_spec is not None and self._reform_spec.round > round_number

    def _leave(self) -> None:
        """Drop everything of the old world; never raises (the old world may be broken)."""
        self._leave_started = time.perf_counter()
        handle = self.checkpointer.inflight()  # the one save that may still be running
        if handle is not None and not handle.done() and not handle.wait_snapshot(5.0):
            log.warning("rank %d step %d: the snapshot of step %d did not finish", self.rank, self.step, handle.step)
        if handle is None or handle.done():
            self.checkpointer.close()
        else:
            # Its commit waits on a lost or hung peer (until that group's timeout): let it fail on
            # its own. It may have gathered every rank's part before the peer died, so forbid the
            # manifest now: after abandon() it is durable already or never will be, and the
            # restore below lists checkpoints only after every survivor got here.
            self.checkpointer.abandon()
            log.warning("rank %d step %d: abandoning the save of step %d in flight", self.rank, self.step,
                        handle.step)
        t0 = time.perf_counter()
        self._report_saves()
        _release_engine(self.engine, self.rank)
        self.engine = None
        self.state = None  # type: ignore[assignment]
        self._control = None
        t1 = time.perf_counter()
        leave_world()
        t2 = time.perf_counter()
        if torch.cuda.is_available():
            # The old engine is a web of reference cycles: only a full collection frees its device
            # memory before the new engine allocates its own (≈0.2 s). On the CPU its big tensors
            # are already freed by _release_engine; the rest waits for Python's own collection.
            gc.collect()
        log.info("rank %d: left the old world: save %.3fs, engine %.3fs, groups %.3fs, gc %.3fs", self.rank,
                 t0 - self._leave_started, t1 - t0, t2 - t1, time.perf_counter() - t2)

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
        local_loss = self._injected_loss(batch.step, float(loss))
        grad_norm = self._grad_norm()
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
        return mean_loss

    def inject_fault(self, kind: str, step: int, factor: float = 0.0) -> None:
        """Make global step ``step`` look unhealthy on this rank, once (tests and chaos runs).

        ``kind="nan"``: the loss this rank reports for the step becomes NaN; ``"spike"``: it is
        multiplied by ``factor``. Only the reported loss changes (the weights do not), which is
        what the health checks see. Thread-safe (the agent client calls it from its own thread);
        a step already passed never fires.
        """
        if kind not in ("nan", "spike"):
            raise ValueError(f"fault kind must be 'nan' or 'spike', got {kind!r}")
        if kind == "spike" and not math.isfinite(factor):
            raise ValueError(f"spike factor must be finite, got {factor}")
        with self._inject_lock:
            self._injected.setdefault(int(step), []).append((kind, float(factor)))
        log.warning("rank %d: fault %s (factor %g) armed for step %d", self.rank, kind, factor, step)

    def register_state(self, name: str, obj: Any = None, *, save: Callable[[], Any] | None = None,
                       load: Callable[[Any], None] | None = None) -> None:
        """Save and restore user state (an EMA, a data mixer) with the checkpoints: ``obj`` with
        ``state_dict()``/``load_state_dict()``, or ``save``/``load`` callables. The same on every
        rank; restored at once if the checkpoint restored has it. See ``client_state.py``."""
        self.client_state.register(name, obj, save=save, load=load)

    def save(self) -> SaveHandle:
        """Checkpoint the current step asynchronously (returns after the snapshot). Collective."""
        self.state.ensure_optimizer_state()
        client_tensors, client_meta = self.client_state.snapshot()
        meta = {"trainer": self._trainer_meta(), "rng": _rng_state(), "client": client_meta}
        handle = self.checkpointer.save(self.step, {**self.state.save_tensors(), **client_tensors}, meta)
        self._pending.append(handle)
        if self.peers is not None:
            self.peers.replicate(handle, self.rank)  # on a thread, once the snapshot is copied
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

    def _sampler(self, position: DataPosition) -> GlobalBatchSampler:
        c = self.config
        return GlobalBatchSampler(
            c.dataset_len, c.global_batch, c.micro_batch, self.world_size, self.rank, seed=c.seed,
            shuffle=c.shuffle, position=position, skip=self.ledger.windows(),
        )  # fmt: skip

    def _injected_loss(self, step: int, loss: float) -> float:
        with self._inject_lock:
            faults = self._injected.pop(step, [])
            for stale in [k for k in self._injected if k < step]:
                del self._injected[stale]
        for kind, factor in faults:
            loss = math.nan if kind == "nan" else loss * factor
            log.warning("rank %d step %d: injected fault %s: reported loss is now %s", self.rank, step, kind, loss)
        return loss

    def _grad_norm(self) -> float | None:
        """The engine's global gradient norm of the last optimizer step (``None`` where unknown)."""
        get = getattr(self.engine, "get_global_grad_norm", None)
        if get is None:
            return None
        value = get()
        if value is None:
            return None
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    def _on_fault(self, batch: StepBatch, fault: Fault, loss: float, grad_norm: float | None) -> None:
        """Roll back to the newest checkpoint before the fault and skip its data, or give up."""
        s, hc = batch.step, self.config.health
        log.error("rank %d step %d: training-health fault %s: %s", self.rank, s, fault.kind, fault.reason)
        self.recorder.write("fault", step=s, kind=fault.kind, reason=fault.reason, loss=loss, grad_norm=grad_norm,
                            epoch=batch.epoch, samples=list(batch.samples))
        recent = self.ledger.recent(s, hc.rollback_window)
        if len(recent) >= hc.max_rollbacks:
            self._give_up(s, fault, f"{len(recent) + 1} faults within {hc.rollback_window} steps, more than the "
                                    f"{hc.max_rollbacks} rollbacks allowed", recent)
        self._settle_saves()  # a checkpoint of step s - 1 may be in flight: it is the one to go back to
        restored = self._restore(max_step=s - 1, rollback=True)
        if restored is None:
            self._give_up(s, fault, f"no good checkpoint before step {s} to roll back to", recent)
        assert restored is not None
        # The batches since the checkpoint, as they were handed out (the same skips applied).
        replay = self._sampler(restored.position)
        since = [replay.next_batch(k) for k in range(restored.step + 1, s + 1)]
        if since[-1].samples != batch.samples:
            log.error("rank %d step %d: replayed data differs from the batch trained: skipping it anyway",
                      self.rank, s)
        skipped = since[-hc.skip_last:] if hc.skip == SKIP_LAST_K else since
        rollback = Rollback(s, restored.step, fault.reason, windows_of(skipped))
        self.ledger.add(rollback)
        if self.rank == 0:
            try:
                write_journal(self.config.checkpoint_dir, self.ledger)
            except OSError as exc:  # the checkpoints still carry it from the next save on
                log.error("rank 0 step %d: cannot write the rollback journal: %s", s, exc)
        windows = [{**w.to_json(), "samples": [i for b in skipped if b.epoch == w.epoch for i in b.samples]}
                   for w in rollback.windows]
        self.recorder.write("rollback", step=restored.step, fault_step=s, kind=fault.kind, reason=fault.reason,
                            skip=hc.skip, skipped_steps=[b.step for b in skipped],
                            skipped_samples=[i for b in skipped for i in b.samples], windows=windows,
                            rollbacks=len(recent) + 1, world_size=self.world_size)  # fmt: skip
        log.warning("rank %d step %d: rolled back to step %d, skipping %d batches (steps %d..%d) of data",
                    self.rank, s, restored.step, len(skipped), skipped[0].step, skipped[-1].step)
        self.restored = restored
        self.sampler = self._sampler(restored.position)
        self.step = restored.step
        self._batch = None
        self._last_saved = restored.step
        self._skipped_seen = int(getattr(self.engine, "skipped_steps", 0))
        self.rollbacks += 1

    def _give_up(self, step: int, fault: Fault, why: str, recent: list[Rollback]) -> None:
        """Stop for good: let healthy checkpoints in flight commit, record why, raise on every rank."""
        hc = self.config.health
        message = f"training diverged at step {step}: {why}; last fault: {fault.reason}"
        log.error("rank %d step %d: %s", self.rank, step, message)
        self.recorder.write("gave_up", step=step, kind=fault.kind, reason=message, fault=fault.reason,
                            rollbacks=len(recent), max_rollbacks=hc.max_rollbacks, window=hc.rollback_window,
                            recent_fault_steps=[r.fault_step for r in recent])  # fmt: skip
        self._settle_saves()
        self._closed = True
        self.stopped = True
        self.checkpointer.close()
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
        self.agent.close("diverged")
        raise TrainingDiverged(message, step=step, reason=fault.reason, rollbacks=[r.to_json() for r in recent])

    def _settle_saves(self) -> None:
        """Wait for the save in flight; a failed one is logged (the loader never sees it)."""
        try:
            self.checkpointer.wait()
        except Exception as exc:  # noqa: BLE001 - reported below through the handle
            log.warning("rank %d step %d: checkpoint in flight failed: %s", self.rank, self.step, exc)
        self._report_saves()

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
                kept = self.checkpointer.committed_snapshot()
                if self.peers is not None and kept is not None and kept.step == info.step:
                    self.peers.keep_own(kept, self.rank)
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
            "health": {"history": self.health.to_json(), "rollbacks": self.ledger.to_json()},
        }  # fmt: skip

    def _restore(self, max_step: int | None = None, *, rollback: bool = False, required: bool = False,
                 host: CommittedSnapshot | None = None) -> RestoreInfo | None:
        """Load the newest good checkpoint (at or below ``max_step``) into the engine.

        At start no checkpoint means a fresh start at step 0; for a ``rollback`` it means
        ``None``; where one is ``required`` (a re-form or a spare: the model's weights are no
        longer the initial ones) it raises :class:`ReformFailed`. Rollbacks recorded in the
        journal are merged with the checkpoint's.

        ``host``: this process's host copy of its part of the last committed save (a re-form).
        Where it is the newest committed step, the parts of this rank's new partition it holds
        are copied from it and only the rest is read from disk. Should the loader fall back to
        an older step (the newest one is corrupt somewhere), every rank loads that step again
        from disk alone, so no rank mixes two steps.
        """
        root = self.config.checkpoint_dir
        if self.rank == 0:
            steps = [c.step for c in list_checkpoints(root)
                     if c.committed and (max_step is None or c.step <= max_step)]  # fmt: skip
            found = {"any": bool(steps), "journal": read_journal(root) if steps and not rollback else [],
                     "newest": max(steps) if steps else None}
            self._coord.broadcast(json.dumps(found).encode(), self.config.commit_timeout_s)
        else:
            found = json.loads(self._coord.broadcast(None, self.config.commit_timeout_s))
        if not found["any"]:
            if rollback:
                return None
            if required:
                raise ReformFailed(f"rank {self.rank}: no committed checkpoint under {root} to resume from",
                                   round=self.round)
            log.info("rank %d: no checkpoint under %s: starting at step 0", self.rank, root)
            self.recorder.write("restore", step=0, world_size=self.world_size, saved_world_size=0)
            return RestoreInfo(0, DataPosition(), 0)
        self.state.ensure_optimizer_state()
        targets, staged = self.state.load_targets()
        host_bytes = 0
        self._peer_fill = PeerFill()
        if self.peers is not None:  # collective: every rank says what it holds, pulls what it lacks
            targets, self._peer_fill = self.peers.fill(targets, found["newest"], self._control, self.rank,
                                                       self.world_size)
            host_bytes = self._peer_fill.own_bytes
        elif host is not None and host.step == found["newest"] and not staged:
            # this rank's own part alone (no peer replicas): the same fill, from one part
            targets, copied = fill_from_parts(targets, [Part(host.step, self.rank, dict(host.tensors))])
            host_bytes = sum(copied.values())
        try:
            result = load(root, targets, max_step=max_step, coordinator=self._coord,
                          timeout_s=self.config.commit_timeout_s, read_bytes_per_s=self.config.restore_read_bytes_per_s)
            if result.step != found["newest"]:  # the same on every rank: see the docstring
                skipped = result.skipped  # the newer steps refused: they are set aside below
                targets, staged = self.state.load_targets()
                result = load(root, targets, step=result.step, coordinator=self._coord,
                              timeout_s=self.config.commit_timeout_s,
                              read_bytes_per_s=self.config.restore_read_bytes_per_s)
                result = replace(result, skipped=[*skipped, *result.skipped])
                host_bytes = 0
                self._peer_fill = PeerFill()
        except LayoutMismatch as exc:
            raise self._incompatible(None) or IncompatibleCheckpoint(str(exc)) from exc
        except CheckpointNotFound:
            if rollback:
                log.error("rank %d: no loadable checkpoint at or below step %d under %s", self.rank, max_step, root)
                return None
            log.error("rank %d: checkpoints exist under %s but none is loadable", self.rank, root)
            raise
        mismatch = self._incompatible(result.step)
        if mismatch is not None:
            raise mismatch
        self._restore_bytes = (host_bytes, result.bytes_read)
        peer_bytes = self._peer_fill.held_bytes + self._peer_fill.pulled_bytes
        # The world's restore sources, for the record: bytes from own memory, peers' memory, storage.
        sources = torch.tensor([host_bytes, peer_bytes, result.bytes_read], dtype=torch.int64)
        dist.all_reduce(sources, group=self._control)
        world_host, world_peer, world_disk = (int(v) for v in sources.tolist())
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
        self.client_state.restore(root, result.step, result.metadata[0].get("client"), self._coord,
                                  self.config.commit_timeout_s)
        saved_world = result.world_size
        if self.rank < saved_world:
            _set_rng_state(result.metadata[self.rank]["rng"])
        else:
            _seed_rng(self.config.seed * 1_000_003 + result.step * 1009 + self.rank)
        health = meta.get("health") or {}
        self.health = HealthMonitor(self.config.health, health.get("history", []))
        self.ledger.merge(RollbackLedger.from_json(health.get("rollbacks", [])).rollbacks)
        self.ledger.merge(RollbackLedger.from_json(found["journal"]).rollbacks)
        log.info("rank %d round %d: restored step %d (saved by %d ranks, now %d)%s; %d bytes from its own memory, "
                 "%d from peer replicas, %d read from storage", self.rank, self.round, result.step, saved_world,
                 self.world_size, " to roll back" if rollback else "", host_bytes, peer_bytes, result.bytes_read)
        if not rollback:
            self.recorder.write("restore", step=result.step, world_size=self.world_size,
                                saved_world_size=saved_world, skipped=[s for s, _ in result.skipped],
                                rollbacks=len(self.ledger), host_bytes=host_bytes, peer_bytes=peer_bytes,
                                disk_bytes=result.bytes_read, world_host_bytes=world_host,
                                world_peer_bytes=world_peer, world_disk_bytes=world_disk)  # fmt: skip
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


def _newer_after_broken_join(agent: Any, spec: ReformSpec, exc: BaseException, wait_s: float) -> ReformSpec | None:
    """A spare's join that a lost peer broke (its store host died, a connection was reset): the
    round is lost, not the spare. Leave what formed and return the agent's next Reform, within
    ``wait_s``; None when the error is not that (a timeout, a bad spec) or no newer round comes."""
    text = str(exc).lower()
    if not is_collective_error(exc) or "timed out" in text or "timeout" in text:
        return None
    take = getattr(agent, "take_newer_reform", None)
    if take is None:
        return None
    log.error("spare pid %d: round %d broke while it formed (%s); waiting for the next round", os.getpid(),
              spec.round, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    world_sockets.cut()
    leave_world()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        newer = take(spec.round)
        if newer is not None:
            return newer
        time.sleep(0.05)
    return None


def _warm_up(recipe: _EngineRecipe, config: TrainerConfig, backend: str) -> None:
    """A spare builds (and drops) an engine for its model in a world of one before it waits.

    The first ``deepspeed.initialize`` of a process pays for lazy imports, DeepSpeed's comm
    extension and first-use set-up (≈1.5 s here); a spare that did it while waiting joins its
    world as fast as a survivor re-forms. The model's weights are overwritten by the restore.
    """
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    try:
        import deepspeed
        import torch.distributed.distributed_c10d as c10d

        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        c10d.default_pg_timeout = timeout
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, auto_mpi_discovery=False)
        engine = recipe.build(config, 1)
        _release_engine(engine, 0)
        del engine
    finally:
        leave_world()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _done() -> None:
    """What a released engine's ``destroy`` becomes: it was destroyed once already."""


def _release_engine(engine: Any, rank: int) -> None:
    """Detach an engine from the model it wraps, so a new engine can wrap the same model.

    ``engine.destroy()`` removes ZeRO's gradient hooks from the parameters but (DeepSpeed 0.19)
    leaves the engine's forward hooks on the module: the old engine's forward prologue would still
    run (and change the numerics of the next step). Those handles are removed here too, and so
    are the gradients the interrupted step left in the parameters.
    """
    try:
        engine.destroy()
    except Exception as exc:  # noqa: BLE001 - the old world may be broken
        log.warning("rank %d: destroying the old engine: %s", rank, exc)
    # DeepSpeedEngine.__del__ calls destroy() again whenever the collector gets to the old engine,
    # and ZeRO's destroy() sets ``_hp_mapping = None`` on every parameter: the same parameter
    # objects the new engine has linked by then, whose saves would then hold no tensors at all.
    engine.destroy = _done
    zero = getattr(engine, "optimizer", None)
    if zero is not None and hasattr(zero, "destroy"):
        zero.destroy = _done
    for attr in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        handle = getattr(engine, attr, None)
        if handle is not None:
            handle.remove()
            setattr(engine, attr, None)
    # The failed step may have accumulated gradients of some micro batches into the parameters.
    for p in engine.module.parameters():
        p.grad = None
    # Free the old optimizer's state and fp32 partitions now, without waiting for a collection of
    # the engine's reference cycles (the module's own weights stay: the new engine copies them).
    base = getattr(zero, "optimizer", None)
    if base is not None:
        base.state.clear()
        for group in base.param_groups:
            group["params"] = []
    for attr in ("single_partition_of_fp32_groups", "averaged_gradients", "fp32_partitioned_groups_flat"):
        value = getattr(zero, attr, None)
        if isinstance(value, list | dict):
            value.clear()


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
