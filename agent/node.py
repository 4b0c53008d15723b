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

:class:`NodeAgent` is made of parts by job, each a mixin in a module of its own: ``rounds.py``
(following the rounds, re-forming in place), ``replacing.py`` (spares, readiness to join, worker
exits), ``monitoring.py`` (health, stalls, peers, progress), ``api.py`` (what the gRPC servers
call) and ``succession.py`` (adopting the workers of the agent before, the state file); the
records they share are in ``state.py``. This module keeps construction, registration, the main
loop and stopping.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from importlib import metadata

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stalwart.agent.adopt import clear_state, state_path
from stalwart.agent.api import AgentApiMixin
from stalwart.agent.config import AgentConfig
from stalwart.agent.health import Finding, HealthProbe, make_probe
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.monitoring import MonitoringMixin
from stalwart.agent.preload import Preloader, parse_command
from stalwart.agent.priority import can_restore_priority
from stalwart.agent.replacing import ReplacingMixin
from stalwart.agent.rounds import RoundsMixin
from stalwart.agent.service import WorkerChannels, start_node_server, start_progress_server
from stalwart.agent.spares import SparePool
from stalwart.agent.stall import StallDetector, StallPolicy
from stalwart.agent.state import NodeState
from stalwart.agent.succession import SuccessionMixin
from stalwart.agent.throttle import Throttle
from stalwart.agent.workers import RANK_ENV, WorkerExit
from stalwart.coord.client import EtcdClient
from stalwart.coord.errors import CoordError, EtcdUnavailable
from stalwart.coord.keys import JobKeys
from stalwart.coord.lease import Lease
from stalwart.coord.txn import Put
from stalwart.coord.watch import Watch
from stalwart.proto import records_pb2
from stalwart.proto.contract import ENV_NODE, ENV_SOCKET

log = logging.getLogger(__name__)
ADOPTED_WAIT_S = 3.0  # a restarted agent waits this long at most for its adopted spares and workers to reconnect


class NodeAgent(SuccessionMixin, RoundsMixin, ReplacingMixin, MonitoringMixin, AgentApiMixin):
    """One node's agent. ``start()`` brings up servers and registration; ``run()`` is the main loop."""

    def __init__(self, config: AgentConfig, *, client: EtcdClient | None = None,
                 probe: HealthProbe | None = None) -> None:
        self.config = config
        self.keys = JobKeys(config.job)
        self.client = client or EtcdClient(config.etcd)
        self.probe = probe or make_probe(config.probe, config.workers)
        self.stalls = StallDetector(StallPolicy(config.stall_floor, config.stall_factor, config.stall_first_step,
                                                 frozen_after=config.stall_frozen_after))
        self._state = NodeState()
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
        self.preloader: Preloader | None = None  # the preload process workers are forked from (preload.py)

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
        carried = self._carry_on_lease()  # first: it runs out while the rest of the start takes its time
        beside_training = self._left_live_workers()
        self._start_preload(beside_training)  # its imports run while the rest of the start takes its time
        self._servers.append(start_progress_server(self.config.socket_path, self, self.channels))
        add_health = lambda server: health_pb2_grpc.add_HealthServicer_to_server(  # noqa: E731
            self._health_service, server)
        server, self.port = start_node_server(self.config, self, extra=[add_health])
        self._servers.append(server)
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_bind_host)
        if cancel is not None and not self._wait_for_etcd(cancel):
            if carried is not None:
                carried.stop()
            return False
        self._catch_up_round()  # whether this node may join warm, before it registers
        self._adopt()
        if carried is None and self._state.group is None and not self.spare_pool.workers():
            self._await_preload()  # a fresh start: the first round's workers can be forked
        elif self.preloader is not None and self.config.spare_nice and can_restore_priority():
            self.preloader.lower_priority(self.config.spare_nice)  # beside training workers: yield to them
        self._register(carried)
        self._save_state()
        self._await_adopted(ADOPTED_WAIT_S)
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

    def _start_preload(self, beside_training: bool = False) -> None:
        """``beside_training``: workers left by the agent before still train, so it imports niced
        (``spare_nice``) from the start, not only once they are adopted."""
        target = parse_command(self.config.command) if self.config.preload else None
        if target is None:
            return
        env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
        env.update(self._worker_env())
        self.preloader = Preloader(target, self.config.preload, self.config.log_dir / "preload.log", env,
                                   self.config.cwd)
        try:
            self.preloader.start()
            if beside_training and self.config.spare_nice and can_restore_priority():
                self.preloader.lower_priority(self.config.spare_nice)
        except OSError as exc:
            log.warning("agent %s: cannot start the preload process (%s); workers are started cold",
                        self.config.node_id, exc, extra={"node": self.config.node_id})
            self.preloader = None

    def _await_preload(self) -> None:
        """Register once the preload process can fork (its imports done), so the first round's
        workers do not import beside it; at most ``preload_wait`` seconds."""
        if self.preloader is None:
            return
        t0 = time.monotonic()
        ready = self.preloader.wait_ready(self.config.preload_wait)
        log.info("agent %s: preload process %s after %.2f s", self.config.node_id,
                 "ready" if ready else f"not ready ({self.preloader.error or 'timed out'}): workers start cold",
                 time.monotonic() - t0, extra={"node": self.config.node_id})

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

    def _on_lease_lost(self, why: str) -> None:
        self._commands.put(("lease-lost", why))  # the main loop registers again

    def _register(self, lease: Lease | None = None) -> None:
        """Write the node and health records under ``lease`` (the one carried on from the agent
        before), or under a new one."""
        if lease is None or not lease.alive:
            lease = Lease(self.client, self.config.lease_ttl, on_lost=self._on_lease_lost)
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
        """Read the newest round before registering, so the health record that goes out with the
        registration says whether the node can join warm. Registering again (the lease was lost: a
        cut link, etcd out of reach), the world has most likely moved on without this node; one
        computed from the round it was last in says "ready", and the daemon would admit a node
        that must start cold. A malformed round is reported when the watch brings it."""
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
            self._close_preload()
            return
        self._stop_workers("agent shutting down", wait=True)
        self.spare_pool.stop_all(self.config.stop_grace)
        self._close_preload()
        clear_state(self._state_file)

    def _close_preload(self) -> None:
        if self.preloader is not None:
            self.preloader.close()

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


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""
