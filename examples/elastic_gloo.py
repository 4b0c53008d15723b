"""A tiny elastic data-parallel job for torchrun: gloo all-reduce of a linear model's gradients.

    torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 10 \\
        --rdzv-backend stalwart --rdzv-endpoint 127.0.0.1:2379 --rdzv-id demo \\
        examples/elastic_gloo.py --steps 200 --steps-log steps.jsonl

Each completed step appends one JSON line (node, rank, world size, step, time) to ``--steps-log``,
so a test or a person can see when the world shrank or grew.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of simulated compute per step")
    parser.add_argument("--steps-log", default=None, help="append one JSON line per step here")
    parser.add_argument("--node-id", default=os.environ.get("STALWART_NODE", socket.gethostname()))
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        time.sleep(args.step_time)
        if args.steps_log:
            line = {"node": args.node_id, "rank": rank, "world": world, "step": step, "restart": restart,
                    "t": time.time(), "loss": loss.item()}
            with open(args.steps_log, "a") as f:
                f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
