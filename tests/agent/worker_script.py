"""A stand-in training process for agent tests: reports a step every STEP_TIME seconds."""

import os
import time

from stalwart.trainer.agent_client import AgentClient

step_time = float(os.environ.get("STEP_TIME", "0.1"))
client = AgentClient()
step = 0
while True:
    time.sleep(step_time)
    client.step(step, step_time)
    step += 1
