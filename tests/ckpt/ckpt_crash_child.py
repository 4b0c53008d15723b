"""Fork server for the crash tests: imports torch once, then forks one saver per request.

Reads ``ROOT`` lines on stdin. For each it forks a child that resumes from the newest loadable
checkpoint under ROOT (checking it bitwise) and then saves step after step, as a world of two ranks
simulated by threads, appending each committed step to ROOT/committed.log. The test SIGKILLs the
child at a random moment; this server reports ``pid N`` when the child starts and ``exit S`` once
it is reaped.
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from ckpt_testlib import SPECS, Spec, ThreadGroup, check_targets, rank_state, rank_targets  # noqa: E402

from stalwart.ckpt import (  # noqa: E402
    Checkpointer,
    CheckpointNotFound,
    RetentionPolicy,
    SaveConfig,
    load,
)

CRASH_SPECS = [*SPECS, Spec("big", (256, 640), torch.float32), Spec("more_ids", (4096,), torch.int64)]
SCHEMES = {"big": "rows", "w32": "cols", "bf": "flat", "more_ids": "flat"}
WORLD = 2
CONFIG = SaveConfig(chunk_bytes=32 << 10, retention=RetentionPolicy(keep_last=2, keep_every=7, garbage_grace_s=0))


def run(root: str) -> None:
    torch.set_num_threads(1)
    try:
        targets = rank_targets(CRASH_SPECS, {}, 1, 0)
        step = load(root, targets).step
        if check_targets(CRASH_SPECS, targets, step):
            with open(os.path.join(root, "errors.log"), "a") as f:
                f.write(f"resume from step {step} is not what was saved\n")
            return
    except CheckpointNotFound:
        step = 0
    group = ThreadGroup(WORLD)
    ckpts = [Checkpointer(root, CONFIG, coordinator=group.coordinator(r)) for r in range(WORLD)]
    log_fd = os.open(os.path.join(root, "committed.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    while True:
        step += 1
        errors: list[Exception] = []

        def rank(r: int, step: int = step, errors: list[Exception] = errors) -> None:
            try:
                ckpts[r].save(step, rank_state(CRASH_SPECS, SCHEMES, step, WORLD, r), {"r": r}).result()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            with open(os.path.join(root, "errors.log"), "a") as f:
                f.write(f"save of step {step} failed: {errors}\n")
            return
        os.write(log_fd, f"{step}\n".encode())


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        root = line.strip()
        pid = os.fork()
        if pid == 0:
            try:
                run(root)
            finally:
                os._exit(0)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    main()
