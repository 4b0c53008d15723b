"""One rank of a real multi-process world (gloo on loopback) that saves or loads a checkpoint.

Usage: ckpt_dist_child.py save|load ROOT STEP PORT (RANK and WORLD_SIZE in the environment).
Prints one JSON line with what it saw; exits non-zero on any failure.
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


def main() -> int:
    mode, root, step, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    coord = TorchDistCoordinator(timeout_s=60)
    if mode == "save":
        with Checkpointer(root, SaveConfig(chunk_bytes=4096), coordinator=coord) as ckpt:
            info = ckpt.save(step, rank_state(SPECS, SAVE_SCHEMES, step, world, rank), {"rank": rank}).result()
        out = {"rank": rank, "digest": info.manifest_digest}
    else:
        targets = rank_targets(SPECS, LOAD_SCHEMES, world, rank)
        result = load(root, targets, coordinator=coord)
        out = {
            "rank": rank,
            "step": result.step,
            "saved_world": result.world_size,
            "bad": check_targets(SPECS, targets, result.step),
            "meta_ranks": [m["rank"] for m in result.metadata],
        }
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
