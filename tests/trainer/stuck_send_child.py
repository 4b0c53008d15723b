"""Two ranks of a real gloo world. Rank 1 receives rank 0's stream of large sends and stops itself
(SIGSTOP) once one has begun to arrive, so rank 0 is left in a send partly written to a peer that
no longer reads. Rank 0 runs the trainer's stuck-step watch as a Reform starts it (the real abort,
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

CHUNK = 128 * 1024 * 1024  # floats: 512 MB a send, far more than a socket's buffers hold
MARK = 1 << 20  # an element 4 MB into the receive buffer: the send has begun to arrive


def _stop_inside_a_send(store: dist.Store) -> None:
    """Rank 1: receive rank 0's sends until one is seen arriving (the buffer fills in order), then
    stop there, while most of that send is still to be written: rank 0 is left inside it."""
    buf = torch.zeros(CHUNK)
    for _ in range(100):
        buf.zero_()
        work = dist.irecv(buf, 0)
        while buf[MARK].item() == 0:
            pass
        if buf[-1].item() == 0:
            store.set("stopped", "1")
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)
        work.wait()  # this one arrived whole before the look: try the next


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
    store = dist.distributed_c10d._get_default_store()
    if args.rank == 1:
        _stop_inside_a_send(store)
    buf = torch.ones(CHUNK)
    t = watch_shell(1.5)

    def watch() -> None:
        store.wait(["stopped"])  # the Reform comes once the peer hangs, as an agent's would
        t._step_started = time.perf_counter()
        t._abort_if_stuck(0, _cut_old_world, 1)

    threading.Thread(target=watch, daemon=True).start()
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
