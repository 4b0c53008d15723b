"""What the daemon shows the outside: Prometheus metrics, the gRPC health service, systemd.

- :class:`Metrics` keeps its own registry (several daemons can live in one test process) and
  serves ``/metrics`` over HTTP when given a port.
- :class:`HealthService` is the standard ``grpc.health.v1.Health`` service: the empty service
  name is SERVING while the daemon runs; :data:`LEADER_SERVICE` is SERVING only on the leader,
  so a load balancer or a probe can find it.
- :class:`SystemdNotifier` speaks systemd's notify protocol by hand (one datagram per message on
  the unix socket named by ``NOTIFY_SOCKET``), so readiness and the watchdog need no library.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["LEADER_SERVICE", "HealthService", "Metrics", "SystemdNotifier"]

log = logging.getLogger(__name__)

LEADER_SERVICE = "stalwart.daemon.Leader"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """The daemon's Prometheus metrics (names start with ``stalwart_daemon_``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.leader = Gauge("stalwart_daemon_leader", "1 while this daemon leads its job", registry=r)
        self.round = Gauge("stalwart_daemon_round", "number of the newest round", registry=r)
        self.world_nodes = Gauge("stalwart_daemon_world_nodes", "nodes in the current round", registry=r)
        self.world_workers = Gauge("stalwart_daemon_world_workers", "workers (ranks) in the current round",
                                   registry=r)
        self.nodes = Gauge("stalwart_daemon_nodes", "known nodes by state", ["state"], registry=r)
        self.decisions = Counter("stalwart_daemon_decisions", "decisions written, by kind", ["kind"], registry=r)
        self.events = Counter("stalwart_daemon_events", "events fed to the round machine", registry=r)
        self.ignored = Counter("stalwart_daemon_ignored_values", "etcd values ignored (malformed, unknown node)",
                               ["kind"], registry=r)
        self.fault_to_round = Histogram(
            "stalwart_daemon_fault_to_round_seconds",
            "from the watch event that showed a member's fault to the new round's write",
            buckets=_RECOVERY_BUCKETS, registry=r)
        self.etcd_latency = Histogram("stalwart_daemon_etcd_request_seconds", "etcd requests of the daemon",
                                      ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.pruned = Counter("stalwart_daemon_pruned_ckpt_records", "checkpoint commit records deleted from etcd "
                              "(older than the newest keep_ckpt_records)", registry=r)
        self.compacted = Gauge("stalwart_daemon_compacted_revision", "etcd revision this daemon last compacted to",
                               registry=r)
        self.terms = Counter("stalwart_daemon_terms", "times this daemon became leader", registry=r)
        # the job's goodput and what its faults cost (daemon/goodput.py), as the leader sees them
        self.goodput = Gauge("stalwart_daemon_goodput_ratio", "productive training time over elapsed time since "
                             "the job's first round (steps trained again after a rollback are badput)", registry=r)
        self.productive = Gauge("stalwart_daemon_productive_seconds", "the job's useful steps at its typical step time",
                                registry=r)
        self.elapsed = Gauge("stalwart_daemon_elapsed_seconds", "seconds since the job's first round opened",
                             registry=r)
        self.job_step = Gauge("stalwart_daemon_job_step", "newest training step any member reported", registry=r)
        self.step_time = Gauge("stalwart_daemon_step_seconds", "typical seconds per step (median of recent reports)",
                               registry=r)
        self.progress_time = Gauge("stalwart_daemon_last_progress_timestamp_seconds",
                                   "unix time the job's newest step last advanced", registry=r)
        self.ckpt_step = Gauge("stalwart_daemon_committed_step", "step of the newest committed checkpoint",
                               registry=r)
        self.ckpt_time = Gauge("stalwart_daemon_last_checkpoint_timestamp_seconds",
                               "unix time the newest checkpoint's commit was seen (time() minus this: its age)",
                               registry=r)
        self.member_faults = Counter("stalwart_daemon_member_faults", "faults of round members, by kind (lease-lost, "
                                     "unhealthy, worker-failed; left and drained are planned)", ["kind"], registry=r)
        self.fault_cost = Histogram("stalwart_daemon_fault_cost_seconds", "training time one member fault cost the "
                                    "job (until it passed its step again)", buckets=_RECOVERY_BUCKETS, registry=r)
        self.quarantines = Counter("stalwart_daemon_quarantines", "nodes this leader quarantined", registry=r)
        self.hook_runs = Counter("stalwart_daemon_hook_runs", "on_quarantine command runs, by outcome (ok, failed, "
                                 "timeout)", ["outcome"], registry=r)
        self.lost_throughput = Gauge("stalwart_daemon_lost_throughput_ratio", "1 - workers in the current round / "
                                     "most workers of any round of this leader (throughput lost to a smaller world)",
                                     registry=r)
        for kind in ("lease-lost", "unhealthy", "worker-failed", "left", "drained"):
            self.member_faults.labels(kind)
        for outcome in ("ok", "failed", "timeout"):
            self.hook_runs.labels(outcome)
        self.straggler = Gauge("stalwart_daemon_straggler", "1 while the node is a straggler (busy time per step "
                               "over straggler_factor x the others' median)", ["node"], registry=r)
        self.busy = Gauge("stalwart_daemon_straggler_busy_seconds",
                          "busy seconds per step (outside collectives) of a straggling node", ["node"], registry=r)

    def serve(self, host: str, port: int) -> None:
        """Serve ``/metrics`` on ``host:port`` in a background thread."""
        start_http_server(port, addr=host, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", host, port)


class HealthService:
    """The standard gRPC health service on ``host:port`` (see the module docstring)."""

    def __init__(self, host: str, port: int) -> None:
        self._servicer = health.HealthServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-health"))
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"gRPC health service: cannot listen on {host}:{port}")
        self.port = bound
        self._server.start()
        self._servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self.set_leader(False)
        log.info("gRPC health service on %s:%d", host, bound)

    def set_leader(self, leading: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if leading else health_pb2.HealthCheckResponse.NOT_SERVING
        self._servicer.set(LEADER_SERVICE, status)

    def stop(self) -> None:
        self._servicer.enter_graceful_shutdown()
        self._server.stop(grace=0.5)


class SystemdNotifier:
    """sd_notify without libsystemd. Does nothing when not started by systemd.

    ``watchdog_interval`` is half of what systemd asked for (``WATCHDOG_USEC``), or None when
    the unit has no watchdog; the daemon's main loop calls :meth:`watchdog` at least that often,
    so a hung loop (not just a dead process) gets the daemon restarted.
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address: str | None = None
        if address.startswith("@"):
            self._address = "\0" + address[1:]  # abstract namespace
        elif address.startswith("/"):
            self._address = address
        self.watchdog_interval: float | None = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 2e6
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._last_watchdog = -float("inf")

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields in one datagram; False when not under systemd or on error."""
        if self._address is None:
            return False
        data = "\n".join(fields).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # Never block the main loop on a reader that does not keep up.
                self._sock.sendto(data, socket.MSG_DONTWAIT, self._address)
                return True
            except BlockingIOError:
                log.debug("sd_notify %s dropped: the notify socket is full", fields)
                return False
            except OSError as exc:
                log.warning("sd_notify %s failed: %s", fields, exc)
                return False

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def watchdog(self) -> None:
        """Tell systemd the main loop is alive; rate-limited to ``watchdog_interval``."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_interval:
            self._last_watchdog = now
            self.notify("WATCHDOG=1")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
