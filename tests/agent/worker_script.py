"""A stand-in training process for agent tests: reports a step every STEP_TIME seconds.

Optional environment:
- ``FAULT_LOG``: a file the training-fault handler appends ``kind step factor`` lines to;
- ``BUSY=1``: each step busy-loops STEP_TIME seconds of CPU time (not wall time) instead of
  sleeping, so a throttled worker makes fewer steps;
- ``EXIT_AT_STEP``/``EXIT_CODE``: exit with that code after that many steps;
- ``BLOCK_AT_STEP``: after that many steps, block for good with the process running, as a rank
  waiting in a collective on a peer behind a cut link does.
"""

import os
import time

from stalwart.trainer.agent_client import AgentClient

step_time = float(os.environ.get("STEP_TIME", "0.1"))
busy = os.environ.get("BUSY") == "1"
exit_at = int(os.environ.get("EXIT_AT_STEP", "-1"))
block_at = int(os.environ.get("BLOCK_AT_STEP", "-1"))
client = AgentClient()
fault_log = os.environ.get("FAULT_LOG")
if fault_log:
    def handler(kind: str, step: int, factor: float) -> None:
        with open(fault_log, "a") as f:
            f.write(f"{os.environ.get('LOCAL_RANK')} {kind} {step} {factor}\n")

    client.set_fault_handler(handler)
step = 0
while True:
    start = time.monotonic()
    if busy:
        cpu = time.process_time()
        while time.process_time() - cpu < step_time:
            pass
    else:
        time.sleep(step_time)
    client.step(step, time.monotonic() - start)
    step += 1
    while step == block_at:
        time.sleep(3600)
    if step == exit_at:
        client.close("exiting")
        raise SystemExit(int(os.environ.get("EXIT_CODE", "0")))
