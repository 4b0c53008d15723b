"""Run by test_zero_reshard.py (as ranks in torchrun's environment): save ZeRO state at one world
size, restore at another.

    zero_child.py save OUT CONFIGS      train 4 steps per config, checkpoint steps 2 and 4, write the
                                        gathered fp32 weights and Adam moments of both as references,
                                        then restore in the same world and compare
    zero_child.py restore OUT CONFIGS   restore each config's newest checkpoint here and compare
    zero_child.py faults OUT            (one rank) corrupt / missing newest checkpoint, other model
    zero_child.py restore,faults OUT CONFIGS   modes joined by commas run in turn in one world

Rank 0 writes ``OUT/result-<mode>-w<world>.json`` for each mode; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from cpu_fp16 import allow_fp16_on_cpu
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from torch import nn

from stalwart.ckpt import CheckpointError
from stalwart.trainer import Trainer, TrainerConfig, TrainerError

GLOBAL_BATCH, MICRO_BATCH, DATASET_LEN = 24, 2, 96

# name -> (zero stage, offload_optimizer to cpu, fp16)
CONFIGS: dict[str, tuple[int, bool, bool]] = {
    "z1": (1, False, False),
    "z2": (2, False, False),
    "z3": (3, False, False),
    "z2-off-fp16": (2, True, True),
    "z3-off": (3, True, False),
    "z3-fp16": (3, False, True),
}


class Net(nn.Module):
    """Odd sizes, so partitions split parameters unevenly and pad at the end."""

    def __init__(self, hidden: int = 29) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 11)
        self.fc1 = nn.Linear(11, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, 5)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.norm(self.fc1(self.emb(ids).mean(1)))))
        return (out.float() - target).pow(2).mean()


def data(indices: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + sum(indices))
    ids = torch.tensor([[(i * 7 + j) % 37 for j in range(6)] for i in indices])
    return ids, torch.randn(len(indices), 5, generator=gen)


def make_trainer(name: str, root: str, hidden: int = 29, total_steps: int = 4, save_every: int = 2) -> Trainer:
    stage, offload, fp16 = CONFIGS[name]
    torch.manual_seed(0)
    model = Net(hidden)
    ds: dict[str, Any] = {"zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 3}}}
    kwargs: dict[str, Any] = {}
    if offload:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        ds["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
        kwargs["model_parameters"] = model.parameters()
    else:
        kwargs["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if fp16:
        allow_fp16_on_cpu()
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 10}
    cfg = TrainerConfig(checkpoint_dir=os.path.join(root, name), global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH,
                        dataset_len=DATASET_LEN, total_steps=total_steps, save_every_steps=save_every)
    return Trainer.initialize(model, ds, cfg, **kwargs)


def gathered(trainer: Trainer) -> dict[str, np.ndarray]:
    """Full fp32 weights and Adam moments through DeepSpeed's public accessors (collective)."""
    out = {}
    for name, p in trainer.engine.module.named_parameters():
        out[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().cpu().numpy().copy()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().numpy().copy()
    return out


def train(trainer: Trainer, out: str, name: str) -> None:
    for batch in trainer.batches():
        losses = []
        for mb in batch.micro_batches:
            ids, target = data(mb)
            loss = trainer.engine(ids, target)
            trainer.engine.backward(loss)
            trainer.engine.step()
            losses.append(loss.item())
        trainer.step_done(sum(losses) / len(losses))
        if trainer.step in (2, 4):
            ref = gathered(trainer)
            if trainer.rank == 0:
                np.savez(os.path.join(out, f"ref-{name}-{trainer.step}.npz"), **ref)
    trainer.finish()


def compare(trainer: Trainer, out: str, name: str, step: int) -> list[str]:
    """Names whose gathered values are not bitwise equal to the reference (empty: all equal)."""
    now = gathered(trainer)
    ref = np.load(os.path.join(out, f"ref-{name}-{step}.npz"))
    bad = [k for k in ref.files if k not in now or now[k].tobytes() != ref[k].tobytes()]
    return bad + [k for k in now if k not in ref.files]


def one_more_step(trainer: Trainer) -> float:
    """Training continues after a restore (at this world's accumulation)."""
    for batch in trainer.batches():
        for mb in batch.micro_batches:
            loss = trainer.engine(*data(mb))
            trainer.engine.backward(loss)
            trainer.engine.step()
        return trainer.step_done(loss.item())
    return float("nan")


def restore_and_check(out: str, name: str, root: str, expect_step: int) -> dict[str, Any]:
    trainer = make_trainer(name, root, total_steps=expect_step + 1, save_every=100)  # one step more, no save
    result = {"step": trainer.restored.step, "skipped": [s for s, _ in trainer.restored.skipped],
              "position": trainer.restored.position.to_json(), "engine_step": int(trainer.engine.global_steps)}
    result["rng"] = bytes(torch.get_rng_state().numpy()).hex()
    result["mismatch"] = compare(trainer, out, name, expect_step)
    result["next_loss"] = one_more_step(trainer)
    trainer.checkpointer.close()
    return result


def main() -> None:
    modes, out = sys.argv[1].split(","), sys.argv[2]
    names = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else []
    ckroot = os.path.join(out, "ckpt")
    for mode in modes:  # in turn, in this one world
        results: dict[str, Any] = {}
        if mode == "save":
            for name in names:
                trainer = make_trainer(name, ckroot)
                train(trainer, out, name)
                rng_at_save = bytes(torch.get_rng_state().numpy())
                torch.manual_seed(12345)  # the restore must bring the saved stream back
                results[name] = restore_and_check(out, name, ckroot, 4)
                results[name]["rng_restored"] = results[name]["rng"] == rng_at_save.hex()
                results[name]["cannot_reform"] = trainer.cannot_reform
        elif mode == "restore":
            for name in names:
                results[name] = restore_and_check(out, name, ckroot, 4)
        elif mode == "faults":
            results = faults(out, ckroot)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        if dist.get_rank() == 0:
            path = os.path.join(out, f"result-{mode}-w{dist.get_world_size()}.json")
            with open(path, "w") as f:
                json.dump(results, f)
    # Leave the world before the interpreter exits: gloo's threads torn down by static destructors
    # at exit have aborted a rank ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def faults(out: str, ckroot: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in ("corrupt", "missing"):
        root = os.path.join(out, case)
        shutil.copytree(os.path.join(ckroot, "z2"), os.path.join(root, "z2"))
        newest = os.path.join(root, "z2", "step-000000000004")
        if case == "corrupt":
            with open(os.path.join(newest, "rank-00000.bin"), "r+b") as f:
                f.seek(200)
                byte = f.read(1)
                f.seek(200)
                f.write(bytes([byte[0] ^ 0xFF]))
        else:
            os.remove(os.path.join(newest, "rank-00001.bin"))
        results[case] = restore_and_check(out, "z2", root, 2)
        # set aside, so that training on saves step 4 again instead of failing on it
        results[case]["set_aside"] = not os.path.exists(newest) and any(
            d.startswith("corrupt-step") for d in os.listdir(os.path.join(root, "z2")))
    try:
        make_trainer("z2", ckroot, hidden=30)
        results["incompatible"] = {"error": None}
    except (TrainerError, CheckpointError) as exc:
        results["incompatible"] = {"error": type(exc).__name__, "tensor": getattr(exc, "tensor", None)}
    return results


if __name__ == "__main__":
    main()
