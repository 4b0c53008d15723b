"""Progress reports from a training process to its node's stalwart agent.

The agent passes the path of its unix socket in ``STALWART_AGENT_SOCKET``. Without it (plain
torchrun, a laptop) every call is a no-op, so training scripts need no special case. Reports are
queued and sent by a background thread: a slow or absent agent never blocks a training step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from stalwart.proto import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)
ENV_SOCKET = "STALWART_AGENT_SOCKET"
_END = object()


class AgentClient:
    def __init__(self, socket_path: str | None = None, *, rank: int | None = None, local_rank: int | None = None,
                 round_number: int | None = None) -> None:
        self.socket_path = socket_path if socket_path is not None else os.environ.get(ENV_SOCKET)
        self.enabled = bool(self.socket_path)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=10_000)
        self._thread: threading.Thread | None = None
        if not self.enabled:
            return
        hello = agent_pb2.Hello(
            rank=rank if rank is not None else int(os.environ.get("RANK", "0")),
            local_rank=local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0")),
            round=round_number if round_number is not None else int(os.environ.get("STALWART_ROUND", "0")),
            pid=os.getpid(),
        )
        self._queue.put(agent_pb2.WorkerMessage(hello=hello))
        self._thread = threading.Thread(target=self._run, daemon=True, name="stalwart-agent-client")
        self._thread.start()

    def _messages(self) -> Iterator[agent_pb2.WorkerMessage]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def _run(self) -> None:
        try:
            with grpc.insecure_channel(f"unix:{self.socket_path}") as channel:
                stub = agent_pb2_grpc.ProgressStub(channel)
                for _ in stub.Connect(self._messages(), wait_for_ready=True):
                    pass  # commands from the agent: handled once in-place re-form exists
        except grpc.RpcError as exc:
            log.warning("progress channel to the agent at %s closed: %s", self.socket_path, exc.code())

    def _put(self, msg: agent_pb2.WorkerMessage) -> None:
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(msg)
        except queue.Full:
            pass  # the agent is not reading: drop rather than stall training

    def step(self, step: int, step_time: float, loss: float = 0.0) -> None:
        self._put(agent_pb2.WorkerMessage(step=agent_pb2.StepReport(step=step, step_time=step_time, loss=loss,
                                                                    time=time.time())))

    def checkpoint(self, step: int, path: str, committed: bool, stall_seconds: float = 0.0) -> None:
        self._put(agent_pb2.WorkerMessage(checkpoint=agent_pb2.CheckpointReport(
            step=step, path=path, committed=committed, stall_seconds=stall_seconds)))

    def close(self, reason: str = "done") -> None:
        if not self.enabled:
            return
        self._put(agent_pb2.WorkerMessage(goodbye=agent_pb2.Goodbye(reason=reason)))
        self._queue.put(_END)
        if self._thread is not None:
            self._thread.join(timeout=5)
