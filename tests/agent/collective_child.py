"""Run under torchrun by test_collective_timer.py: a DeepSpeed ZeRO engine on gloo, the collective
timer installed *after* ``deepspeed.initialize`` (as AgentClient does inside the Trainer), rank 1
made slower outside collectives by SLOW_RANK_SLEEP seconds per step.

    collective_child.py OUT STAGES STEPS     STAGES e.g. 1,2,3: one engine per stage, in turn;
                                             writes OUT/rank-<rank>-stage-<stage>.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import deepspeed
import torch
from torch import nn

from stalwart.trainer import collective_timer

out, stages, steps = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
sleep = float(os.environ.get("SLOW_RANK_SLEEP", "0.15"))
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
for stage in stages:  # one engine after the other, each timed from a timer installed after it
    collective_timer.uninstall()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
          "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, config=ds,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert collective_timer.installed() is None
    timer = collective_timer.install()
    timer.take()
    blocked, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        if rank == 1:
            time.sleep(sleep)  # "compute" outside any collective
        x = torch.randn(2, 16)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        torch.distributed.barrier()  # an explicit end-of-step collective, like a loss all-reduce
        wall.append(time.perf_counter() - start)
        blocked.append(timer.take())
    with open(os.path.join(out, f"rank-{rank}-stage-{stage}.json"), "w") as f:
        json.dump({"rank": rank, "stage": stage, "by_name": timer.by_name, "blocked": blocked, "wall": wall}, f)
    del engine, model
    torch.distributed.barrier()
torch.distributed.destroy_process_group()
