"""A rank that joins its round's world with ``join_world`` and then hangs before the engine is
built (it never enters DeepSpeed's ``new_group``), as a peer does that is stopped or loses its
link right after the join. Prints ``joined`` once the world formed, then sleeps until killed."""

from __future__ import annotations

import argparse
import time

from stalwart.trainer.reform import ReformSpec, join_world


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--round", type=int, required=True)
    args = ap.parse_args()
    spec = ReformSpec(rank=args.rank, world_size=args.world, master_addr="127.0.0.1", master_port=args.port,
                      round=args.round)
    join_world(spec, backend="gloo", collective_timeout_s=60.0, join_timeout_s=90.0)
    print("joined", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
