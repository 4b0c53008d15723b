"""The agent's gRPC edge: the node service over TCP (TLS) and the progress channel over a unix socket.

Servicers only translate messages and delegate to the :class:`AgentCore` protocol, which the
node agent implements; no other module of the agent imports generated code.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from stalwart.agent.config import AgentConfig, AgentConfigError, tls_credentials
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from stalwart.proto.contract import SOCKET_DIR_MODE, SOCKET_MODE, socket_target

log = logging.getLogger(__name__)


class FaultRefused(Exception):
    """Fault injection is disabled in this agent's configuration, or the fault is not possible."""


class BindError(OSError):
    """An address the agent must listen on cannot be bound (in use, not local, no permission)."""


@dataclass(frozen=True)
class StepEvent:
    rank: int
    step: int
    step_time: float
    loss: float
    at: float
    busy_time: float = 0.0
    round: int = 0  # the round the worker's stream last said Hello for (0: unknown)
    pid: int = 0


@dataclass(frozen=True)
class HelloEvent:
    """A worker's Hello: the first message of its stream, or a later one after a re-form."""

    rank: int
    local_rank: int
    round: int
    pid: int
    spare: bool = False
    can_reform: bool = False
    warm: bool = False  # a spare that finished warming up


class AgentCore(Protocol):
    def status(self) -> agent_pb2.NodeStatus: ...

    def drain(self, wait: bool, timeout: float) -> tuple[bool, str]: ...

    def inject_fault(self, kind: str, device: int, code: int, step: int = 0, factor: float = 0.0) -> str:
        """Apply a fault; raises :class:`FaultRefused`."""
        ...

    def worker_hello(self, hello: HelloEvent) -> None: ...

    def stale_worker(self, hello: HelloEvent) -> str | None: ...

    def fence_stale(self, pid: int, why: str) -> None: ...

    def worker_step(self, event: StepEvent) -> None: ...

    def worker_peer_lost(self, rank: int, round: int, hosts: list[str], detail: str) -> None: ...

    def worker_joining(self, pid: int, round: int, arrived: int, world_size: int) -> None: ...

    def worker_checkpoint(self, rank: int, step: int, path: str, committed: bool) -> None: ...

    def worker_goodbye(self, pid: int, reason: str) -> None: ...

    def round_number(self) -> int: ...

    def node_id(self) -> str: ...

    def dropping_peers(self) -> bool: ...


_FAULTS = {
    agent_pb2.FAULT_GPU_XID: "gpu-xid",
    agent_pb2.FAULT_GPU_ECC_DBE: "gpu-ecc-dbe",
    agent_pb2.FAULT_GPU_LOST: "gpu-lost",
    agent_pb2.FAULT_KILL_WORKER: "kill-worker",
    agent_pb2.FAULT_HANG_WORKER: "hang-worker",
    agent_pb2.FAULT_CLEAR: "clear",
    agent_pb2.FAULT_DROP_PEERS: "drop-peers",
    agent_pb2.FAULT_NAN_LOSS: "nan-loss",
    agent_pb2.FAULT_LOSS_SPIKE: "loss-spike",
    agent_pb2.FAULT_SLOW_WORKER: "slow-worker",
    agent_pb2.FAULT_GPU_HANG: "gpu-hang",
}


class AgentServicer(agent_pb2_grpc.AgentServicer):
    def __init__(self, core: AgentCore) -> None:
        self._core = core

    def GetStatus(self, request: agent_pb2.StatusRequest, context: grpc.ServicerContext) -> agent_pb2.NodeStatus:
        return self._core.status()

    def Drain(self, request: agent_pb2.DrainRequest, context: grpc.ServicerContext) -> agent_pb2.DrainReply:
        drained, detail = self._core.drain(request.wait, request.timeout or 60.0)
        return agent_pb2.DrainReply(drained=drained, detail=detail)

    def InjectFault(self, request: agent_pb2.FaultRequest, context: grpc.ServicerContext) -> agent_pb2.FaultReply:
        kind = _FAULTS.get(request.kind)
        if kind is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fault kind {request.kind}")
        try:
            detail = self._core.inject_fault(kind, request.device, request.code,  # type: ignore[arg-type]
                                             request.step, request.factor)
        except FaultRefused as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return agent_pb2.FaultReply(applied=True, detail=detail)

    def Ping(self, request: agent_pb2.PingRequest, context: grpc.ServicerContext) -> agent_pb2.PingReply:
        if self._core.dropping_peers():
            context.abort(grpc.StatusCode.UNAVAILABLE, "peer traffic dropped (fault injection)")
        return agent_pb2.PingReply(node_id=self._core.node_id(), round=self._core.round_number())


_CLOSED = object()


class WorkerChannels:
    """The connected workers' outgoing command queues, by local rank, and the warm spares', by pid.

    A worker's newest stream replaces an older one of the same local rank (a restarted worker);
    a stream that ends removes only its own queue. A spare's stream moves to its local rank when
    it says Hello as a worker (:meth:`rebind`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, tuple[int, queue.Queue[object]]] = {}
        self._spares: dict[int, queue.Queue[object]] = {}

    def open(self, local_rank: int, pid: int) -> queue.Queue[object]:
        q: queue.Queue[object] = queue.Queue()
        self._bind(q, local_rank, pid)
        return q

    def open_spare(self, pid: int) -> queue.Queue[object]:
        q: queue.Queue[object] = queue.Queue()
        with self._lock:
            old = self._spares.get(pid)
            self._spares[pid] = q
        if old is not None:
            old.put(_CLOSED)
        return q

    def rebind(self, q: queue.Queue[object], local_rank: int, pid: int) -> None:
        """The stream of ``q`` now belongs to the worker of ``local_rank`` (a spare that took a
        place, or a kept worker whose local rank is the same as before)."""
        self._bind(q, local_rank, pid)

    def _bind(self, q: queue.Queue[object], local_rank: int, pid: int) -> None:
        with self._lock:
            self._unlink(q)
            old = self._queues.get(local_rank)
            self._queues[local_rank] = (pid, q)
        if old is not None and old[1] is not q:
            old[1].put(_CLOSED)

    def _unlink(self, q: queue.Queue[object]) -> None:
        for rank, (_, other) in list(self._queues.items()):
            if other is q:
                del self._queues[rank]
        for pid, other in list(self._spares.items()):
            if other is q:
                del self._spares[pid]

    def close(self, q: queue.Queue[object]) -> None:
        with self._lock:
            self._unlink(q)
        q.put(_CLOSED)

    def send(self, local_rank: int, command: agent_pb2.AgentCommand, pid: int | None = None) -> bool:
        """Queue a command for the worker of ``local_rank`` (and ``pid``, when given); False if
        no such worker is connected."""
        with self._lock:
            entry = self._queues.get(local_rank)
        if entry is None or (pid is not None and entry[0] != pid):
            return False
        entry[1].put(command)
        return True

    def send_pid(self, pid: int, command: agent_pb2.AgentCommand) -> bool:
        """Queue a command for the process ``pid``, worker or spare; False if it is not connected."""
        with self._lock:
            q = self._spares.get(pid) or next((q for p, q in self._queues.values() if p == pid), None)
        if q is None:
            return False
        q.put(command)
        return True

    def connected(self) -> dict[int, int]:
        with self._lock:
            return {rank: pid for rank, (pid, _) in self._queues.items()}

    def spares(self) -> set[int]:
        """Pids of the connected spares."""
        with self._lock:
            return set(self._spares)


@dataclass
class _Stream:
    """What a stream's worker last said it is (a later Hello changes it)."""

    rank: int
    local_rank: int
    round: int
    pid: int
    spare: bool


class ProgressServicer(agent_pb2_grpc.ProgressServicer):
    """One stream per worker: reports are read on a thread of their own while the handler's
    thread sends the commands queued in :class:`WorkerChannels` for that worker."""

    def __init__(self, core: AgentCore, channels: WorkerChannels | None = None) -> None:
        self._core = core
        self.channels = channels or WorkerChannels()

    def Connect(self, request_iterator: Iterator[agent_pb2.WorkerMessage],
                context: grpc.ServicerContext) -> Iterator[agent_pb2.AgentCommand]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "hello":
            return  # a stream must start with Hello
        hello = first.hello
        stale = self._core.stale_worker(_hello_event(hello))
        if stale is not None:  # the place it asks for is another process's now
            self._core.fence_stale(hello.pid, stale)
            return
        stream = _Stream(hello.rank, hello.local_rank, hello.round, hello.pid, hello.spare)
        if hello.spare:
            outbox = self.channels.open_spare(hello.pid)
        else:
            outbox = self.channels.open(hello.local_rank, hello.pid)
        self._core.worker_hello(_hello_event(hello))
        reader = threading.Thread(target=self._read, args=(request_iterator, stream, outbox),
                                  daemon=True, name=f"progress-pid-{hello.pid}")
        reader.start()
        context.add_callback(lambda: self.channels.close(outbox))
        while True:
            item = outbox.get()
            if item is _CLOSED:
                return
            yield item  # type: ignore[misc]

    def _read(self, request_iterator: Iterator[agent_pb2.WorkerMessage], stream: _Stream,
              outbox: queue.Queue[object]) -> None:
        try:
            for msg in request_iterator:
                which = msg.WhichOneof("kind")
                if stream.spare and which in ("step", "checkpoint"):
                    continue  # a spare holds no rank: what it reports belongs to no one
                if which == "step":
                    s = msg.step
                    self._core.worker_step(StepEvent(stream.rank, s.step, s.step_time, s.loss, s.time, s.busy_time,
                                                     stream.round, stream.pid))
                elif which == "checkpoint":
                    c = msg.checkpoint
                    self._core.worker_checkpoint(stream.rank, c.step, c.path, c.committed)
                elif which == "hello":  # re-formed (or a spare that took a place), or newly able to re-form
                    h = msg.hello
                    stream.rank, stream.local_rank, stream.round, stream.spare = h.rank, h.local_rank, h.round, h.spare
                    if not h.spare:
                        self.channels.rebind(outbox, h.local_rank, stream.pid)
                    self._core.worker_hello(_hello_event(h, stream.pid))
                elif which == "joining":
                    self._core.worker_joining(stream.pid, int(msg.joining.round), int(msg.joining.arrived),
                                              int(msg.joining.world_size))
                elif which == "peer_lost":
                    lost = msg.peer_lost
                    self._core.worker_peer_lost(stream.rank, int(lost.round), list(lost.hosts), lost.detail)
                elif which == "goodbye":
                    self._core.worker_goodbye(stream.pid, msg.goodbye.reason)
                    break
        except grpc.RpcError:
            pass  # the worker went away; its exit is reported by the worker group
        except Exception:
            log.exception("progress stream of rank %d failed", stream.rank, extra={"rank": stream.rank})
        finally:
            self.channels.close(outbox)


def _hello_event(h: agent_pb2.Hello, pid: int | None = None) -> HelloEvent:
    return HelloEvent(rank=h.rank, local_rank=h.local_rank, round=h.round, pid=pid or h.pid, spare=h.spare,
                      can_reform=h.can_reform, warm=h.warm)


def start_node_server(config: AgentConfig, core: AgentCore, extra: list[object] | None = None) -> tuple[grpc.Server,
                                                                                                        int]:
    """The agent's TCP service; returns the server and its bound port.

    TLS unless ``config.insecure``; mutual TLS (clients must present a certificate signed by
    ``tls.ca_file``) unless ``tls.client_auth = false``. ``extra`` servicer-adders run on the same
    server. Raises :class:`AgentConfigError` for an unusable TLS file and :class:`BindError` when
    the address cannot be bound — also when another process serves it: ``SO_REUSEPORT``, which
    gRPC sets by default, would let two agents share a port silently.
    """
    check_bindable(config.listen)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="agent-grpc"),
                         options=[("grpc.so_reuseport", 0)])
    agent_pb2_grpc.add_AgentServicer_to_server(AgentServicer(core), server)
    for add in extra or []:
        add(server)  # type: ignore[operator]
    try:
        if config.insecure:
            port = server.add_insecure_port(config.listen)
        else:
            tls = tls_credentials(config.tls)
            creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                                require_client_auth=config.tls.client_auth)
            port = server.add_secure_port(config.listen, creds)
    except RuntimeError:  # gRPC's "Failed to bind to address"
        port = 0
    if port == 0:
        raise BindError(f"listen: cannot bind {config.listen} (in use, or not an address of this host)")
    server.start()
    return server, port


def check_bindable(listen: str) -> None:
    """Bind ``HOST:PORT`` once with a plain socket, so that an address in use is reported with its
    reason, as one line, before gRPC tries (its core would log its own error first)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return  # any free port: nothing to check
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"listen: cannot bind {listen}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As gRPC binds: SO_REUSEADDR, so connections of a previous run in TIME_WAIT do not count
        # (Linux still refuses a port with a listener); no SO_REUSEPORT, which would share it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise BindError(f"listen: cannot bind {listen}: {exc.strerror or exc}") from None


def private_socket_dir(directory: Path) -> None:
    """Make sure ``directory`` exists and no other user can enter it.

    A missing directory is created with mode 0700. An existing one is never changed (it may be
    shared, like ``/run``): it is refused when its group or others may use it, or when another
    user owns it. Raises :class:`AgentConfigError` naming ``progress_socket``.
    """
    try:
        directory.mkdir(mode=SOCKET_DIR_MODE, parents=True)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise AgentConfigError(f"agent config: progress_socket: cannot create {directory}: "
                               f"{exc.strerror or exc}") from None
    st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise AgentConfigError(f"agent config: progress_socket: {directory} is not a directory")
    if st.st_mode & 0o077 or st.st_uid != os.geteuid():
        raise AgentConfigError(
            f"agent config: progress_socket: directory {directory} (mode {stat.S_IMODE(st.st_mode):04o}, "
            f"owner uid {st.st_uid}) is open to other users; put the socket in a directory of its own "
            "that the agent creates, or make this one private (chmod 700)")


def start_progress_server(path: Path, core: AgentCore, channels: WorkerChannels | None = None) -> grpc.Server:
    """The local progress channel on a unix socket only its owner can use.

    The socket lives in a private directory (:func:`private_socket_dir`) and is itself made 0600,
    so no other user on the node can report progress or read it.
    """
    private_socket_dir(path.parent)
    if path.exists() or path.is_socket():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise AgentConfigError(f"agent config: progress_socket: {path} exists and is not a socket")
        path.unlink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="agent-progress"))
    agent_pb2_grpc.add_ProgressServicer_to_server(ProgressServicer(core, channels), server)
    old = os.umask(0o177)
    try:
        if server.add_insecure_port(socket_target(str(path))) == 0:
            raise AgentConfigError(f"agent config: progress_socket: cannot bind {path}")
        server.start()
    finally:
        os.umask(old)
    os.chmod(path, SOCKET_MODE)
    return server


def health_state(severity: int) -> int:
    """Map :class:`stalwart.agent.health.Severity` to the record's ``HealthState`` (same numbers)."""
    return {1: records_pb2.HEALTH_OK, 2: records_pb2.HEALTH_TRANSIENT, 3: records_pb2.HEALTH_FATAL}[severity]
