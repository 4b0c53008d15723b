"""A DeepSpeed ZeRO engine's training state as logical tensors for ``stalwart.ckpt``.

Each rank describes only the partition it owns, in the coordinates of the whole (logical)
parameter, so a checkpoint written at one data-parallel size is read at any other with no
conversion step: ckpt tiles the saved parts and each new rank reads the byte ranges of its own
partition. Tensors, per trainable parameter ``<name>`` (``engine.module.named_parameters()``):

- ``fp32/<name>`` — the fp32 master weights;
- ``exp_avg/<name>``, ``exp_avg_sq/<name>`` — Adam's moments;
- ``frozen/<name>``, ``buffer/<name>`` — replicated tensors (saved by one rank).

Everything else (optimizer step count and hyperparameters, LR scheduler, loss scaler, engine
counters) is JSON metadata. Low-precision (fp16/bf16) weights are not saved: they are rebuilt from
the fp32 masters on restore, which is what the optimizer does after every step anyway.

Where the partitions live (DeepSpeed 0.19): ZeRO-3 has public per-partition accessors
(``safe_get_local_fp32_param`` and friends). ZeRO-1/2 have only *full* accessors, which all-reduce a
whole parameter per call; their per-partition view is each parameter's ``_hp_mapping`` (the same
fragments DeepSpeed's universal checkpoint uses), so that is what this module reads and fills.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import (
    lazy_init_hp_params_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)

from stalwart.ckpt import Shard
from stalwart.trainer.errors import UnsupportedConfig

log = logging.getLogger(__name__)

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
_ADAM_FAMILY = {"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"}
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


_Staged = tuple[torch.nn.Parameter, str, torch.Tensor]


@dataclass
class _Stage3Part:
    """A ZeRO-3 parameter's local partition: ``valid`` elements from ``start`` (the rest is padding)."""

    start: int
    valid: int


class ZeroState:
    """Reads and writes one engine's ZeRO state; construct after ``deepspeed.initialize``.

    Save: :meth:`ensure_optimizer_state`, then :meth:`save_tensors` and :meth:`metadata`.
    Restore: :meth:`ensure_optimizer_state`, :meth:`load_targets`, ``ckpt.load`` into them, then
    :meth:`apply_loaded` (a collective on ZeRO-1/2: it all-gathers the rebuilt low-precision
    weights) and :meth:`apply_metadata`. Raises :class:`UnsupportedConfig` for engines it cannot
    checkpoint faithfully.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        if self.stage not in (1, 2, 3):
            raise UnsupportedConfig(f"ZeRO stage {self.stage} is not supported; use stage 1, 2 or 3")
        self.zero = engine.optimizer
        self.base: Any = getattr(self.zero, "optimizer", None)
        if self.base is None or type(self.base).__name__ not in _ADAM_FAMILY:
            raise UnsupportedConfig(
                f"optimizer {type(self.base).__name__} is not supported; use Adam/AdamW "
                "(torch, FusedAdam or DeepSpeedCPUAdam)"
            )
        if self.stage == 3 and getattr(self.zero, "swap_optimizer", False):
            raise UnsupportedConfig("NVMe offload of the optimizer is not supported")
        named = list(engine.module.named_parameters())
        self.params = [(n, p) for n, p in named if p.requires_grad]
        self.frozen = [(n, p) for n, p in named if not p.requires_grad]
        if self.stage == 3 and self.frozen:
            raise UnsupportedConfig(f"frozen parameters under ZeRO-3 are not supported: {self.frozen[0][0]}")
        self.buffers = list(engine.module.named_buffers())

    # --- layout -------------------------------------------------------------------------------

    def shape(self, param: Any) -> tuple[int, ...]:
        return tuple(param.ds_shape) if self.stage == 3 else tuple(param.shape)

    def logical_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor name and global shape, in the model's parameter order (for mismatch errors)."""
        out: list[tuple[str, tuple[int, ...]]] = []
        for name, p in self.params:
            out += [(f"{kind}/{name}", self.shape(p)) for kind in ("fp32", *MOMENT_KEYS)]
        out += [(f"frozen/{n}", tuple(p.shape)) for n, p in self.frozen]
        out += [(f"buffer/{n}", tuple(b.shape)) for n, b in self.buffers]
        return out

    def _flat_groups(self) -> list[torch.Tensor]:
        if self.stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def _stage3_part(self, param: Any) -> _Stage3Part:
        size = int(param.partition_numel())
        start = dist.get_rank(group=param.ds_process_group) * size
        return _Stage3Part(start, max(0, min(size, int(param.ds_numel) - start)))

    def _fragments(self, key: str | None) -> Iterator[tuple[str, torch.nn.Parameter, int, torch.Tensor]]:
        """ZeRO-1/2: ``(name, param, start, fragment)`` for each parameter this rank owns a part of."""
        for name, p in self.params:
            mapping = p._hp_mapping
            if mapping is None or mapping.lp_fragment_address.numel == 0:
                continue
            frag = mapping.hp_fragment if key is None else mapping.get_optim_state_fragment(key)
            # detach(): same storage, but writable from ckpt's reader threads (no autograd there).
            yield name, p, int(mapping.lp_fragment_address.start), frag.detach()

    # --- optimizer state ----------------------------------------------------------------------

    def _zero_step(self, flat: torch.Tensor) -> Any:
        """A step count of the type the optimizer keeps (torch: a float tensor; DeepSpeed: int)."""
        if type(self.base).__module__.startswith("torch."):
            group = self.base.param_groups[0]
            on_device = bool(group.get("capturable") or group.get("fused"))
            return torch.zeros((), dtype=torch.float32, device=flat.device if on_device else "cpu")
        return 0

    def ensure_optimizer_state(self) -> None:
        """Create Adam's state (zeros, step 0) where the optimizer has not stepped yet.

        Adam creates its state lazily at the first step, so a fresh engine has nothing to restore
        into (or to save at step 0). The tensors made here are what Adam itself would create.
        """
        created = False
        for flat in self._flat_groups():
            state = self.base.state[flat]
            if all(k in state for k in MOMENT_KEYS):
                continue
            state["step"] = self._zero_step(flat)
            for k in MOMENT_KEYS:
                state[k] = torch.zeros_like(flat)
            created = True
        if self.stage < 3 and (created or not getattr(self.zero, "_hp_optimizer_states_linked", True)):
            for i, flat in enumerate(self._flat_groups()):
                lazy_init_hp_params_optimizer_state(self.zero.bit16_groups[i], flat, self.base.state)

    def optimizer_step_count(self) -> int:
        steps = {int(self.base.state[flat]["step"]) for flat in self._flat_groups() if "step" in self.base.state[flat]}
        if len(steps) > 1:
            log.warning("optimizer groups disagree on the step count: %s", sorted(steps))
        return max(steps, default=0)

    # --- save ---------------------------------------------------------------------------------

    def save_tensors(self) -> dict[str, torch.Tensor | Shard]:
        """This rank's partitions (views, not copies: snapshot them before the next step)."""
        out: dict[str, torch.Tensor | Shard] = {}
        if self.stage == 3:
            for name, p in self.params:
                part = self._stage3_part(p)
                if part.valid == 0:
                    continue
                shape = self.shape(p)
                out[f"fp32/{name}"] = Shard.flat(safe_get_local_fp32_param(p)[: part.valid], shape, part.start)
                for k in MOMENT_KEYS:
                    local = safe_get_local_optimizer_state(p, k)[: part.valid]
                    out[f"{k}/{name}"] = Shard.flat(local, shape, part.start)
        else:
            for kind, key in (("fp32", None), *((k, k) for k in MOMENT_KEYS)):
                for name, p, start, frag in self._fragments(key):
                    out[f"{kind}/{name}"] = Shard.flat(frag, self.shape(p), start)
        for n, p in self.frozen:
            out[f"frozen/{n}"] = p.detach()
        for n, b in self.buffers:
            out[f"buffer/{n}"] = b.detach()
        return out

    def metadata(self) -> dict[str, Any]:
        engine = self.engine
        groups = [{k: _json_value(v) for k, v in g.items() if k != "params" and _json_safe(v)}
                  for g in self.base.param_groups]
        scaler = getattr(self.zero, "loss_scaler", None)
        sched = engine.lr_scheduler
        return {
            "zero_stage": self.stage,
            "optimizer": {"step": self.optimizer_step_count(), "param_groups": groups},
            "engine": {
                "global_steps": int(engine.global_steps),
                "global_samples": int(engine.global_samples),
                "skipped_steps": int(engine.skipped_steps),
            },
            "loss_scaler": None if scaler is None else {
                f: _json_value(getattr(scaler, f)) for f in _SCALER_FIELDS if hasattr(scaler, f)
            },
            "lr_scheduler": None if sched is None else _checked_json(sched.state_dict(), "lr_scheduler state"),
        }

    # --- restore ------------------------------------------------------------------------------

    def load_targets(self) -> tuple[dict[str, torch.Tensor | Shard], list[_Staged]]:
        """Where ``ckpt.load`` should write, plus ZeRO-3 staging buffers for :meth:`apply_loaded`."""
        targets: dict[str, torch.Tensor | Shard] = {}
        staged: list[_Staged] = []
        if self.stage == 3:
            for name, p in self.params:
                part = self._stage3_part(p)
                if part.valid == 0:
                    continue
                for kind in ("fp32", *MOMENT_KEYS):
                    if kind == "fp32":
                        current = safe_get_local_fp32_param(p)
                    else:
                        current = safe_get_local_optimizer_state(p, kind)
                    buf = current.detach().to("cpu", copy=True)  # keeps the padding as it is
                    targets[f"{kind}/{name}"] = Shard.flat(buf[: part.valid], self.shape(p), part.start)
                    staged.append((p, kind, buf))
        else:
            for kind, key in (("fp32", None), *((k, k) for k in MOMENT_KEYS)):
                for name, p, start, frag in self._fragments(key):
                    targets[f"{kind}/{name}"] = Shard.flat(frag, self.shape(p), start)
        for n, p in self.frozen:
            targets[f"frozen/{n}"] = p.detach()
        for n, b in self.buffers:
            targets[f"buffer/{n}"] = b.detach()
        return targets, staged

    @torch.no_grad()
    def apply_loaded(self, staged: list[_Staged]) -> None:
        """Push loaded partitions into the optimizer and rebuild the low-precision weights.

        Collective on every rank of the data-parallel group.
        """
        if self.stage == 3:
            for p, kind, buf in staged:
                if kind == "fp32":
                    safe_set_local_fp32_param(p, buf)
                else:
                    safe_set_local_optimizer_state(p, buf, kind)
            # Rebuild each rank's low-precision partition from its fp32 partition, as a ZeRO-3
            # optimizer step ends (DeepSpeed 0.19 has no public call for this alone).
            for i, fp32_flat in enumerate(self.zero.fp32_partitioned_groups_flat):
                lp_flat = self.zero.fp16_partitioned_groups_flat[i]
                if fp32_flat.numel() and lp_flat is not None:
                    lp_flat.data.copy_(fp32_flat.data)
                    views = self.zero.unflatten(lp_flat, self.zero.fp16_partitioned_groups[i])
                    for lp_param, view in zip(self.zero.fp16_partitioned_groups[i], views, strict=True):
                        lp_param.data = view.data
        else:
            self.zero.update_lp_params()

    def apply_metadata(self, meta: dict[str, Any]) -> None:
        """Restore the optimizer's step count and hyperparameters, engine counters, LR scheduler and
        loss scaler from the saving rank 0's metadata."""
        engine = self.engine
        opt = meta["optimizer"]
        for flat in self._flat_groups():
            state = self.base.state[flat]
            old = state.get("step")
            if isinstance(old, torch.Tensor):
                state["step"] = torch.full_like(old, float(opt["step"]))
            else:
                state["step"] = int(opt["step"])
        saved_groups = opt["param_groups"]
        for i, group in enumerate(self.base.param_groups):
            saved = saved_groups[min(i, len(saved_groups) - 1)] if saved_groups else {}
            for k, v in saved.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v
        counters = meta["engine"]
        engine.global_steps = counters["global_steps"]
        engine.global_samples = counters["global_samples"]
        engine.skipped_steps = counters["skipped_steps"]
        # The accumulation boundary is micro_steps % gas: align it with the new world's gas.
        engine.micro_steps = counters["global_steps"] * engine.gradient_accumulation_steps()
        scaler = getattr(self.zero, "loss_scaler", None)
        if scaler is not None and meta.get("loss_scaler"):
            for f, v in meta["loss_scaler"].items():
                if hasattr(scaler, f):
                    setattr(scaler, f, v)
        if engine.lr_scheduler is not None and meta.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])


def _json_safe(v: Any) -> bool:
    if isinstance(v, bool | int | float | str) or v is None:
        return True
    if isinstance(v, list | tuple):
        return all(_json_safe(x) for x in v)
    return False


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return list(v) if isinstance(v, tuple) else v


def _checked_json(obj: Any, what: str) -> Any:
    if isinstance(obj, dict):
        return {str(k): _checked_json(v, what) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_checked_json(v, what) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if _json_safe(obj):
        return obj
    raise UnsupportedConfig(f"{what} holds a {type(obj).__name__}, which cannot be saved without pickle")
