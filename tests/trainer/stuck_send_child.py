"""Two ranks of a real gloo world. Rank 1 receives rank 0's stream of large sends on a thread and
stops itself (SIGSTOP) part way, so rank 0 is left in a send partly written to a peer that no
longer reads. Rank 0 runs the trainer's stuck-step watch as a Reform starts it (the real abort,
gloo's cut of the world's connections, and the real exit) and prints how its send ended, if it
ends. gloo's collective timeout is set long (``--timeout``) so that waiting it out shows."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from stuck_watch import watch_shell

from stalwart.trainer.reform import store_ports
from stalwart.trainer.reforming import _cut_old_world
from stalwart.trainer.world_sockets import world_sockets

CHUNK = 64 * 1024 * 1024  # floats: 256 MB a send, far more than a socket's buffers hold


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    world_sockets.joining()
    dist.init_process_group("gloo", rank=args.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=args.timeout))
    dist.all_reduce(torch.ones(1))
    world_sockets.ready(store_ports())
    buf = torch.ones(CHUNK)
    if args.rank == 1:
        threading.Thread(target=lambda: [dist.recv(buf, 0) for _ in range(1000)], daemon=True).start()
        time.sleep(0.5)  # rank 0 streams meanwhile: the stop lands inside one of its sends
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    t = watch_shell(1.5)  # the Reform came at the start of this "step"
    threading.Thread(target=t._abort_if_stuck, args=(0, _cut_old_world, 1), daemon=True).start()
    try:
        for _ in range(1000):
            dist.send(buf, 1)
        print("send: returned", flush=True)
    except RuntimeError as exc:
        with t._reform_lock:  # the collective raised: this rank begins to leave, as train() does
            t._leaves += 1
        t._left_world.set()
        print(f"send: raised {exc}", flush=True)
    time.sleep(5)  # the watch would exit meanwhile if it took the rank for still stuck


if __name__ == "__main__":
    main()
