"""One process of a pool that forms real multi-process worlds (gloo on loopback) in turn, to save
or load checkpoints.

Usage: ckpt_dist_child.py PLAN INDEX. PLAN is a JSON list of tasks, ``{"mode": "save" | "load" |
"barrier", "root", "step", "port", "members": [pool indices]}``; each process runs, in order, the
tasks it is a member of, as rank ``members.index(INDEX)`` of a world of ``len(members)`` (a
process group of its own, left before the next task). Prints one ``RESULT {json}`` line per task;
exits non-zero on any failure.
"""

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from ckpt_testlib import SPECS, check_targets, rank_state, rank_targets  # noqa: E402

from stalwart.ckpt import Checkpointer, SaveConfig, TorchDistCoordinator, load  # noqa: E402

SAVE_SCHEMES = {"w32": "cols", "bf": "flat", "h16": "rows", "ids": "rows", "f64": "flat", "bias": "replicated"}
LOAD_SCHEMES = {"w32": "rows", "bf": "flat", "h16": "cols", "ids": "flat", "f64": "cols", "bias": "replicated"}


def run_task(task: dict, rank: int, world: int) -> dict:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{task['port']}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    out: dict = {"rank": rank, "pid": os.getpid()}
    if task["mode"] == "barrier":
        dist.barrier()
    else:
        root, step = task["root"], task["step"]
        coord = TorchDistCoordinator(timeout_s=60)
        if task["mode"] == "save":
            with Checkpointer(root, SaveConfig(chunk_bytes=4096), coordinator=coord) as ckpt:
                info = ckpt.save(step, rank_state(SPECS, SAVE_SCHEMES, step, world, rank), {"rank": rank}).result()
            out["digest"] = info.manifest_digest
        else:
            targets = rank_targets(SPECS, LOAD_SCHEMES, world, rank)
            result = load(root, targets, coordinator=coord)
            out.update(step=result.step, saved_world=result.world_size, bad=check_targets(SPECS, targets, result.step),
                       meta_ranks=[m["rank"] for m in result.metadata])
    dist.destroy_process_group()
    return out


def main() -> int:
    plan, index = json.loads(sys.argv[1]), int(sys.argv[2])
    for number, task in enumerate(plan):
        if index in task["members"]:
            out = run_task(task, task["members"].index(index), len(task["members"]))
            print("RESULT " + json.dumps({"task": number, **out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
