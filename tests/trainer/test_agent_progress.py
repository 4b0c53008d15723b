"""Progress reaches the local agent: a fake agent (the real gRPC Progress service on a unix socket)
receives each step with its loss and each committed checkpoint from examples/train_gpt.py."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from trainer_testlib import REPO, Direct, tail

from stalwart.proto import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.timeout(600)


class FakeAgent(agent_pb2_grpc.ProgressServicer):
    def __init__(self) -> None:
        self.messages: queue.Queue[agent_pb2.WorkerMessage] = queue.Queue()
        self.closed = threading.Event()

    def Connect(self, request_iterator: Iterator[agent_pb2.WorkerMessage],  # noqa: N802 - gRPC's name
                context: grpc.ServicerContext) -> Iterator[agent_pb2.AgentCommand]:
        for msg in request_iterator:
            self.messages.put(msg)
        self.closed.set()
        return iter(())


def test_steps_and_checkpoints_are_reported_to_the_agent(ds_env: dict[str, str], tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    agent = FakeAgent()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    agent_pb2_grpc.add_ProgressServicer_to_server(agent, server)
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    jobs = Direct({**ds_env, "STALWART_AGENT_SOCKET": str(sock)})
    try:
        log = tmp_path / "run.log"
        rc = jobs.run(1, str(REPO / "examples" / "train_gpt.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
                      "--steps", "6", "--save-every", "3", log=log)
        assert rc == 0, tail(log)
        assert agent.closed.wait(30)
    finally:
        jobs.close()
        server.stop(0)
    kinds: dict[str, list[agent_pb2.WorkerMessage]] = {}
    while not agent.messages.empty():
        msg = agent.messages.get()
        kinds.setdefault(msg.WhichOneof("kind"), []).append(msg)
    assert [m.step.step for m in kinds["step"]] == [1, 2, 3, 4, 5, 6]
    assert all(m.step.loss > 0 and m.step.step_time > 0 for m in kinds["step"])
    assert [(m.checkpoint.step, m.checkpoint.committed) for m in kinds["checkpoint"]] == [(3, True), (6, True)]
    assert kinds["goodbye"][0].goodbye.reason == "finished"
