"""Building DeepSpeed engines, and letting go of them, for one world after another.

:class:`_EngineRecipe` keeps what :meth:`Trainer.initialize <stalwart.trainer.Trainer.initialize>`
gave ``deepspeed.initialize`` (a torch optimizer as an :class:`_OptimizerRecipe`), so that a
re-form can build the engine for the next world without the script's help. :func:`_release_engine`
detaches an old engine from the model it wraps; :func:`_warm_up` pays a process's first engine
build before it joins a world.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stalwart.trainer.batching import accumulation_steps
from stalwart.trainer.config import TrainerConfig
from stalwart.trainer.errors import UnsupportedConfig
from stalwart.trainer.reform import leave_world

log = logging.getLogger(__name__)


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
    skeleton: torch.nn.Module | None = None
    """ZeRO-3 only: the model's structure on the meta device. ZeRO-3 partitions the module's own
    parameters (each rank keeps its slice), so a module of the old world cannot be handed to an
    engine of another: each build after the first wraps a new module made from this one (its
    weights are what the restore loads next; its buffers are copied from the module before)."""
    builds: int = 0

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
        skeleton = None
        if int((ds_config.get("zero_optimization") or {}).get("stage", 0)) == 3 and unsupported is None:
            if any(hasattr(p, "ds_id") for p in model.parameters()):
                unsupported = "a ZeRO-3 model built under deepspeed.zero.Init cannot be rebuilt for another world"
            else:
                try:
                    skeleton = copy.deepcopy(model).to("meta")
                except Exception as exc:  # noqa: BLE001 - a module that cannot be copied
                    unsupported = f"a ZeRO-3 model must be copyable to be rebuilt for another world ({exc})"
        return cls(model, copy.deepcopy(ds_config), kwargs, recipe, unsupported, skeleton)

    def build(self, config: TrainerConfig, world: int) -> Any:
        import deepspeed

        gas = accumulation_steps(config.global_batch, config.micro_batch, world)  # fail before any work
        wanted = {"train_batch_size": config.global_batch, "train_micro_batch_size_per_gpu": config.micro_batch}
        for key, value in wanted.items():
            if key in self.ds_config and self.ds_config[key] != value:
                raise ValueError(f"ds_config[{key!r}] = {self.ds_config[key]} disagrees with TrainerConfig ({value})")
        ds_config = {**copy.deepcopy(self.ds_config), **wanted, "gradient_accumulation_steps": gas}
        kwargs = dict(self.ds_kwargs)
        if self.skeleton is not None and self.builds > 0:
            self.model = _rebuilt(self.skeleton, self.model)
        self.builds += 1
        if self.optimizer is not None:
            kwargs["optimizer"] = self.optimizer.build(self.model)
            sched = kwargs.get("lr_scheduler")
            if sched is not None and not callable(sched):
                # The scheduler instance drives the optimizer built here (its state, like the
                # optimizer's, comes from the checkpoint restored next).
                sched.optimizer = kwargs["optimizer"]
        engine, *_ = deepspeed.initialize(model=self.model, config=ds_config, **kwargs)
        return engine


def _rebuilt(skeleton: torch.nn.Module, before: torch.nn.Module) -> torch.nn.Module:
    """A new module of ``skeleton``'s structure on the CPU (DeepSpeed moves it to the device and
    partitions it): parameters uninitialized (the restore fills them), buffers those of
    ``before`` (ZeRO-3 leaves buffers whole on every rank; the checkpoint may not hold them)."""
    module = copy.deepcopy(skeleton).to_empty(device="cpu")
    with torch.no_grad():
        for (name, new), (old_name, old) in zip(module.named_buffers(), before.named_buffers(), strict=True):
            assert name == old_name, (name, old_name)
            new.copy_(old.detach().to("cpu"))
    return module


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


def _check_engine(engine: Any, config: TrainerConfig, accumulation: int, world_size: int) -> None:
    """The engine's batch sizes are ``config``'s for this world, and it is data parallel only."""
    got = (int(engine.train_batch_size()), int(engine.train_micro_batch_size_per_gpu()),
           int(engine.gradient_accumulation_steps()))
    want = (config.global_batch, config.micro_batch, accumulation)
    if got != want:
        raise UnsupportedConfig(f"engine batch sizes (global, micro, accumulation) {got} differ from {want}")
    if int(getattr(engine, "dp_world_size", world_size)) != world_size:
        raise UnsupportedConfig("tensor/pipeline parallelism is not supported (data parallel only)")


def _grad_norm(engine: Any) -> float | None:
    """The engine's global gradient norm of the last optimizer step (``None`` where unknown)."""
    get = getattr(engine, "get_global_grad_norm", None)
    if get is None:
        return None
    value = get()
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)
