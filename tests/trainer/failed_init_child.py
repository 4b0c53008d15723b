"""One rank of a two-rank world joined with ``join_world``; with ``--fail-first`` the process
first has an ``init_process_group`` fail (its peer never comes), as a broken or superseded join
does. Prints ``joined`` and the world size once the world formed."""

from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist

from stalwart.trainer.reform import ReformSpec, join_world, leave_world


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fail-first", action="store_true")
    args = ap.parse_args()
    if args.fail_first:
        store = dist.HashStore()
        try:
            dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=1))
        except Exception as exc:  # noqa: BLE001 - the failure is the point
            print(f"first init failed: {type(exc).__name__}", flush=True)
        else:
            raise SystemExit("the first init_process_group should have failed")
    spec = ReformSpec(rank=args.rank, world_size=2, master_addr="127.0.0.1", master_port=args.port, round=2)
    join_world(spec, backend="gloo", collective_timeout_s=20.0, join_timeout_s=60.0)
    print(f"joined {dist.get_world_size()}", flush=True)
    leave_world()


if __name__ == "__main__":
    main()
