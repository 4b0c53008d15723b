"""Run under torchrun by test_client_state.py: an lr_scheduler instance and user state (an EMA
object and a save/load pair) through a checkpoint and a restore at another world size.

    state_child.py save OUT       world 1: 4 steps, checkpoints at 2 and 4; writes OUT/saved.json
    state_child.py restore OUT    world 2: restores step 4, registers the state after initialize,
                                  takes 2 more steps; writes OUT/restored.json
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from zero_child import Net, data

from stalwart.trainer import Trainer, TrainerConfig

LR, GAMMA = 1e-2, 0.5


class Ema:
    """An exponential moving average of the model's weights (state_dict/load_state_dict)."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay, self.updates = decay, 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.shadow[n].mul_(self.decay).add_(p.detach().float(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay, self.updates = state["decay"], state["updates"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


def make(out: str, total: int) -> tuple[Trainer, torch.nn.Module]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=GAMMA)
    cfg = TrainerConfig(checkpoint_dir=os.path.join(out, "ckpt"), global_batch=8, micro_batch=2, dataset_len=64,
                        total_steps=total, save_every_steps=2)
    ds = {"zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    return Trainer.initialize(model, ds, cfg, optimizer=optimizer, lr_scheduler=scheduler), model


def train(trainer: Trainer, model: torch.nn.Module, ema: Ema, mixer: dict[str, Any]) -> list[float]:
    lrs = []
    for batch in trainer.batches():
        for mb in batch.micro_batches:
            loss = trainer.engine(*data(mb))
            trainer.engine.backward(loss)
            trainer.engine.step()
        ema.update(model)
        mixer["weights"][trainer.rank % 2] += 1.0
        mixer["seen"].append(batch.step)
        lrs.append(trainer.engine.optimizer.param_groups[0]["lr"])
        trainer.step_done(loss.item())
    trainer.finish()
    return lrs


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "save":
        trainer, model = make(out, 4)
        ema, mixer = Ema(model), {"weights": [0.0, 0.0], "seen": []}
        trainer.register_state("ema", ema)
        trainer.register_state("mixer", save=lambda: mixer, load=lambda s: mixer.update(s))
        lrs = train(trainer, model, ema, mixer)
        result = {"lrs": lrs, "ema": {n: t.tolist() for n, t in ema.shadow.items()}, "updates": ema.updates,
                  "mixer": mixer, "cannot_reform": trainer.cannot_reform}
    else:
        trainer, model = make(out, 6)
        restored_lr = trainer.engine.optimizer.param_groups[0]["lr"]
        ema, mixer = Ema(model), {"weights": [0.0, 0.0], "seen": []}
        trainer.register_state("ema", ema)  # after the restore: loaded at once
        trainer.register_state("mixer", save=lambda: mixer, load=lambda s: mixer.update(s))
        result = {"step": trainer.restored.step, "lr": restored_lr, "updates": ema.updates,
                  "ema": {n: t.tolist() for n, t in ema.shadow.items()}, "mixer": json.loads(json.dumps(mixer)),
                  "last_epoch": trainer.engine.lr_scheduler.last_epoch}
        result["lrs"] = train(trainer, model, ema, mixer)
    if dist.get_rank() == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
