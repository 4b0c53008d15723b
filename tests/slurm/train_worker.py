"""The smallest training job for the Slurm test: gloo all-reduce steps up to LAST, a committed
checkpoint every CKPT_EVERY steps and at LAST (the job's end marker), then it closes the agent
client (its last report delivered) and exits 0. Each worker writes its pid to PIDS/<node>.pid
(Slurm's node name, inherited from the agent) so the test can kill one. A restarted round
continues from STALWART_RESTORE_STEP."""

import os
import time

import torch
import torch.distributed as dist

from stalwart.trainer.agent_client import AgentClient

work = float(os.environ.get("WORK", "0.05"))
last = int(os.environ["LAST"])
ckpt_every = int(os.environ.get("CKPT_EVERY", "5"))
pids = os.environ["PIDS"]
with open(os.path.join(pids, f"{os.environ['SLURMD_NODENAME']}.pid"), "w") as f:
    f.write(str(os.getpid()))
client = AgentClient()
dist.init_process_group("gloo")
rank = dist.get_rank()
step = int(os.environ.get("STALWART_RESTORE_STEP", "0") or 0)
grad = torch.ones(256)
while step < last:
    start = time.monotonic()
    time.sleep(work)
    dist.all_reduce(grad)
    grad.fill_(1.0)
    step += 1
    client.step(step, time.monotonic() - start)
    if rank == 0 and (step % ckpt_every == 0 or step == last):
        client.checkpoint(step, f"/tmp/fake-ckpt/{step}", committed=True)
dist.barrier()

client.close("finished")  # the last checkpoint report reaches the agent before the process ends
