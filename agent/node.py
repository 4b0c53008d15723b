"""The node agent: registers the node, follows the rounds, runs the workers, reports health.

Threads and what they own:

- the **main loop** (the thread that calls :meth:`NodeAgent.run`) applies round changes and
  starts and stops workers and warm spares — processes are created only here, because their
  parent-death signal is tied to the creating thread;
- the **monitor** thread polls the health probe, checks for stalls, probes peers and writes
  health and (rate-limited) progress to etcd;
- a **round watch** feeds round records to the main loop; gRPC threads serve the node service
  and the progress channel, and worker-exit threads report exits at once.

At a new round the agent re-forms in place (``reform_in_place``): each worker that is alive,
connected, healthy and able to re-form keeps its process and is sent ``Reform`` with its new rank;
ranks that are gone are stopped (off the main loop); empty local ranks take a warm spare, else a
new process. A kept worker or spare that has not begun its re-form (left its old world) within
``reform_timeout``, or is stopped, or lost its channel, is SIGKILLed and replaced; one that began
waits for its peers as long as they take. The decisions themselves are pure functions in
``core.py``. With ``reform_in_place = false`` every round change stops all workers and starts new
ones. A node outside an open round warms a spare per worker before it says it is ready to join.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stalwart.agent.adopt import (
    AdoptedProcess,
    AgentState,
    SpareEntry,
    StateFileError,
    WorkerEntry,
    alive_and_same,
    clear_state,
    load_state,
    process_start_time,
    save_state,
    state_path,
)
from stalwart.agent.config import AgentConfig
from stalwart.agent.core import (
    JoinFacts,
    ProcState,
    WorkerFacts,
    join_readiness,
    keep_verdict,
    lost_before_step,
    overdue_reform,
    refill_in_place,
    ring_neighbours,
    spares_may_start,
)
from stalwart.agent.health import FakeProbe, Finding, HealthProbe, Severity, make_probe, verdict
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.service import (
    FaultRefused,
    HelloEvent,
    StepEvent,
    WorkerChannels,
    health_state,
    start_node_server,
    start_progress_server,
)
from stalwart.agent.spares import SparePool
from stalwart.agent.stall import StallDetector, StallPolicy
from stalwart.agent.stragglers import slower_than_others
from stalwart.agent.throttle import Throttle, ThrottleSpec
from stalwart.agent.workers import ExitKind, RoundAssignment, Worker, WorkerExit, WorkerGroup, start_spare, stop_workers
from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError, EtcdUnavailable, LeaseLost
from stalwart.coord.keys import JobKeys
from stalwart.coord.lease import Lease
from stalwart.coord.reach import tcp_probe
from stalwart.coord.txn import Put
from stalwart.coord.watch import EventType, Watch
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from stalwart.proto.contract import ENV_NODE, ENV_SOCKET

log = logging.getLogger(__name__)
ADOPTED_SPARE_WAIT_S = 3.0  # a restarted agent waits this long at most for its adopted spares to reconnect


@dataclass
class _Progress:
    step: int = -1
    step_time: float = 0.0
    at: float = 0.0
    local_rank: int = -1
    busy: deque[float] = field(default_factory=deque)  # recent busy times (0: unknown)

    def busy_median(self) -> float:
        known = [b for b in self.busy if b > 0]
        return statistics.median(known) if known else 0.0


@dataclass(frozen=True)
class _PendingReform:
    """A Reform sent to a worker (kept or spare) and not acknowledged yet."""

    round: int
    local_rank: int
    rank: int
    sent: float  # monotonic
    deadline: float
    joining: bool = False  # the worker said it left its old world and waits for its new peers


@dataclass
class _State:
    round: records_pb2.RoundRecord | None = None
    group: WorkerGroup | None = None
    exits: list[WorkerExit] = field(default_factory=list)
    worker_findings: list[Finding] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    lost_peers: set[str] = field(default_factory=set)  # members of lost_peers_round our workers lost
    lost_peers_round: int = 0
    cut_check_round: int = 0  # the last round whose ring neighbours a stalled worker had checked
    progress: dict[int, _Progress] = field(default_factory=dict)
    draining: bool = False
    restarts: int = 0
    committed_step: int | None = None  # newest checkpoint a worker reported committed
    gave_up: str = ""  # why the job gave up (a worker exited with EXIT_DIVERGED); cleared by a new round
    pending: dict[int, _PendingReform] = field(default_factory=dict)  # by pid
    can_reform: set[int] = field(default_factory=set)  # pids whose Hello said they handle Reform
    replacing_since: float | None = None  # a worker died with no ready spare: warming replacements
    warming_since: float | None = None  # outside the round, warming a spare per worker before joining
    seen_round: records_pb2.RoundRecord | None = None  # the newest round read, applied or not yet


class NodeAgent:
    """One node's agent. ``start()`` brings up servers and registration; ``run()`` is the main loop."""

    def __init__(self, config: AgentConfig, *, client: EtcdClient | None = None,
                 probe: HealthProbe | None = None) -> None:
        self.config = config
        self.keys = JobKeys(config.job)
        self.client = client or EtcdClient(config.etcd)
        self.probe = probe or make_probe(config.probe, config.workers)
        self.stalls = StallDetector(StallPolicy(config.stall_floor, config.stall_factor, config.stall_first_step))
        self._state = _State()
        self._lock = threading.RLock()
        self._commands: queue.Queue[tuple[str, object]] = queue.Queue()
        self._stop = threading.Event()
        # When each long-running loop last went round (monotonic): the watchdog pings only while
        # every one does, so a loop stuck in a call (a hung driver, a deadlock) gets the agent restarted.
        self._beats: dict[str, float] = {}
        self._health_write = threading.Lock()  # one health write at a time, each of the newest state
        self._probed: list[Finding] = []  # the health probe's last sample (see _poll_probe)
        self._lease: Lease | None = None
        self._servers: list[grpc.Server] = []
        self._watch: Watch | None = None
        self._last_health: bytes = b""
        self._last_progress_write = 0.0
        self.port = 0
        self.metrics_port = 0
        self.metrics = AgentMetrics(config.node_id)
        self._drop_peers = threading.Event()  # fault injection: as if this node's links were cut
        self._health_service = health.HealthServicer()
        self.channels = WorkerChannels()  # commands to connected workers, by local rank
        self._throttles: dict[int, Throttle] = {}  # fault injection: slowed workers, by local rank
        # rank -> (monotonic time of its last step, start or Reform; what came last) for badput
        self._step_clock: dict[int, tuple[float, str]] = {}
        self.spare_pool = SparePool(config.spares if config.reform_in_place else 0, self._start_spare,
                                    node=config.node_id)
        self._state_file = state_path(config.state_dir)
        self._saved_state = b""
        self._start_times: dict[int, int] = {}  # pid -> kernel start time, for the state file
        self._handing_off = False  # stopping for a successor: the workers and the lease stay
        self._lost_while_away: list[WorkerExit] = []  # adopted round's workers that died meanwhile
        self._adopted_warm: set[int] = set()  # pids of adopted spares that were warm
        self._unrecorded: dict[int, records_pb2.CheckpointRecord] = {}  # commits etcd has not taken yet

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.config.advertise:
            return self.config.advertise
        host = self.config.listen.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = socket.getfqdn()
        return f"{host}:{self.port}"

    def _worker_env(self) -> dict[str, str]:
        """What every worker of this node gets beside torchrun's environment (proto/contract.py)."""
        return {ENV_SOCKET: str(self.config.socket_path), ENV_NODE: self.config.node_id}

    def start(self, cancel: threading.Event | None = None) -> bool:
        """Bind the servers, then register. With ``cancel``, an etcd that does not answer is
        waited for (a warning a try) until it does or ``cancel`` is set (returns False).
        Raises ``AgentConfigError``/``BindError`` (servers) or ``CoordError`` (etcd)."""
        self._servers.append(start_progress_server(self.config.socket_path, self, self.channels))
        add_health = lambda server: health_pb2_grpc.add_HealthServicer_to_server(  # noqa: E731
            self._health_service, server)
        server, self.port = start_node_server(self.config, self, extra=[add_health])
        self._servers.append(server)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_bind_host)
        if cancel is not None and not self._wait_for_etcd(cancel):
            return False
        kv = self.client.get(self.keys.round)
        if kv is not None:
            try:
                self._state.seen_round = records_pb2.RoundRecord.FromString(kv.value)
            except Exception:  # a malformed round is reported when it is applied
                pass
            self._update_readiness()
        self._register(resume=self._adopt())
        self._save_state()
        self._await_adopted_spares(ADOPTED_SPARE_WAIT_S)
        for exit_ in self._lost_while_away:
            self._worker_exited(exit_)
        self._watch = self._read_and_watch_round()
        threading.Thread(target=self._follow_rounds, daemon=True, name="agent-rounds").start()
        threading.Thread(target=self._monitor, daemon=True, name="agent-monitor").start()
        threading.Thread(target=self._peer_loop, daemon=True, name="agent-peers").start()
        for service in ("", "stalwart.v1.Agent"):
            self._health_service.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("agent %s up: service %s, progress socket %s", self.config.node_id, self.address,
                 self.config.socket_path, extra={"node": self.config.node_id})
        return True

    def _wait_for_etcd(self, cancel: threading.Event) -> bool:
        """Until etcd answers, as the daemon does: one warning line a try. Only unavailability is
        retried; bad credentials or settings raise."""
        while not cancel.is_set():
            try:
                self.client.status()
                return True
            except EtcdUnavailable as exc:
                log.warning("agent %s: etcd does not answer (%s); retrying", self.config.node_id, exc,
                            extra={"node": self.config.node_id})
                cancel.wait(1.0)
        return False

    def _register(self, resume: int | None = None) -> None:
        on_lost = lambda why: self._commands.put(("lease-lost", why))  # noqa: E731
        lease: Lease | None = None
        if resume is not None:
            try:
                lease = Lease(self.client, self.config.lease_ttl, on_lost=on_lost, resume=resume)
                log.info("agent %s: carrying on lease %x of the agent before", self.config.node_id, resume,
                         extra={"node": self.config.node_id})
            except LeaseLost:
                log.info("agent %s: the lease of the agent before has expired; registering anew",
                         self.config.node_id, extra={"node": self.config.node_id})
        if lease is None:
            lease = Lease(self.client, self.config.lease_ttl, on_lost=on_lost)
        record = records_pb2.NodeRecord(
            node_id=self.config.node_id, address=self.address, devices=self.config.workers,
            hostname=socket.gethostname(), registered_at=time.time(), cordoned=self._state.draining,
            versions={name: _version(name) for name in ("stalwart", "torch", "deepspeed")},
        )
        self._lease = lease
        self._poll_probe()
        if self._state.round is not None:  # registering again
            self._catch_up_round()
        # One transaction: the daemon sees the node and whether it is ready to join (its health
        # record's ``replacing``) in the same watch event, never the node alone.
        health = self._health_record()
        self._last_health = health.SerializeToString()
        health.checked_at = time.time()
        self.client.txn([], [Put(self.keys.node(self.config.node_id), record.SerializeToString(), lease.id),
                             Put(self.keys.health(self.config.node_id), health.SerializeToString(), lease.id)])

    def _catch_up_round(self) -> None:
        """Registering again (the lease was lost: a cut link, etcd out of reach): the world has
        most likely moved on without this node. Read the round now, so the health record that goes
        out with the registration says whether the node can join warm; one computed from the round
        it was last in says "ready", and the daemon would admit a node that must start cold."""
        kv = self.client.get(self.keys.round)
        if kv is None:
            return
        try:
            record = records_pb2.RoundRecord.FromString(kv.value)
        except Exception:
            return  # _apply_round says so when the watch brings it
        with self._lock:
            seen = self._state.seen_round
            if seen is None or record.number > seen.number or (record.number == seen.number and record.closed):
                self._state.seen_round = record
        self._update_readiness()

    def alive(self, stale_after: float) -> bool:
        """Whether the main loop and the monitor loop have each gone round within ``stale_after``
        seconds (the systemd watchdog's question; false before both have started)."""
        now = time.monotonic()
        beats = dict(self._beats)
        return all(now - beats.get(loop, -float("inf")) <= stale_after for loop in ("main", "monitor"))

    def run(self) -> None:
        """The main loop; returns after :meth:`shutdown`."""
        while not self._stop.is_set():
            self._beats["main"] = time.monotonic()
            try:
                self._maintain_spares()
                kind, payload = self._commands.get(timeout=0.5)
            except queue.Empty:
                self._save_state_safe()  # exits come on their own threads
                continue
            except Exception:
                log.exception("agent %s: cannot start a spare", self.config.node_id)
                self._stop.wait(0.5)
                continue
            try:
                if kind == "round":
                    self._apply_round(payload)  # type: ignore[arg-type]
                elif kind == "lease-lost":
                    log.error("agent %s: lease lost (%s); registering again", self.config.node_id, payload)
                    try:
                        self._register()
                    except CoordError:
                        # etcd has no quorum yet: try again, the workers train on meanwhile
                        retry = threading.Timer(1.0, self._commands.put, args=(("lease-lost", payload),))
                        retry.daemon = True
                        retry.start()
                        raise
                elif kind == "stop-workers":
                    self._stop_workers(str(payload), wait=True)
                    if self._state.draining:
                        self.spare_pool.paused = True
                        self.spare_pool.stop_all(self.config.stop_grace)
                elif kind == "refill":
                    self._refill(*payload)  # type: ignore[misc]
                elif kind == "call":
                    payload()  # type: ignore[operator]
            except CoordError as exc:
                log.error("agent %s: etcd: %s", self.config.node_id, exc)
            except Exception:
                log.exception("agent %s: main loop error", self.config.node_id)
            finally:
                self._save_state_safe()
        self.spare_pool.paused = True
        if self._handing_off:
            self._save_state_safe()
            log.info("agent %s: handing off: %d worker(s) train on and %d spare(s) wait for the next agent to adopt",
                     self.config.node_id, len(self._state.group.workers) if self._state.group else 0,
                     len(self.spare_pool.workers()), extra={"node": self.config.node_id})
            return
        self._stop_workers("agent shutting down", wait=True)
        self.spare_pool.stop_all(self.config.stop_grace)
        clear_state(self._state_file)

    def handoff(self) -> None:
        """Stop for a successor (``systemctl restart``, an upgrade): unlike :meth:`shutdown`, the
        workers train on and the lease and registration stay, so the next agent adopts them and
        the job does not notice. A successor that does not come in time loses the lease, and the
        workers stop themselves once their agent is gone for good (``STALWART_ORPHAN_TIMEOUT``)."""
        self._handing_off = True
        self._health_service.enter_graceful_shutdown()
        self._stop.set()
        if self._watch:
            self._watch.close()
        for server in self._servers:
            server.stop(grace=0.5)
        if self._lease:
            self._lease.stop()
        self.probe.close()

    # -- adoption of the workers of the agent before (a crash or a restart) ---------------------

    def _adopt(self) -> int | None:
        """Take over what the agent before left: its live workers of the round they train in, and
        its lease id (returned; None without a state file). Workers that died while no agent
        watched are reported as failed once registered (``_lost_while_away``)."""
        node = self.config.node_id
        try:
            saved = load_state(self._state_file, self.config.job, node)
        except (StateFileError, OSError) as exc:
            log.warning("agent %s: ignoring the state file %s: %s", node, self._state_file, exc,
                        extra={"node": node})
            return None
        if saved is None:
            return None
        self._state.restarts = saved.restarts
        self._adopt_spares(saved)
        live = [e for e in saved.workers if alive_and_same(e)]
        record = records_pb2.RoundRecord.FromString(saved.round) if saved.round else None
        mine = [m for m in record.members if m.node_id == node] if record is not None else []
        if record is None or record.closed or not mine:
            for e in live:
                _kill_group(e.pid)
            return saved.lease_id
        assignment = self._assignment(record, mine[0])
        group = WorkerGroup(self.config.command, assignment, self.config.log_dir, self._worker_exited,
                            extra_env=self._worker_env(), cwd=self.config.cwd,
                            spawn_missing=False)
        now = time.monotonic()
        with self._lock:
            for e in live:
                w = Worker(e.local_rank, e.rank, AdoptedProcess(e.pid), Path(e.log_path), round=record.number,
                           on_exit=self._worker_exited)
                w.reformed = True
                group.place(e.local_rank, w)
                self._start_times[e.pid] = e.start_time
                if e.can_reform:
                    self._state.can_reform.add(e.pid)
                self.stalls.started(w.rank, now)
                self._step_clock[w.rank] = (now, "re-form")
                w.watch()
            self._state.group, self._state.round = group, record
            adopted = {e.pid for e in live}
            self._lost_while_away = [
                WorkerExit(e.local_rank, e.rank, e.pid, -1, ExitKind.USER_ERROR,
                           "died while no agent watched it (agent restart)", time.time(), record.number)
                for e in saved.workers if e.pid not in adopted]
        self.metrics.round.labels(node).set(record.number)
        log.info("agent %s: adopted %d worker(s) of round %d from the agent before (%d died meanwhile)", node,
                 len(live), record.number, len(self._lost_while_away), extra={"node": node, "round": record.number})
        return saved.lease_id

    def _adopt_spares(self, saved: AgentState) -> None:
        """The warm spares the agent before left (they reconnect and say they are warm)."""
        adopted = 0
        self._adopted_warm = set()
        for e in saved.spares:
            if not alive_and_same(e):
                continue
            if e.warm:
                self._adopted_warm.add(e.pid)
            spare = Worker(-1, -1, AdoptedProcess(e.pid), Path(e.log_path), spare=True, on_exit=self._spare_exited)
            self._start_times[e.pid] = e.start_time
            self.spare_pool.add(spare)
            spare.watch()
            adopted += 1
        if saved.spares:
            log.info("agent %s: adopted %d of %d spare(s) from the agent before", self.config.node_id, adopted,
                     len(saved.spares), extra={"node": self.config.node_id})

    def _await_adopted_spares(self, timeout: float) -> None:
        """Give adopted spares a moment to reconnect before the first round is applied: a rank
        to fill would otherwise go to a cold new process while a warm spare is seconds away."""
        deadline = time.monotonic() + timeout
        while True:  # only for those that were warm: one still warming up connects when it can
            waiting = [s.pid for s in self.spare_pool.status() if not s.ready and s.pid in self._adopted_warm]
            if not waiting:
                return
            if time.monotonic() > deadline:
                log.warning("agent %s: adopted spare(s) %s did not reconnect within %.1f s", self.config.node_id,
                            waiting, timeout, extra={"node": self.config.node_id})
                return
            time.sleep(0.02)

    def _save_state_safe(self) -> None:
        try:
            self._save_state()
        except OSError as exc:
            log.warning("agent %s: cannot write the state file %s: %s", self.config.node_id, self._state_file, exc,
                        extra={"node": self.config.node_id})

    def _save_state(self) -> None:
        """Write what a successor needs to adopt the workers, when it changed."""
        with self._lock:
            group, record, lease = self._state.group, self._state.round, self._lease
            if lease is None:
                return
            entries = []
            if group is not None and record is not None and not record.closed:
                for w in group.workers:
                    if not w.running or w.stopping:
                        continue
                    start = self._start_times.get(w.pid)
                    if start is None:
                        start = process_start_time(w.pid)
                        if start is None:
                            continue
                        self._start_times[w.pid] = start
                    entries.append(WorkerEntry(w.local_rank, w.rank, w.pid, start, str(w.log_path),
                                               w.pid in self._state.can_reform))
            spares = []
            warm = {s.pid for s in self.spare_pool.status() if s.warm}
            for w in self.spare_pool.workers():
                if not w.running or w.stopping:
                    continue
                start = self._start_times.get(w.pid) or process_start_time(w.pid)
                if start is not None:
                    self._start_times[w.pid] = start
                    spares.append(SpareEntry(w.pid, start, str(w.log_path), w.pid in warm))
            state = AgentState(self.config.job, self.config.node_id, lease.id,
                               record.SerializeToString() if record is not None else b"", tuple(entries),
                               self._state.restarts, tuple(spares))
        raw = state.to_json()
        if raw != self._saved_state:
            self._state_file.parent.mkdir(parents=True, exist_ok=True)
            save_state(self._state_file, state)
            self._saved_state = raw

    def shutdown(self) -> None:
        self._health_service.enter_graceful_shutdown()
        self._stop.set()
        if self._watch:
            self._watch.close()
        for server in self._servers:
            server.stop(grace=1)
        if self._lease:
            self._announce_leaving()
            self._lease.revoke()
        self.probe.close()

    def _announce_leaving(self) -> None:
        """Mark the node record ``leaving`` before the lease goes, so the daemon shrinks the world
        without counting a fault: a stop on purpose (a rolling restart) must not quarantine."""
        try:
            kv = self.client.get(self.keys.node(self.config.node_id))
            if kv is None:
                return
            record = records_pb2.NodeRecord.FromString(kv.value)
            record.leaving = True
            self.client.put(self.keys.node(self.config.node_id), record.SerializeToString(), lease=kv.lease)
        except CoordError as exc:
            log.warning("agent %s: cannot mark the node as leaving (%s); the daemon will count a fault",
                        self.config.node_id, exc, extra={"node": self.config.node_id})

    # -- rounds --------------------------------------------------------------------------------

    def _follow_rounds(self) -> None:
        while not self._stop.is_set():
            watch = self._watch
            assert watch is not None
            try:
                events = watch.get(timeout=1.0)
            except CoordError as exc:
                # The watch ended (history compacted, permissions): read the round again and watch
                # from there; applying a round twice is harmless.
                log.error("agent %s: round watch failed (%s); re-reading", self.config.node_id, exc)
                watch.close()
                self._watch = self._rewatch()
                continue
            for ev in events:
                if ev.type is EventType.PUT:
                    self._commands.put(("round", ev.value))

    def _read_and_watch_round(self) -> Watch:
        """Apply the current round, then watch from the revision it was read at: a round
        written between the read and the watch's start is not missed."""
        kvs, revision = self.client.get_prefix(self.keys.round)
        for kv in kvs:
            if kv.key == self.keys.round:
                self._commands.put(("round", kv.value))
        return Watch(self.client, self.keys.round, revision + 1)

    def _rewatch(self) -> Watch:
        while not self._stop.is_set():
            try:
                return self._read_and_watch_round()
            except CoordError as exc:
                log.error("agent %s: cannot read the round: %s", self.config.node_id, exc)
                self._stop.wait(1.0)
        return Watch(self.client, self.keys.round, 0)

    def _apply_round(self, raw: bytes) -> None:
        try:
            record = records_pb2.RoundRecord.FromString(raw)
        except Exception:
            log.error("agent %s: round record is not a RoundRecord; ignored", self.config.node_id)
            return
        with self._lock:
            current = self._state.round
            if current is not None and (record.number < current.number or (
                    record.number == current.number and (current.closed or not record.closed))):
                return  # old news; the one change a round number can see is being closed
            seen = self._state.seen_round
            if seen is not None and record.number < seen.number:
                # A round already superseded (registering again read a newer one, which the watch
                # brings next): applying it would re-form workers for a world that will not form
                # and, worse, say this node is ready because it was a member of that one.
                return
        mine = [m for m in record.members if m.node_id == self.config.node_id]
        with self._lock:
            self._state.seen_round = record
        self._update_readiness()
        with self._lock:
            self._state.worker_findings = []  # they were about the round that just ended
            self._state.gave_up = ""
            kept_anyway = bool(mine) and self._state.replacing_since is not None  # the daemon could not do without us
            if kept_anyway:
                self._end_replacing("back in the world")
        if self.config.reform_in_place and mine and not record.closed and not self._state.draining:
            self._join_in_place(record, self._assignment(record, mine[0]), cold_ok=kept_anyway)
            return
        self._stop_workers(f"round {record.number} {'closed: ' + record.reason if record.closed else 'opened'}")
        with self._lock:
            self._state.round = record
        if record.closed:
            return
        if not mine or self._state.draining:
            log.info("agent %s: not a member of round %d", self.config.node_id, record.number,
                     extra={"node": self.config.node_id, "round": record.number})
            return
        assignment = self._assignment(record, mine[0])
        now = time.monotonic()
        group = WorkerGroup(self.config.command, assignment, self.config.log_dir, self._worker_exited,
                            extra_env=self._worker_env(), cwd=self.config.cwd)
        with self._lock:
            self._state.group = group
            self._state.worker_findings = []
            self._state.progress = {}
            for w in group.workers:
                self.stalls.started(w.rank, now)
                self._step_clock[w.rank] = (now, "startup")
        self._joined(record)

    def _assignment(self, record: records_pb2.RoundRecord, m: records_pb2.RoundMember) -> RoundAssignment:
        return RoundAssignment(
            round=record.number, group_rank=m.node_rank, first_rank=m.first_rank,
            local_world_size=m.local_world_size or self.config.workers, world_size=record.world_size,
            master_addr=record.master_addr, master_port=record.master_port,
            restore_step=record.restore_step if record.has_restore_step else None,
            restart_count=self._state.restarts,
        )

    def _joined(self, record: records_pb2.RoundRecord) -> None:
        self._state.restarts += 1
        self.metrics.restarts.labels(self.config.node_id).inc()
        self.metrics.round.labels(self.config.node_id).set(record.number)
        self._publish_health(force=True)

    def _unfit(self, w: Worker, assignment: RoundAssignment, connected: dict[int, int],
               spare_streams: set[int]) -> tuple[str, bool] | None:
        """Why ``w`` cannot be kept for the new round, and whether it is unhealthy (killed at
        once rather than given its SIGTERM grace); None when it is kept (``core.keep_verdict``).
        Caller holds the lock."""
        # A spare told to re-form in the round before keeps its spare stream until it acknowledges.
        reforming = w.pid in self._state.pending and w.pid in spare_streams
        verdict = keep_verdict(WorkerFacts(
            running=w.running, stopping=w.stopping, local_rank=w.local_rank,
            connected=connected.get(w.local_rank) == w.pid, reforming=reforming,
            stalled=self.stalls.stalled(w.rank), proc=self._proc_state(w.local_rank, w.pid) if w.running
            else ProcState.EXITED,
            can_reform=w.pid in self._state.can_reform), assignment.local_world_size)
        return None if verdict.keep else (verdict.why, verdict.unhealthy)

    def _join_in_place(self, record: records_pb2.RoundRecord, assignment: RoundAssignment,
                       cold_ok: bool = False) -> None:
        """Re-form into ``record``: Reform to kept workers first (the fast path), then spares into
        empty local ranks, then stop what is left of the old round, then start new processes —
        for a lost worker only with ``cold_ok`` (the daemon kept this node though it asked to
        leave while a spare warms), else the node fails the round and asks to leave."""
        node, now = self.config.node_id, time.monotonic()
        connected, spare_streams = self.channels.connected(), self.channels.spares()
        keep: dict[int, Worker] = {}
        drop: list[tuple[Worker, str, bool]] = []
        with self._lock:
            old = self._state.group
            for w in (old.workers if old is not None else []):
                unfit = self._unfit(w, assignment, connected, spare_streams)
                if unfit is None:
                    keep[w.local_rank] = w
                elif w.running:
                    drop.append((w, *unfit))
                self.stalls.forget(w.rank)
            self._state.pending = {}
            group = WorkerGroup(self.config.command, assignment, self.config.log_dir, self._worker_exited,
                                extra_env=self._worker_env(), cwd=self.config.cwd,
                                reuse=keep, spawn_missing=False)
            self._state.group = group
            self._state.round = record
            self._state.progress = {}
            self._state.worker_findings = []
        # An injected slow-down stays with a kept process (a slow device stays slow in the next
        # round) and ends with any other.
        self._clear_throttles(keep={lr: w.pid for lr, w in keep.items()})
        log.info("agent %s: round %d: keeping %d worker(s) in place, %d to stop, %d to fill", node, record.number,
                 len(keep), len(drop), len(group.missing()), extra={"node": node, "round": record.number})
        for w in list(keep.values()):
            if not self._send_reform(group, w, record, now):
                keep.pop(w.local_rank)
                drop.append((w, "could not be told to re-form", True))
        for lr in group.missing():
            spare = self.spare_pool.take()
            if spare is None:
                break
            self._adopt_spare(group, lr, spare, record, now)
        for w, why, _ in drop:
            log.info("agent %s: round %d: stopping rank %d (pid %d): %s", node, record.number, w.rank, w.pid, why,
                     extra={"node": node, "rank": w.rank, "round": record.number})
        self._stop_in_background([w for w, _, unhealthy in drop if unhealthy], 0.0)
        self._stop_in_background([w for w, _, unhealthy in drop if not unhealthy], self.config.stop_grace)
        if group.missing() and old is not None and self.config.spares > 0 and not cold_ok:
            # A worker of ours was lost and no spare can take its rank: a new process would hold
            # the whole round up for its start. Fail the round and leave it while a spare warms;
            # only when the daemon cannot do without this node (it is still a member of the next
            # round though replacing) does a new process start.
            with self._lock:
                self._state.replacing_since = time.monotonic()
                self.spare_pool.wanted = max(self.spare_pool.wanted, self.config.workers)
                for lr in group.missing():
                    self._state.worker_findings.append(Finding(
                        "worker", lr, Severity.OK, "worker-no-spare",
                        f"local rank {lr}: no warm spare to take its rank; leaving the round while one warms",
                        record.number))
            log.warning("agent %s: round %d: no warm spare for local rank(s) %s: leaving the round while one warms",
                        node, record.number, group.missing(), extra={"node": node, "round": record.number})
            self._joined(record)
            return
        for lr in group.missing():
            spawned = group.spawn(lr)
            with self._lock:
                self.stalls.started(spawned.rank, time.monotonic())
                self._step_clock[spawned.rank] = (time.monotonic(), "startup")
        self._joined(record)

    def _send_reform(self, group: WorkerGroup, w: Worker, record: records_pb2.RoundRecord, now: float) -> bool:
        """Tell a live process its place in ``record``; False (and the place emptied) if it is not
        connected."""
        command = agent_pb2.AgentCommand(reform=agent_pb2.Reform(round=record, rank=w.rank,
                                                                 world_size=record.world_size,
                                                                 local_rank=w.local_rank))
        with self._lock:
            self._state.pending[w.pid] = _PendingReform(record.number, w.local_rank, w.rank, now,
                                                        now + self.config.reform_timeout)
            self.stalls.started(w.rank, now)
            self._step_clock[w.rank] = (now, "re-form")
        if self.channels.send_pid(w.pid, command):
            self.metrics.reforms.labels(self.config.node_id, "sent").inc()
            log.info("agent %s: round %d: re-form sent to rank %d (pid %d, local rank %d) of %d", self.config.node_id,
                     record.number, w.rank, w.pid, w.local_rank, record.world_size,
                     extra={"node": self.config.node_id, "rank": w.rank, "round": record.number})
            return True
        with self._lock:
            self._state.pending.pop(w.pid, None)
            self.stalls.forget(w.rank)
            group.release(w.local_rank)
        self.metrics.reforms.labels(self.config.node_id, "undeliverable").inc()
        return False

    def _adopt_spare(self, group: WorkerGroup, local_rank: int, spare: Worker, record: records_pb2.RoundRecord,
                     now: float) -> bool:
        with self._lock:
            group.adopt(local_rank, spare)
        if not self._send_reform(group, spare, record, now):
            spare.kill()
            return False
        self.metrics.spare_assignments.labels(self.config.node_id).inc()
        log.info("agent %s: round %d: spare (pid %d) takes rank %d (local rank %d)", self.config.node_id,
                 record.number, spare.pid, spare.rank, local_rank,
                 extra={"node": self.config.node_id, "rank": spare.rank, "round": record.number})
        return True

    def _refill(self, round_number: int, local_rank: int, pid: int) -> None:
        """Give an emptied local rank of the current round a spare, else a new process (a worker
        that did not acknowledge its re-form was killed)."""
        with self._lock:
            group, record = self._state.group, self._state.round
            if group is None or record is None or record.number != round_number or record.closed:
                return  # the round moved on; its own re-form filled every place
            w = group.worker(local_rank)
            if w is not None and w.pid != pid:
                return
            group.release(local_rank)
        if w is not None:
            try:
                w.proc.wait(timeout=2)
            except Exception:
                log.warning("agent %s: killed pid %d has not exited yet", self.config.node_id, pid)
        now = time.monotonic()
        spare = self.spare_pool.take()
        if spare is not None and self._adopt_spare(group, local_rank, spare, record, now):
            return
        if group.worker(local_rank) is None:
            spawned = group.spawn(local_rank)
            with self._lock:
                self.stalls.started(spawned.rank, now)
                self._step_clock[spawned.rank] = (now, "startup")

    def _proc_state(self, local_rank: int, pid: int) -> ProcState:
        """The process's state, where a slow-down injected on purpose (stopped in short bursts)
        counts as running."""
        state = _proc_state(pid)
        throttle = self._throttles.get(local_rank)
        if state is ProcState.STOPPED and throttle is not None and throttle.pgid == pid and throttle.alive:
            return ProcState.RUNNING
        return state

    def _check_reforms(self, now: float) -> None:
        """Workers whose re-form is overdue (``core.overdue_reform``): one that is stopped, lost
        its channel or never began is killed (the main loop refills its place); one that said it
        left its old world waits for its peers as long as it takes: membership is the daemon's to
        change, not ours."""
        connected = self.channels.connected()
        spare_streams = self.channels.spares()
        with self._lock:
            expired = [(pid, p) for pid, p in self._state.pending.items() if now > p.deadline]
            group = self._state.group
            for pid, p in expired:
                w = group.worker(p.local_rank) if group is not None else None
                if w is None or w.pid != pid or not w.running:
                    del self._state.pending[pid]
                    continue  # gone already: its exit was reported as such
                linked = connected.get(w.local_rank) == pid or pid in spare_streams
                overdue = overdue_reform(self._proc_state(p.local_rank, pid), linked, now - p.sent, p.joining)
                extra = {"node": self.config.node_id, "rank": p.rank, "round": p.round}
                if not overdue.kill:
                    self._state.pending[pid] = dataclasses.replace(p, deadline=now + self.config.reform_timeout)
                    log.warning("agent %s: rank %d (pid %d) into round %d: %s", self.config.node_id, p.rank, pid,
                                p.round, overdue.why, extra=extra)
                    continue
                del self._state.pending[pid]
                self.stalls.forget(w.rank)
                log.error("agent %s: rank %d (pid %d) into round %d: %s; killing and replacing it",
                          self.config.node_id, p.rank, pid, p.round, overdue.why, extra=extra)
                self.metrics.reforms.labels(self.config.node_id, "timed-out").inc()
                w.kill()
                self._commands.put(("refill", (p.round, p.local_rank, pid)))

    # -- spares ------------------------------------------------------------------------------

    def _start_spare(self) -> Worker:
        return start_spare(self.config.command, self.config.log_dir, self._spare_exited,
                           extra_env=self._worker_env(), cwd=self.config.cwd)

    def _maintain_spares(self) -> None:
        if self.spare_pool.wanted and not self._state.draining and self._spares_may_start():
            self.spare_pool.maintain()
        self._spare_metrics()
        self._replacement_warm()
        was = self._state.warming_since
        self._update_readiness()
        if was is not None and self._state.warming_since is None:
            self._publish_health(force=True)

    def _spares_may_start(self) -> bool:
        with self._lock:
            group = self._state.group
            running = [w for w in group.workers if w.running] if group is not None else []
            stepped = sum(1 for w in running if self._state.progress.get(w.rank, _Progress()).step >= 0)
            return spares_may_start(warming=self._state.warming_since is not None,
                                    replacing=self._state.replacing_since is not None, workers=len(running),
                                    stepped=stepped)

    def _spare_metrics(self) -> None:
        spares = self.spare_pool.status()
        ready = sum(1 for s in spares if s.warm)
        self.metrics.spares.labels(self.config.node_id, "ready").set(ready)
        self.metrics.spares.labels(self.config.node_id, "starting").set(len(spares) - ready)

    def _replacement_warm(self) -> None:
        """End "replacing" once a spare per local worker is ready (or it took too long); the
        daemon may then take the node back into the world."""
        with self._lock:
            since = self._state.replacing_since
            if since is None:
                return
            ready = sum(1 for s in self.spare_pool.status() if s.warm)
            if ready >= self.config.workers:
                self._end_replacing(f"{ready} warm spare(s) ready after {time.monotonic() - since:.1f} s")
            elif self.spare_pool.disabled:
                self._end_replacing(f"no warm spares: {self.spare_pool.disabled}")
            elif time.monotonic() - since > self.config.replace_timeout:
                self._end_replacing(f"no warm replacement within replace_timeout={self.config.replace_timeout:g} s")
            else:
                return
        self._publish_health(force=True)

    def _end_replacing(self, why: str) -> None:
        """Caller holds the lock."""
        self._state.replacing_since = None
        if self._state.warming_since is None:
            self.spare_pool.wanted = self.config.spares if self.config.reform_in_place else 0
        log.info("agent %s: no longer replacing a lost worker: %s", self.config.node_id, why,
                 extra={"node": self.config.node_id})

    def _update_readiness(self) -> None:
        """Warm a spare per local worker while this node is outside an open round and not ready
        to join (``core.join_readiness``); its health record says ``replacing`` meanwhile, so the
        daemon admits the node only once it can join warm."""
        with self._lock:
            # the newest round read, even before the main loop applied it: a node that just started
            # must not say it is ready because it has not applied the round yet
            rnd = self._state.seen_round
            now = time.monotonic()
            warming = self._state.warming_since
            applied = self._state.round
            # Workers count as warm only while the round has not moved on past theirs: a node left
            # out of a newer round stops them when it applies that round.
            moved_on = rnd is not None and (applied is None or rnd.number > applied.number)
            facts = JoinFacts(
                in_round=rnd is not None and not rnd.closed
                and any(m.node_id == self.config.node_id for m in rnd.members),
                started=rnd is not None, workers=self.config.workers,
                ready_spares=sum(1 for sp in self.spare_pool.status() if sp.warm) + sum(
                    1 for w in (self._state.group.workers if self._state.group is not None and not moved_on else [])
                    if w.running and not w.stopping and w.pid in self._state.can_reform),
                # spares = 0: the command is not known to run as a spare, so there is nothing to warm
                spares_disabled=bool(self.spare_pool.disabled) or self.config.spares == 0,
                reform_in_place=self.config.reform_in_place,
                warming_for=None if warming is None else now - warming)
            readiness = join_readiness(facts, self.config.replace_timeout)
            if readiness.ready and warming is not None:
                self._state.warming_since = None
                if self._state.replacing_since is None:
                    self.spare_pool.wanted = self.config.spares if self.config.reform_in_place else 0
                log.info("agent %s: ready to join: %s", self.config.node_id, readiness.why,
                         extra={"node": self.config.node_id})
            elif not readiness.ready and warming is None:
                self._state.warming_since = now
                self.spare_pool.wanted = max(self.spare_pool.wanted, self.config.workers)
                log.info("agent %s: outside round %d, not ready to join: %s", self.config.node_id,
                         rnd.number if rnd else 0, readiness.why, extra={"node": self.config.node_id})
            else:
                return
        self._commands.put(("call", lambda: None))  # wake the main loop to start spares

    def _start_replacing(self, exit_: WorkerExit, could_reform: bool) -> None:
        """A worker of this round died: with no ready spare to take its rank, ask to leave the world
        while spares warm up, so the other ranks need not wait for a cold process. Only for
        workers that re-form in place (the survivors then re-form instead of restarting).
        Caller holds the lock."""
        if not (self.config.reform_in_place and could_reform and not self.spare_pool.disabled
                and exit_.kind in (ExitKind.SIGNAL, ExitKind.OOM_KILLED, ExitKind.USER_ERROR)
                and self._state.replacing_since is None):
            return
        if any(s.warm for s in self.spare_pool.status()):
            return  # a warm spare takes the rank in the next round
        self._state.replacing_since = time.monotonic()
        self.spare_pool.wanted = max(self.spare_pool.wanted, self.config.workers)
        log.info("agent %s: rank %d lost with no warm spare ready: replacing it out of the world", self.config.node_id,
                 exit_.rank, extra={"node": self.config.node_id, "rank": exit_.rank, "round": exit_.round})
        self._commands.put(("call", lambda: None))  # wake the main loop to start spares

    def _spare_exited(self, exit_: WorkerExit) -> None:
        """A spare's exit: not a worker failure (it held no rank); the pool replaces it."""
        with self._lock:
            self._state.can_reform.discard(exit_.pid)
        if self.spare_pool.exited(exit_.pid):
            self.metrics.faults.labels(self.config.node_id, f"spare-{exit_.kind.value}").inc()
        self._commands.put(("call", lambda: None))  # wake the main loop to start a replacement

    def _stop_workers(self, why: str, wait: bool = False) -> None:
        self._clear_throttles()  # an injected slow-down ends with the workers it slowed
        with self._lock:
            group = self._state.group
            self._state.group = None
            self._state.pending = {}
        if group is not None and group.running:
            log.info("agent %s: stopping workers: %s", self.config.node_id, why)
            if wait:
                group.stop(self.config.stop_grace)
            else:
                self._stop_in_background(group.workers, self.config.stop_grace)
        if group is not None:
            for w in group.workers:
                self.stalls.forget(w.rank)

    def _stop_in_background(self, workers: list[Worker], grace: float) -> None:
        """SIGTERM now; the grace and the SIGKILL after it on a thread of their own, so the main loop
        (which applies the next round) is never held up by a worker that ignores SIGTERM — one
        blocked in a collective with peers that are gone cannot act on it until that times out."""
        workers = [w for w in workers if w.running]
        if not workers:
            return
        for w in workers:
            w.stopping = True  # from now on, for every check of the main loop
        threading.Thread(target=stop_workers, args=(workers, grace), daemon=True, name="agent-stop").start()

    def _worker_exited(self, exit_: WorkerExit) -> None:
        with self._lock:
            self._state.exits.append(exit_)
            pending = self._state.pending.pop(exit_.pid, None)
            could_reform = exit_.pid in self._state.can_reform
            self._state.can_reform.discard(exit_.pid)
            group = self._state.group
            current = group.worker(exit_.local_rank) if group is not None else None
            if current is None or current.pid == exit_.pid:  # not a replaced process's late exit
                self.stalls.forget(exit_.rank)
            if exit_.kind in (ExitKind.SUCCESS, ExitKind.STOPPED):
                return
            warm_spare = any(s.warm for s in self.spare_pool.status())
            if pending is not None and exit_.kind is not ExitKind.GAVE_UP and refill_in_place(
                    joining=pending.joining, new_rank=pending.rank, warm_spare=warm_spare, spares=self.config.spares):
                # Died before it began its re-form (it may have been dying already when the round
                # came, or its old world's abort took it down): fill its place here, with a warm
                # spare, instead of failing the round (``core.refill_in_place`` says when).
                log.error("agent %s: rank %d (pid %d) died while re-forming into round %d (%s); replacing it",
                          self.config.node_id, exit_.rank, exit_.pid, pending.round, exit_.reason,
                          extra={"node": self.config.node_id, "rank": exit_.rank, "round": pending.round})
                self.metrics.reforms.labels(self.config.node_id, "died").inc()
                self._commands.put(("refill", (pending.round, pending.local_rank, exit_.pid)))
                return
            if pending is not None and exit_.kind is not ExitKind.GAVE_UP:
                # It died while joining (its peers' group may be broken), or there is no warm
                # spare (a new process would hold every peer up for its whole start): fail the
                # round it was joining; without a warm spare the node also leaves while one warms.
                log.error("agent %s: rank %d (pid %d) died while re-forming into round %d (%s); failing the round%s",
                          self.config.node_id, exit_.rank, exit_.pid, pending.round, exit_.reason,
                          "" if warm_spare else " and leaving it while a spare warms",
                          extra={"node": self.config.node_id, "rank": exit_.rank, "round": pending.round})
                self.metrics.reforms.labels(self.config.node_id, "died").inc()
                exit_ = dataclasses.replace(exit_, round=pending.round)
                could_reform = True  # it was re-forming in place
            if exit_.kind is ExitKind.GAVE_UP:
                # Not a worker failure (the daemon would restart the round): the job gave up.
                self._state.gave_up = f"rank {exit_.rank}: {exit_.reason}"
                self._state.worker_findings.append(Finding("worker", exit_.local_rank, Severity.OK, "job-gave-up",
                                                           self._state.gave_up, exit_.round))
                self.metrics.faults.labels(self.config.node_id, "job-gave-up").inc()
                log.error("agent %s: %s; the job gave up, not asking for a restart", self.config.node_id,
                          self._state.gave_up, extra={"node": self.config.node_id, "rank": exit_.rank,
                                                      "round": exit_.round})
                self._last_progress_write = 0.0
            else:
                if current is not None and current.pid == exit_.pid:
                    self._start_replacing(exit_, could_reform)
                self.metrics.faults.labels(self.config.node_id, f"worker-{exit_.kind.value}").inc()
                self._state.worker_findings.append(Finding("worker", exit_.local_rank, Severity.OK,
                                                           f"worker-{exit_.kind.value}",
                                                           f"rank {exit_.rank}: {exit_.reason}", exit_.round))
        self._publish_health(force=True)
        if exit_.kind is ExitKind.GAVE_UP:
            self._publish_progress_safe()

    # -- monitor: health, stalls, peers, progress ----------------------------------------------------

    def _peer_loop(self) -> None:
        """Peer probes on a thread of their own: a slow peer must not delay stall detection."""
        while not self._stop.wait(self.config.peer_probe_interval):
            try:
                self._probe_peers()
            except Exception:  # keep probing: one bad address must not end the thread
                log.exception("agent %s: peer probe failed", self.config.node_id)

    def _monitor(self) -> None:
        while not self._stop.wait(min(0.25, self.config.probe_interval)):
            self._poll_probe()
            now = self._beats["monitor"] = time.monotonic()
            self._check_reforms(now)
            with self._lock:
                group = self._state.group
                throttled = set(self._throttles)  # stopped on purpose, in short bursts
                workers = [w for w in group.workers if w.running and w.local_rank not in throttled] \
                    if group is not None else []
            for w in workers:
                self.stalls.frozen(w.rank, _frozen(w.pid), now)
            for stall in self.stalls.check(now):
                log.error("agent %s: rank %d stalled: no step for %.1f s (timeout %.1f s, last step %d)",
                          self.config.node_id, stall.rank, stall.silent_for, stall.timeout, stall.last_step,
                          extra={"node": self.config.node_id, "rank": stall.rank})
                self.metrics.stalls.labels(self.config.node_id).inc()
                with self._lock:
                    group = self._state.group
                    stopped = group is not None and _stopped(group, stall.rank)
                    # A stopped process is this node's fault; a running one is most likely waiting
                    # in a collective for a peer that stalled, so it is not blamed.
                    self._state.worker_findings.append(Finding(
                        "stall", stall.rank, Severity.OK, "stall" if stopped else "stall-waiting",
                        f"rank {stall.rank}: no step for {stall.silent_for:.1f} s (timeout {stall.timeout:.1f} s)"
                        + ("" if stopped else ", process running"),
                        group.assignment.round if group is not None else 0))
                if not stopped:
                    self._check_ring_once()
            try:
                self._publish_health()
                self._publish_progress()
                if self._unrecorded:
                    self._record_checkpoints()
            except CoordError as exc:
                log.warning("agent %s: cannot write to etcd: %s", self.config.node_id, exc)

    def findings(self) -> list[Finding]:
        """Probe findings decide the node's verdict. Worker and stall findings are listed with
        severity OK: they say the round broke (the daemon restarts it), not that the node is bad."""
        with self._lock:
            return list(self._probed) + list(self._state.worker_findings)

    def _poll_probe(self) -> None:
        """Sample the health probe (NVML) into ``_probed``: from the monitor loop, never under a
        lock, so a slow or hung driver call delays only that loop (whose stall stops the watchdog),
        not the agent's other work, which reads the last sample."""
        polled = self.probe.poll()
        with self._lock:
            self._probed = polled

    def _health_record(self) -> records_pb2.HealthRecord:
        found = self.findings()
        with self._lock:
            unreachable = list(self._state.unreachable)
            rnd = self._state.round
            lost = sorted(self._state.lost_peers) if rnd is not None and rnd.number == self._state.lost_peers_round \
                else []
        return records_pb2.HealthRecord(
            node_id=self.config.node_id, state=health_state(int(verdict(found))), unreachable_peers=unreachable,
            lost_peers=lost, lost_peers_round=self._state.lost_peers_round if lost else 0,
            replacing=self._state.replacing_since is not None or self._state.warming_since is not None,
            findings=[records_pb2.Finding(source=f.source, device=max(f.device, 0), state=health_state(int(f.severity)),
                                          code=f.code, detail=f.detail, round=f.round) for f in found],
        )

    def _publish_health(self, force: bool = False) -> None:
        """Write the health record. Several threads call this: each builds and writes under one
        lock, so a record built from older state can never land after a newer one (the daemon
        would then miss a worker failure until the stall timeout)."""
        with self._health_write:
            record = self._health_record()
            raw = record.SerializeToString()
            if raw == self._last_health and not force:
                return
            self._last_health = raw
            self.metrics.set_findings([(f.code, records_pb2.HealthState.Name(f.state)) for f in record.findings])
            record.checked_at = time.time()
            lease = self._lease.id if self._lease else 0
            self.client.put(self.keys.health(self.config.node_id), record.SerializeToString(), lease=lease)
        if record.state == records_pb2.HEALTH_FATAL:
            log.error("agent %s: node unhealthy: %s", self.config.node_id,
                      ", ".join(f"{f.code} on device {f.device}" for f in record.findings if f.state == 3))

    def _publish_progress_safe(self) -> None:
        try:
            self._publish_progress()
        except CoordError as exc:
            log.warning("agent %s: cannot write progress to etcd: %s", self.config.node_id, exc)

    def local_stragglers(self) -> dict[int, float]:
        """This node's ranks (by local rank) whose recent busy time exceeds the median of the
        node's other ranks by ``straggler_factor``: busy median of each."""
        with self._lock:
            busy = {p.local_rank: p.busy_median() for p in self._state.progress.values() if p.local_rank >= 0}
        known = {lr: b for lr, b in busy.items() if b > 0}
        return {lr: known[lr] for lr in slower_than_others(known, self.config.straggler_factor)}

    def _publish_progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress_write < self.config.progress_interval:
            return
        stragglers = sorted(self.local_stragglers())
        with self._lock:
            if self._state.round is None or not (self._state.progress or self._state.gave_up):
                return
            progress = list(self._state.progress.values())
            slowest = min(progress, key=lambda p: p.step) if progress else _Progress()
            # the node goes at its slowest rank's pace
            busy = max((p.busy_median() for p in progress), default=0.0)
            record = records_pb2.ProgressRecord(node_id=self.config.node_id, round=self._state.round.number,
                                                step=max(slowest.step, 0), step_time=slowest.step_time,
                                                reported_at=time.time(), busy_time=busy,
                                                straggling_ranks=stragglers, gave_up=bool(self._state.gave_up),
                                                gave_up_reason=self._state.gave_up)
            if self._state.committed_step is not None:
                record.committed_step, record.has_committed_step = self._state.committed_step, True
        self._last_progress_write = now
        lease = self._lease.id if self._lease else 0
        self.client.put(self.keys.progress(self.config.node_id), record.SerializeToString(), lease=lease)

    def _probe_peers(self) -> None:
        with self._lock:
            peers = [m for m in (self._state.round.members if self._state.round else [])
                     if m.node_id != self.config.node_id and m.address]
        unreachable = [p.node_id for p in peers if not self._ping(p.address)]
        with self._lock:
            self._state.unreachable = unreachable

    def worker_joining(self, pid: int, round: int, arrived: int, world_size: int) -> None:
        with self._lock:
            pending = self._state.pending.get(pid)
            if pending is not None and round >= pending.round and not pending.joining:
                self._state.pending[pid] = dataclasses.replace(pending, joining=True)
                log.info("agent %s: pid %d left its old world, joining round %d (%d of %d arrived)",
                         self.config.node_id, pid, round, arrived, world_size,
                         extra={"node": self.config.node_id, "round": round})

    def worker_peer_lost(self, rank: int, round: int, hosts: list[str], detail: str) -> None:
        """A worker's collective of ``round`` broke on peers at ``hosts``: ping the agents of the
        members there (on a thread: a dead host may take the whole timeout) and report those that
        do not answer, so the daemon can act before their leases expire. A host shared by several
        members (or this node's own) names no one and is ignored."""
        node = self.config.node_id
        with self._lock:
            rnd = self._state.round
        if rnd is None or round != rnd.number:
            return
        by_host: dict[str, list[records_pb2.RoundMember]] = {}
        for m in rnd.members:
            if m.address:
                by_host.setdefault(m.address.rsplit(":", 1)[0].strip("[]"), []).append(m)
        suspects = [ms[0] for h, ms in by_host.items() if h in hosts and len(ms) == 1 and ms[0].node_id != node]
        log.warning("agent %s: rank %d lost peers at %s in round %d (%s); checking %s", node, rank, ", ".join(hosts),
                    round, detail.splitlines()[0][:200] if detail else "", [m.node_id for m in suspects] or "no one",
                    extra={"node": node, "rank": rank, "round": round})
        if suspects:
            threading.Thread(target=self._check_lost_peers, args=(round, suspects), daemon=True,
                             name="agent-lost-peers").start()

    def _check_ring_once(self) -> None:
        """A worker of this node is blocked in a collective (stalled, its process running): the
        peer it waits on may sit behind a cut link, which nothing sees before its lease expires.
        Check ``peer_probe_neighbours`` members after this node in the round (once a round, on a
        thread); one whose host does not answer at all is reported lost. A host that refuses the
        connection is up (its agent restarts, say): its workers may well be training, so it is
        not accused."""
        with self._lock:
            rnd = self._state.round
            if rnd is None or self._state.cut_check_round == rnd.number:
                return
            self._state.cut_check_round = rnd.number
            neighbours = ring_neighbours([m.node_id for m in rnd.members], self.config.node_id,
                                         self.config.peer_probe_neighbours)
            suspects = [m for m in rnd.members if m.node_id in neighbours and m.address]
        if suspects:
            threading.Thread(target=self._check_lost_peers, args=(rnd.number, suspects, self._host_gone),
                             daemon=True, name="agent-ring-check").start()

    def _host_gone(self, address: str) -> bool:
        return self._drop_peers.is_set() or tcp_probe(address, timeout=0.5) == "none"

    def _check_lost_peers(self, round: int, suspects: list[records_pb2.RoundMember],
                          gone: Callable[[str], bool] | None = None) -> None:
        """Report the ``suspects`` that are ``gone`` (default: their agent does not answer a Ping),
        asked in parallel: a host behind a cut link takes the whole timeout."""
        gone = gone or (lambda address: not self._ping(address, timeout=0.5))
        with ThreadPoolExecutor(max_workers=max(1, len(suspects)), thread_name_prefix="agent-probe") as pool:
            answers = list(pool.map(lambda m: gone(m.address), suspects))
        lost = {m.node_id for m, g in zip(suspects, answers, strict=True) if g}
        if not lost:
            return
        with self._lock:
            if self._state.round is None or self._state.round.number != round:
                return  # the world moved on meanwhile
            if self._state.lost_peers_round != round:
                self._state.lost_peers, self._state.lost_peers_round = set(), round
            if lost <= self._state.lost_peers:
                return
            self._state.lost_peers |= lost
        log.error("agent %s: round %d: %s lost (workers' collectives broke or blocked on them, they do not answer)",
                  self.config.node_id, round, ", ".join(sorted(lost)), extra={"node": self.config.node_id,
                                                                             "round": round})
        try:
            self._publish_health(force=True)
        except CoordError as exc:
            log.warning("agent %s: cannot report lost peers: %s", self.config.node_id, exc)

    def _ping(self, address: str, timeout: float = 2.0) -> bool:
        if self._drop_peers.is_set():
            return False
        if self.config.insecure:
            channel = grpc.insecure_channel(address)
        else:
            creds = grpc.ssl_channel_credentials(_read(self.config.tls.ca_file), _read(self.config.tls.key_file),
                                                 _read(self.config.tls.cert_file))
            channel = grpc.secure_channel(address, creds)
        try:
            agent_pb2_grpc.AgentStub(channel).Ping(agent_pb2.PingRequest(from_node=self.config.node_id),
                                                   timeout=timeout)
            return True
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    # -- AgentCore (called from gRPC threads) -------------------------------------------------------

    def node_id(self) -> str:
        return self.config.node_id

    def dropping_peers(self) -> bool:
        return self._drop_peers.is_set()

    def round_number(self) -> int:
        with self._lock:
            return self._state.round.number if self._state.round else 0

    def round_number_nowait(self) -> int:
        """The current round without taking the agent's lock (for log context: logging must
        never wait on the agent)."""
        rnd = self._state.round
        return rnd.number if rnd is not None else 0

    def worker_hello(self, hello: HelloEvent) -> None:
        node = self.config.node_id
        if hello.spare:
            if (self.spare_pool.warm if hello.warm else self.spare_pool.ready)(hello.pid):
                log.info("agent %s: spare (pid %d) %s", node, hello.pid, "warm" if hello.warm else "connected",
                         extra={"node": node})
                self._spare_metrics()
            else:
                log.warning("agent %s: pid %d says it is a spare but is not one of ours", node, hello.pid,
                            extra={"node": node})
            return
        if self.spare_pool.is_spare(hello.pid):
            # A spare that did not say so: the command ignores STALWART_SPARE=1 and would train as
            # a rank it was never given. Stop the spares rather than let them spin.
            doomed = self.spare_pool.disable(f"spare pid {hello.pid} said Hello as rank {hello.rank}: the command "
                                             "does not support STALWART_SPARE=1 (AgentClient.wait_for_assignment)")
            for w in doomed:
                w.kill()
            return
        log.info("agent %s: rank %d (pid %d) connected for round %d", node, hello.rank, hello.pid, hello.round,
                 extra={"node": node, "rank": hello.rank, "round": hello.round})
        now = time.monotonic()
        with self._lock:
            if hello.can_reform:
                self._state.can_reform.add(hello.pid)
            else:
                self._state.can_reform.discard(hello.pid)
            pending = self._state.pending.get(hello.pid)
            acked = pending is not None and hello.round >= pending.round and hello.rank == pending.rank
            if acked:
                assert pending is not None
                del self._state.pending[hello.pid]
                self.stalls.started(hello.rank, now)  # the first step after a re-form gets its allowance
            p = self._state.progress.setdefault(hello.rank, _Progress(busy=deque(maxlen=self.config.busy_window)))
            p.local_rank = hello.local_rank
        if pending is not None and acked:
            self.metrics.reforms.labels(node, "acknowledged").inc()
            self.metrics.reform_seconds.labels(node).set(now - pending.sent)
            log.info("agent %s: rank %d (pid %d) re-formed into round %d in %.3f s", node, hello.rank, hello.pid,
                     hello.round, now - pending.sent, extra={"node": node, "rank": hello.rank, "round": hello.round})
        elif pending is not None and hello.round >= pending.round:
            log.error("agent %s: pid %d acknowledged round %d as rank %d, but was told rank %d", node, hello.pid,
                      hello.round, hello.rank, pending.rank, extra={"node": node, "round": hello.round})

    def worker_step(self, event: StepEvent) -> None:
        with self._lock:
            rnd = self._state.round
            if event.round and rnd is not None and event.round < rnd.number:
                return  # a kept worker still in its old world: its rank there is not its rank now
            now = time.monotonic()
            self.stalls.step(event.rank, event.step, event.step_time, now)
            p = self._state.progress.setdefault(event.rank, _Progress(busy=deque(maxlen=self.config.busy_window)))
            p.step, p.step_time, p.at = event.step, event.step_time, event.at
            p.busy.append(event.busy_time)
            since, after = self._step_clock.get(event.rank, (now, ""))
            self._step_clock[event.rank] = (now, "")
            group = self._state.group
            # one rank per node counts, so that a node's lost time is not counted once per worker
            lost = lost_before_step(now - since, self.stalls.typical(event.rank), after) \
                if group is not None and event.rank == group.assignment.first_rank else None
        self.metrics.step(event.rank, event.step, event.step_time)
        if lost is not None:
            self.metrics.badput.labels(self.config.node_id, lost[0]).inc(lost[1])

    def worker_goodbye(self, pid: int, reason: str) -> None:
        """Kept for an adopted worker, whose exit status this agent cannot read."""
        with self._lock:
            group = self._state.group
            for w in group.workers if group is not None else []:
                if w.pid == pid:
                    w.goodbye = reason

    def worker_checkpoint(self, rank: int, step: int, path: str, committed: bool) -> None:
        log.info("agent %s: rank %d checkpoint at step %d %s", self.config.node_id, rank, step,
                 "committed" if committed else "started")
        if not committed:
            return
        with self._lock:
            if self._state.committed_step is None or step > self._state.committed_step:
                self._state.committed_step = step
        self.metrics.checkpoint_time.labels(self.config.node_id).set(time.time())
        if rank != 0:
            return  # one commit record per checkpoint, from the agent of rank 0
        with self._lock:
            rnd = self._state.round
        record = records_pb2.CheckpointRecord(step=step, path=path, world_size=rnd.world_size if rnd else 0,
                                              round=rnd.number if rnd else 0, committed_at=time.time())
        with self._lock:
            self._unrecorded[step] = record
        # Not on this (the progress stream's) thread: an etcd without quorum would hold up the
        # worker's step reports behind it, and the stall detector would take it for a hang.
        threading.Thread(target=self._record_checkpoints, daemon=True, name="agent-ckpt-record").start()

    def _record_checkpoints(self) -> None:
        """Write the commit records etcd has not taken yet (it had no quorum): the checkpoints
        are committed on storage all the same, and the daemon learns of them once etcd is back."""
        with self._lock:
            waiting = sorted(self._unrecorded.items())
        for step, record in waiting:
            try:
                self.client.create(self.keys.ckpt(step), record.SerializeToString())
            except CoordError as exc:
                log.error("agent %s: cannot record checkpoint %d in etcd yet (%s); retrying", self.config.node_id,
                          step, exc, extra={"node": self.config.node_id})
                return
            with self._lock:
                self._unrecorded.pop(step, None)

    def status(self) -> agent_pb2.NodeStatus:
        slowdowns = self.slowdowns()
        stragglers = self.local_stragglers()
        with self._lock:
            group, rnd = self._state.group, self._state.round
            workers = []
            if group is not None:
                for w in group.workers:
                    p = self._state.progress.get(w.rank, _Progress())
                    state = agent_pb2.WORKER_RUNNING if w.running else (
                        agent_pb2.WORKER_SUCCEEDED if w.exit and w.exit.kind is ExitKind.SUCCESS
                        else agent_pb2.WORKER_FAILED)
                    if w.running and w.pid in self._state.pending:
                        state = agent_pb2.WORKER_REFORMING
                    workers.append(agent_pb2.WorkerStatus(
                        local_rank=w.local_rank, rank=w.rank, pid=w.pid, state=state, last_step=max(p.step, 0),
                        exit_code=w.exit.returncode if w.exit else 0, exit_reason=w.exit.reason if w.exit else "",
                        slowdown=slowdowns.get(w.local_rank, 0.0), busy_time=p.busy_median(),
                        straggler=w.local_rank in stragglers, round=w.round, reformed=w.reformed))
            draining = self._state.draining
        node = records_pb2.NodeRecord(node_id=self.config.node_id, address=self.address, devices=self.config.workers,
                                      cordoned=draining)
        spares = [agent_pb2.SpareStatus(pid=s.pid, ready=s.warm, age=s.age) for s in self.spare_pool.status()]
        return agent_pb2.NodeStatus(node=node, health=self._health_record(), round=rnd.number if rnd else 0,
                                    workers=workers, draining=draining, spares=spares,
                                    spares_disabled=self.spare_pool.disabled)

    def drain(self, wait: bool, timeout: float) -> tuple[bool, str]:
        """Cordon this node so the daemon leaves it out of the next round, then stop the workers
        (SIGTERM first: the trainer takes its last checkpoint on SIGTERM)."""
        with self._lock:
            self._state.draining = True
        kv = self.client.get(self.keys.node(self.config.node_id))
        if kv is not None:
            record = records_pb2.NodeRecord.FromString(kv.value)
            record.cordoned = True
            self.client.put(self.keys.node(self.config.node_id), record.SerializeToString(), lease=kv.lease)
        self._commands.put(("stop-workers", "draining"))
        if not wait:
            return False, "draining"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._state.group is None or not self._state.group.running:
                    return True, "drained: workers stopped"
            time.sleep(0.05)
        return False, f"workers still running after {timeout:g} s"

    def inject_fault(self, kind: str, device: int, code: int, step: int = 0, factor: float = 0.0) -> str:
        if not self.config.fault_injection:
            raise FaultRefused("fault injection is disabled in this agent's configuration (fault_injection = false)")
        if kind in ("nan-loss", "loss-spike"):
            return self._inject_training_fault(kind, device, step, factor)
        if kind == "slow-worker":
            return self._slow_worker(device, factor)
        if kind == "clear":
            self._clear_throttles()
        if kind == "drop-peers":
            self._drop_peers.set()
            self.metrics.faults.labels(self.config.node_id, "injected-drop-peers").inc()
            return "dropping peer traffic: not answering peers' probes, not reaching them"
        if kind == "clear":
            self._drop_peers.clear()
        if kind == "gpu-hang":
            if not isinstance(self.probe, FakeProbe):
                raise FaultRefused(f"GPU faults can only be injected with the fake probe, not {self.probe.name}")
            self.probe.hang()  # the monitor loop's next sample hangs; the rest of the agent reads the last one
            self.metrics.faults.labels(self.config.node_id, "injected-gpu-hang").inc()
            return "the GPU probe's polls hang until cleared"
        if kind in ("gpu-xid", "gpu-ecc-dbe", "gpu-lost", "clear"):
            if not isinstance(self.probe, FakeProbe):
                if kind == "clear":
                    return "cleared injected faults"
                raise FaultRefused(f"GPU faults can only be injected with the fake probe, not {self.probe.name}")
            if kind == "clear":
                self.probe.clear()
                with self._lock:
                    self._state.worker_findings = []
                detail = "cleared injected faults"
            else:
                fake = {"gpu-xid": "xid", "gpu-ecc-dbe": "ecc-dbe", "gpu-lost": "gpu-lost"}[kind]
                try:
                    finding = self.probe.inject(fake, device, code)
                except ValueError as exc:
                    raise FaultRefused(str(exc)) from exc
                detail = f"injected {finding.code} on device {device} ({finding.severity.name.lower()})"
                self.metrics.faults.labels(self.config.node_id, f"injected-{finding.code}").inc()
            self._poll_probe()
            self._publish_health(force=True)
            return detail
        sig = {"kill-worker": signal.SIGKILL, "hang-worker": signal.SIGSTOP}[kind]
        with self._lock:
            group = self._state.group
        if group is None or not group.signal(device, sig):
            raise FaultRefused(f"no running worker with local rank {device}")
        return f"sent {sig.name} to local rank {device}"

    def _running_worker(self, local_rank: int) -> tuple[int, int]:
        """(rank, pid) of the running worker of ``local_rank``; raises FaultRefused."""
        with self._lock:
            group = self._state.group
            w = group.worker(local_rank) if group is not None else None
            if w is None or not w.running:
                raise FaultRefused(f"no running worker with local rank {local_rank}")
            return w.rank, w.pid

    def _inject_training_fault(self, kind: str, local_rank: int, step: int, factor: float) -> str:
        """Pass a NaN-loss or loss-spike injection to the worker's trainer over its progress stream."""
        rank, _ = self._running_worker(local_rank)
        if kind == "loss-spike" and not factor > 0:
            raise FaultRefused(f"loss-spike needs a factor > 0 (got {factor:g})")
        command = agent_pb2.AgentCommand(inject_fault=agent_pb2.InjectTrainingFault(
            kind="nan" if kind == "nan-loss" else "spike", step=step, factor=factor))
        if not self.channels.send(local_rank, command):
            raise FaultRefused(f"the worker with local rank {local_rank} is not connected to the agent")
        self.metrics.faults.labels(self.config.node_id, f"injected-{kind}").inc()
        log.warning("agent %s: injected %s into rank %d at step %d (factor %g)", self.config.node_id, kind, rank,
                    step, factor, extra={"node": self.config.node_id, "rank": rank, "step": step})
        return f"sent {kind} at step {step} (factor {factor:g}) to local rank {local_rank}"

    def _slow_worker(self, local_rank: int, factor: float) -> str:
        rank, pid = self._running_worker(local_rank)
        try:
            spec = ThrottleSpec(factor, self.config.slow_worker_period)
        except ValueError as exc:
            raise FaultRefused(str(exc)) from None
        with self._lock:
            old = self._throttles.pop(local_rank, None)
            self._throttles[local_rank] = Throttle(pid, spec, rank=rank)
        if old is not None:
            old.stop()
        self.metrics.faults.labels(self.config.node_id, "injected-slow-worker").inc()
        log.warning("agent %s: slowing rank %d down %gx", self.config.node_id, rank, factor,
                    extra={"node": self.config.node_id, "rank": rank})
        return f"slowing local rank {local_rank} down {factor:g}x (SIGSTOP/SIGCONT every {spec.period:g} s)"

    def _clear_throttles(self, keep: dict[int, int] | None = None) -> None:
        """Stop the injected slow-downs, but those of ``keep`` (local rank -> pid still there)."""
        keep = keep or {}
        with self._lock:
            ending = {lr: t for lr, t in self._throttles.items() if keep.get(lr) != t.pgid}
            for lr in ending:
                del self._throttles[lr]
        for t in ending.values():
            t.stop()

    def slowdowns(self) -> dict[int, float]:
        with self._lock:
            return {lr: t.spec.factor for lr, t in self._throttles.items() if t.alive}


def _kill_group(pid: int) -> None:
    """SIGKILL a left-over worker's process group (it belongs to no round this node is in)."""
    try:
        os.killpg(pid, signal.SIGKILL)
        os.killpg(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass


def _frozen(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def _proc_state(pid: int) -> ProcState:
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return ProcState.EXITED
    if status == psutil.STATUS_STOPPED:
        return ProcState.STOPPED
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return ProcState.EXITED
    return ProcState.RUNNING


def _stopped(group: WorkerGroup, rank: int) -> bool:
    """Is this rank's process stopped (SIGSTOP, a debugger), rather than blocked or busy?"""
    return any(w.rank == rank and w.running and _frozen(w.pid) for w in group.workers)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""
