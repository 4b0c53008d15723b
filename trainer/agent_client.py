"""Progress reports from a training process to its node's stalwart agent.

The agent passes the path of its unix socket in ``STALWART_AGENT_SOCKET``. Without it (plain
torchrun, a laptop) every call is a no-op, so training scripts need no special case. Reports are
queued and sent by a background thread: a slow or absent agent never blocks a training step.

The agent answers on the same stream with commands. A training-fault injection (the agent's
``FAULT_NAN_LOSS``/``FAULT_LOSS_SPIKE``) is passed to the handler set with
:meth:`AgentClient.set_fault_handler`; one that arrives before a handler is set is kept and passed
when it is set.

In-place re-form: a worker that calls :meth:`AgentClient.set_reform_handler` tells the agent it can
re-form (its Hello says ``can_reform``), so at the next round the agent keeps it and sends it a
``Reform`` (its new rank, world size and round) instead of restarting it. The handler gets a
:class:`~stalwart.trainer.reform.ReformSpec`; once the trainer has re-formed it calls
:meth:`AgentClient.reformed`, which says Hello again with the new round and rank — the agent's
acknowledgement (without it the agent SIGKILLs the worker after its ``reform_timeout``). A warm
spare (``STALWART_SPARE=1``) says Hello as a spare and blocks in
:meth:`AgentClient.wait_for_assignment` until the agent gives it a rank.

With ``STALWART_COLLECTIVE_TIMER`` unset or ``1``, the client installs the
collective timer (:mod:`stalwart.trainer.collective_timer`) so each step report carries its busy
time (wall time minus time blocked in ``torch.distributed`` collectives).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from stalwart.proto import agent_pb2, agent_pb2_grpc
from stalwart.proto.contract import (
    DEFAULT_ORPHAN_TIMEOUT,
    ENV_COLLECTIVE_TIMER,
    ENV_ORPHAN_TIMEOUT,
    ENV_ROUND,
    ENV_SOCKET,
    socket_target,
)
from stalwart.trainer.reform import ReformSpec, is_spare

log = logging.getLogger(__name__)

RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
"""The progress channel retries its unix socket at most every 0.5 s: gRPC's default backoff
grows to seconds while an agent restarts, and a worker that reconnects late to the successor
looks lost to it (a round that comes meanwhile stops it). A local socket is cheap to retry."""
_END = object()

FaultHandler = Callable[[str, int, float], None]
"""``handler(kind, step, factor)``: kind is ``"nan"`` or ``"spike"``; called from the client's
receiving thread, so it should only record the fault for the training loop to apply."""

ReformHandler = Callable[[ReformSpec], None]
"""``handler(spec)``: called from the client's receiving thread when the agent sends a new world;
it should hand the spec to the training loop (or abort a collective stuck on a lost peer)."""


def _outlive_agent() -> None:
    """Clear the parent-death signal a warm spare was started with (it held no rank, so it died
    with its agent); once it holds a rank, its agent's successor adopts it instead."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 0)  # PR_SET_PDEATHSIG, 0
    except (OSError, AttributeError):  # not Linux: there was no such signal either
        pass


def _stop_orphan(gone_for: float) -> None:
    """An orphaned worker stops as if told to (SIGTERM: the trainer ends its step and exits); if
    it is still alive a minute later it exits at once."""
    os.kill(os.getpid(), signal.SIGTERM)
    timer = threading.Timer(60.0, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


class AgentClient:
    def __init__(self, socket_path: str | None = None, *, rank: int | None = None, local_rank: int | None = None,
                 round_number: int | None = None, spare: bool | None = None) -> None:
        self.socket_path = socket_path if socket_path is not None else os.environ.get(ENV_SOCKET)
        self.enabled = bool(self.socket_path)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=10_000)
        self._thread: threading.Thread | None = None
        self._fault_lock = threading.Lock()
        self._fault_handler: FaultHandler | None = None
        self._pending_faults: list[tuple[str, int, float]] = []
        self._reform_handler: ReformHandler | None = None
        self._pending_reforms: list[ReformSpec] = []
        self._last_local_rank: int | None = None  # of the newest Reform: a spare learns its device from it
        self._assignments: queue.Queue[ReformSpec] = queue.Queue()
        self._assigned = False  # a spare's first assignment was handed out
        self._said_warm = False  # a spare said it is warm (it waits for its assignment)
        self.spare = is_spare() if spare is None else spare
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.local_rank = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
        self.round = round_number if round_number is not None else int(os.environ.get(ENV_ROUND, "0"))
        self._timer = None
        self._generation = 0  # of the current connection: a stream of an older one stops reading
        self._closing = False
        self.orphan_timeout = float(os.environ.get(ENV_ORPHAN_TIMEOUT, str(DEFAULT_ORPHAN_TIMEOUT)))
        self.on_orphaned: Callable[[float], None] = _stop_orphan
        if not self.enabled:
            return
        # The agent sends SIGUSR2 before it kills a worker that did not begin its re-form in time:
        # every thread's stack goes to this worker's log, to show where it was stuck.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        if os.environ.get(ENV_COLLECTIVE_TIMER, "1") != "0":
            from stalwart.trainer import collective_timer

            self._timer = collective_timer.install()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stalwart-agent-client")
        self._thread.start()

    def _hello(self) -> agent_pb2.Hello:
        if self.spare:  # warm already when it reconnects to a restarted agent
            return agent_pb2.Hello(pid=os.getpid(), spare=True, can_reform=True, warm=self._said_warm)
        return agent_pb2.Hello(rank=self.rank, local_rank=self.local_rank, round=self.round, pid=os.getpid(),
                               can_reform=self._reform_handler is not None)

    def _messages(self, generation: int) -> Iterator[agent_pb2.WorkerMessage]:
        yield agent_pb2.WorkerMessage(hello=self._hello())  # every connection starts with who we are
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if generation != self._generation:
                    return
                continue
            if generation != self._generation:
                self._queue.put(item)  # a newer connection sends it
                return
            if item is _END:
                return
            yield item  # type: ignore[misc]

    def _run(self) -> None:
        """Keep the progress channel up. The agent is not part of the computation: when it crashes
        or restarts, this worker trains on, and the channel connects again to its successor (which
        adopts this worker) with a fresh Hello. An agent gone for ``orphan_timeout`` seconds is not
        coming back: ``on_orphaned`` (default: SIGTERM to this process) ends the worker, whose
        round is stale by then."""
        gone_since, connected_once = time.monotonic(), False
        while not self._closing:
            self._generation += 1
            generation = self._generation
            with grpc.insecure_channel(socket_target(self.socket_path), options=RECONNECT_OPTIONS) as channel:
                budget = self.orphan_timeout - (time.monotonic() - gone_since)
                try:
                    grpc.channel_ready_future(channel).result(timeout=max(budget, 0.1))
                except grpc.FutureTimeoutError:
                    log.error("the agent at %s has been gone for %.0f s; this worker is orphaned",
                              self.socket_path, time.monotonic() - gone_since)
                    self.on_orphaned(time.monotonic() - gone_since)
                    return
                if connected_once:
                    log.warning("progress channel to the agent at %s is back after %.1f s", self.socket_path,
                                time.monotonic() - gone_since)
                connected_once = True
                try:
                    stub = agent_pb2_grpc.ProgressStub(channel)
                    for command in stub.Connect(self._messages(generation), wait_for_ready=True):
                        self._command(command)
                    if self._closing:
                        return
                except grpc.RpcError as exc:
                    if self._closing:
                        return
                    log.warning("progress channel to the agent at %s closed (%s); reconnecting", self.socket_path,
                                exc.code())
            gone_since = time.monotonic()
            time.sleep(0.2)

    def _command(self, command: agent_pb2.AgentCommand) -> None:
        which = command.WhichOneof("kind")
        if which == "reform":
            self._reform(command.reform)
            return
        if which != "inject_fault":
            return  # stop: the agent stops a worker with signals
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

    def _reform(self, reform: agent_pb2.Reform) -> None:
        try:
            spec = ReformSpec.from_proto(reform, local_rank=int(reform.local_rank))
        except ValueError as exc:
            log.error("agent sent an invalid re-form (%s); ignored", exc)
            return
        log.info("agent re-forms this worker: rank %d of %d, local rank %d, round %d", spec.rank, spec.world_size,
                 spec.local_rank, spec.round, extra={"rank": spec.rank, "round": spec.round})
        with self._fault_lock:
            self._last_local_rank = spec.local_rank
            if self.spare and not self._assigned:
                self._assignments.put(spec)
                return
            handler = self._reform_handler
            if handler is None:
                self._pending_reforms.append(spec)
                return
        self._call_reform(handler, spec)

    @staticmethod
    def _call_reform(handler: ReformHandler, spec: ReformSpec) -> None:
        try:
            handler(spec)
        except Exception:  # a broken handler must not end the progress stream
            log.exception("re-form handler failed on %s", spec)

    def set_reform_handler(self, fn: ReformHandler) -> None:
        """Receive the agent's re-form commands; tells the agent this worker can re-form in place
        (a Hello with ``can_reform``), so the agent keeps it across rounds instead of restarting it."""
        with self._fault_lock:
            self._reform_handler = fn
            pending, self._pending_reforms = self._pending_reforms, []
        if self.enabled and not self.spare:
            self._put(agent_pb2.WorkerMessage(hello=self._hello()))
        for spec in pending:
            self._call_reform(fn, spec)

    def wait_for_assignment(self, timeout: float | None = None) -> ReformSpec:
        """A warm spare's wait for its place in a round (the agent's Reform). Returns the spec;
        the caller joins that world, then calls :meth:`reformed`. Raises ``TimeoutError`` after
        ``timeout`` seconds, ``RuntimeError`` when this process is not a spare of an agent."""
        if not (self.enabled and self.spare):
            raise RuntimeError("wait_for_assignment: not a spare of a stalwart agent (STALWART_SPARE=1 and "
                               f"{ENV_SOCKET} are set by the agent)")
        if not self._said_warm:
            self._said_warm = True  # the agent admits this node to a round only once its spares are warm
            self._put(agent_pb2.WorkerMessage(hello=agent_pb2.Hello(pid=os.getpid(), spare=True, can_reform=True,
                                                                    warm=True)))
        try:
            spec = self._assignments.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no assignment from the agent within {timeout:g} s") from None
        with self._fault_lock:
            # A newer round may come before this spare joins its first one: that Reform goes to
            # the re-form handler (kept until one is set), like any worker's.
            self._assigned = True
            later = []
            while not self._assignments.empty():
                later.append(self._assignments.get_nowait())
            handler = self._reform_handler
            if handler is None:
                self._pending_reforms.extend(later)
        _outlive_agent()  # a rank now: like any worker it must survive its agent's restart
        if handler is not None:
            for newer in later:
                self._call_reform(handler, newer)
        return spec

    def joining(self, round_number: int, arrived: int = 0, world_size: int = 0) -> None:
        """Tell the agent this worker left its old world and waits for the peers of
        ``round_number`` (so it is not taken for one that ignores its Reform)."""
        if self.enabled:
            self._put(agent_pb2.WorkerMessage(joining=agent_pb2.Joining(round=round_number, arrived=arrived,
                                                                        world_size=world_size)))

    def peer_lost(self, round_number: int, hosts: list[str], detail: str) -> None:
        """Tell the agent a collective of ``round_number`` broke on peers at ``hosts`` (it checks
        whether their agents still answer and reports the nodes that are gone to the daemon)."""
        if self.enabled and hosts:
            self._put(agent_pb2.WorkerMessage(peer_lost=agent_pb2.PeerLost(round=round_number, hosts=hosts,
                                                                          detail=detail[:500])))

    def has_newer_reform(self, round_number: int) -> bool:
        """Whether a Reform for a round after ``round_number`` waits for a handler (a spare that
        is still joining its first world learns so that round was superseded)."""
        with self._fault_lock:
            return any(spec.round > round_number for spec in self._pending_reforms)

    def take_newer_reform(self, round_number: int) -> ReformSpec | None:
        """The newest waiting Reform after ``round_number`` (the older ones are dropped)."""
        with self._fault_lock:
            newer = [spec for spec in self._pending_reforms if spec.round > round_number]
            self._pending_reforms = [spec for spec in self._pending_reforms if spec.round <= round_number]
        return max(newer, key=lambda spec: spec.round) if newer else None

    def reformed(self, round_number: int, rank: int, local_rank: int | None = None) -> None:
        """Tell the agent this worker now runs as ``rank`` in ``round_number`` (after a re-form or,
        for a spare, after joining its first world). The agent kills a worker that does not."""
        with self._fault_lock:
            self.spare = False
            self.rank, self.round = rank, round_number
            if local_rank is not None:
                self.local_rank = local_rank
            elif self._last_local_rank is not None:
                self.local_rank = self._last_local_rank
        if self.enabled:
            self._put(agent_pb2.WorkerMessage(hello=self._hello()))

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
        self._closing = True
        if self._thread is not None:
            self._thread.join(timeout=5)
