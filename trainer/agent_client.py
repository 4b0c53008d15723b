"""Progress reports from a training process to its node's stalwart agent.

The agent passes the path of its unix socket in ``STALWART_AGENT_SOCKET``. Without it (plain
torchrun, a laptop) every call is a no-op, so training scripts need no special case. Reports are
queued and sent by a background thread: a slow or absent agent never blocks a training step.

The agent answers on the same stream with commands. A training-fault injection (the agent's
``FAULT_NAN_LOSS``/``FAULT_LOSS_SPIKE``) is passed to the handler set with
:meth:`AgentClient.set_fault_handler`; one that arrives before a handler is set is kept and passed
when it is set. With ``STALWART_COLLECTIVE_TIMER`` unset or ``1``, the client installs the
collective timer (:mod:`stalwart.trainer.collective_timer`) so each step report carries its busy
time (wall time minus time blocked in ``torch.distributed`` collectives).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from stalwart.proto import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)
ENV_SOCKET = "STALWART_AGENT_SOCKET"
ENV_COLLECTIVE_TIMER = "STALWART_COLLECTIVE_TIMER"
_END = object()

FaultHandler = Callable[[str, int, float], None]
"""``handler(kind, step, factor)``: kind is ``"nan"`` or ``"spike"``; called from the client's
receiving thread, so it should only record the fault for the training loop to apply."""


class AgentClient:
    def __init__(self, socket_path: str | None = None, *, rank: int | None = None, local_rank: int | None = None,
                 round_number: int | None = None) -> None:
        self.socket_path = socket_path if socket_path is not None else os.environ.get(ENV_SOCKET)
        self.enabled = bool(self.socket_path)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=10_000)
        self._thread: threading.Thread | None = None
        self._fault_lock = threading.Lock()
        self._fault_handler: FaultHandler | None = None
        self._pending_faults: list[tuple[str, int, float]] = []
        self._timer = None
        if not self.enabled:
            return
        if os.environ.get(ENV_COLLECTIVE_TIMER, "1") != "0":
            from stalwart.trainer import collective_timer

            self._timer = collective_timer.install()
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
                for command in stub.Connect(self._messages(), wait_for_ready=True):
                    self._command(command)
        except grpc.RpcError as exc:
            log.warning("progress channel to the agent at %s closed: %s", self.socket_path, exc.code())

    def _command(self, command: agent_pb2.AgentCommand) -> None:
        which = command.WhichOneof("kind")
        if which != "inject_fault":
            return  # reform/stop: handled once in-place re-form exists
        fault = (command.inject_fault.kind, int(command.inject_fault.step), float(command.inject_fault.factor))
        log.warning("agent injects a training fault: %s at step %d (factor %g)", *fault)
        with self._fault_lock:
            handler = self._fault_handler
            if handler is None:
                self._pending_faults.append(fault)
                return
        self._call(handler, fault)

    @staticmethod
    def _call(handler: FaultHandler, fault: tuple[str, int, float]) -> None:
        try:
            handler(*fault)
        except Exception:  # a broken handler must not end the progress stream
            log.exception("training-fault handler failed on %s", fault)

    def set_fault_handler(self, fn: FaultHandler) -> None:
        """Receive the agent's training-fault injections (``kind``, ``step``, ``factor``)."""
        with self._fault_lock:
            self._fault_handler = fn
            pending, self._pending_faults = self._pending_faults, []
        for fault in pending:
            self._call(fn, fault)

    def _put(self, msg: agent_pb2.WorkerMessage) -> None:
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(msg)
        except queue.Full:
            pass  # the agent is not reading: drop rather than stall training

    def step(self, step: int, step_time: float, loss: float = 0.0) -> None:
        """Report a finished step. Its busy time is ``step_time`` less the seconds spent blocked in
        collectives since the previous report (0 = unknown when the timer is not installed)."""
        if not self.enabled:
            return
        busy = 0.0
        if self._timer is not None:
            busy = max(step_time - self._timer.take(), 1e-9)
        self._put(agent_pb2.WorkerMessage(step=agent_pb2.StepReport(step=step, step_time=step_time, loss=loss,
                                                                    time=time.time(), busy_time=busy)))

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
