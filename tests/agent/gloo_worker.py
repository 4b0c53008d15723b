"""A small data-parallel job on gloo for agent/daemon tests, reporting like the trainer does.

Each step busy-loops WORK seconds of CPU time ("compute"), then all-reduces a tensor (the gradient
sync); AgentClient reports the step (its collective timer gives the busy time). Rank 0 reports a
committed checkpoint every CKPT_EVERY steps. A restarted round continues from
STALWART_RESTORE_STEP.
"""

import os
import time

import torch
import torch.distributed as dist

from stalwart.trainer.agent_client import AgentClient

work = float(os.environ.get("WORK", "0.03"))
ckpt_every = int(os.environ.get("CKPT_EVERY", "10"))
client = AgentClient()  # installs the collective timer before the first collective
dist.init_process_group("gloo")
rank = dist.get_rank()
step = int(os.environ.get("STALWART_RESTORE_STEP", "0"))
grad = torch.ones(1024)
while True:
    start = time.monotonic()
    cpu = time.process_time()
    while time.process_time() - cpu < work:
        pass
    dist.all_reduce(grad)
    grad.fill_(1.0)
    step += 1
    client.step(step, time.monotonic() - start)
    if rank == 0 and step % ckpt_every == 0:
        client.checkpoint(step, f"/tmp/fake-ckpt/{step}", committed=True)
