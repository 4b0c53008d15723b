"""A stand-in training process that re-forms in place, for agent tests (no torch).

It reports a step every STEP_TIME seconds. When the agent sends a Reform it appends a ``reform``
line to EVENTS and acknowledges with ``AgentClient.reformed`` — unless its starting rank is
IGNORE_REFORM_RANK, then it keeps stepping in its old world and never acknowledges, or
JOIN_FOREVER=1, then it says it left its old world and waits for its new peers for good (one
behind a cut link). Started as a
warm spare (``STALWART_SPARE=1``) it appends ``spare`` when connected, warms up for WARM_DELAY
seconds, blocks in ``wait_for_assignment`` (which tells the agent it is warm), appends
``assigned`` and joins (after ASSIGN_DELAY seconds). NO_REFORM=1: it never
sets a re-form handler (a worker that cannot re-form). EVENTS lines: ``kind pid rank world_size round
local_rank unix_time``.
"""

import os
import queue
import time

from stalwart.trainer.agent_client import AgentClient
from stalwart.trainer.reform import ReformSpec, is_spare

events = os.environ["EVENTS"]
step_time = float(os.environ.get("STEP_TIME", "0.05"))


def event(kind: str, rank: int, world_size: int, round_number: int, local_rank: int) -> None:
    line = f"{kind} {os.getpid()} {rank} {world_size} {round_number} {local_rank} {time.time():.6f}\n"
    fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


client = AgentClient()
reforms: queue.SimpleQueue[ReformSpec] = queue.SimpleQueue()


def on_reform(spec: ReformSpec) -> None:
    event("reform", spec.rank, spec.world_size, spec.round, spec.local_rank)  # the moment it arrived
    reforms.put(spec)


ignore = False
if is_spare():
    event("spare", -1, 0, 0, -1)
    time.sleep(float(os.environ.get("WARM_DELAY", "0")))  # building its model and engine
    spec = client.wait_for_assignment()
    event("assigned", spec.rank, spec.world_size, spec.round, spec.local_rank)
    time.sleep(float(os.environ.get("ASSIGN_DELAY", "0")))  # joining its first world takes a while
    client.set_reform_handler(on_reform)
    client.reformed(spec.round, spec.rank, spec.local_rank)
else:
    ignore = os.environ.get("IGNORE_REFORM_RANK") == os.environ.get("RANK")
    if os.environ.get("NO_REFORM") != "1":
        client.set_reform_handler(on_reform)
    event("start", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["STALWART_ROUND"]),
          int(os.environ["LOCAL_RANK"]))
step = 0
while True:
    start = time.monotonic()
    time.sleep(step_time)
    try:
        spec = reforms.get_nowait()
    except queue.Empty:
        pass
    else:
        if os.environ.get("JOIN_FOREVER") == "1":
            client.joining(spec.round, 1, spec.world_size)
            while True:
                time.sleep(1)
        if not ignore:
            client.reformed(spec.round, spec.rank, spec.local_rank)
    client.step(step, time.monotonic() - start)
    step += 1
