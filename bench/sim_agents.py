"""Simulated node agents for the control-plane benches: many nodes per process, batched clients.

Each simulated node does to etcd what a real agent does (``stalwart.agent.node``), at the same
cadence unless told otherwise:

- registers: its own lease (TTL ``ttl``), a node record bound to it and a health record;
- keeps its lease alive every ``ttl / 3`` (``coord.lease``), here many leases over one
  keep-alive stream per call (``EtcdClient.keepalive_many``);
- writes its progress record every ``progress_interval`` (5 s: the agent's rate limit) while it
  is a member of the current round, naming that round (the daemon ignores other rounds'), here
  up to 100 nodes' records per transaction (``EtcdClient.put_many``);
- rewrites health only when it changes (the agent writes on change), so not in steady state;
- watches the round key (every agent does) to learn the round and whether it is a member.

Writes are spread evenly over each interval in slices, as independent agents' timers would be.
A node can die silently (its keep-alives stop: etcd expires the lease a TTL later), be revoked
(what a planned stop does) or register again. One process runs a :class:`SimNodes`;
:class:`Fleet` drives several of them over pipes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

SLICES = 10  # writes of one interval go out in this many evenly spaced slices


class SimNodes:
    """The nodes of one process. Thread-safe; the timers run on two threads of their own."""

    def __init__(self, endpoints: list[str], job: str, ttl: int, progress_interval: float, seed: int) -> None:
        from stalwart.coord.client import EtcdClient
        from stalwart.coord.config import EtcdConfig
        from stalwart.coord.keys import JobKeys

        self.client = EtcdClient(EtcdConfig(endpoints=tuple(endpoints), timeout=60.0, attempt_timeout=20.0))
        self.keys = JobKeys(job)
        self.ttl, self.progress_interval = ttl, progress_interval
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.leases: dict[str, int] = {}  # live nodes (keep-alive running)
        self.last_ack: dict[str, float] = {}  # wall time of the last keep-alive answer per node
        self.steps: dict[str, int] = {}
        self.round, self.members = 0, frozenset[str]()
        self.counts = {"puts": 0, "keepalives": 0, "errors": 0}
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(16)
        self._watch_thread = threading.Thread(target=self._watch_round, daemon=True)
        self._watch_thread.start()
        self._threads = [threading.Thread(target=self._every, args=(max(self.ttl / 3.0, 0.2), self._keepalive),
                                          daemon=True),
                         threading.Thread(target=self._every, args=(progress_interval, self._progress), daemon=True)]
        for t in self._threads:
            t.start()

    # --- commands ---------------------------------------------------------------------------

    def register(self, nodes: list[str]) -> dict[str, int]:
        from stalwart.proto import records_pb2

        leases = list(self.pool.map(lambda _: self.client.grant(self.ttl), nodes))
        now = time.time()
        items = []
        for node, lease in zip(nodes, leases, strict=True):
            rec = records_pb2.NodeRecord(node_id=node, address=f"{node}:7077", devices=8, hostname=node,
                                         registered_at=now)
            health = records_pb2.HealthRecord(node_id=node, state=records_pb2.HEALTH_OK, checked_at=now)
            items += [(self.keys.node(node), rec.SerializeToString(), lease),
                      (self.keys.health(node), health.SerializeToString(), lease)]
        self.client.put_many(items)
        with self.lock:
            self.counts["puts"] += len(items)
            for node, lease in zip(nodes, leases, strict=True):
                self.leases[node], self.last_ack[node] = lease, now
                self.steps.setdefault(node, 0)
        return dict(zip(nodes, leases, strict=True))

    def silence(self, nodes: list[str]) -> dict[str, float]:
        """Stop the nodes' keep-alives (a node that died): returns each one's last answered
        keep-alive (wall time); etcd deletes its keys about a TTL after that."""
        with self.lock:
            for node in nodes:
                self.leases.pop(node, None)
            return {node: self.last_ack.get(node, 0.0) for node in nodes}

    def revoke(self, nodes: list[str]) -> None:
        with self.lock:
            leases = [self.leases.pop(node) for node in nodes if node in self.leases]
        list(self.pool.map(self.client.revoke, leases))

    def stats(self) -> dict[str, Any]:
        import psutil

        me = psutil.Process()
        with self.lock:
            return {**self.counts, "live": len(self.leases), "round": self.round, "rss": me.memory_info().rss,
                    "fds": me.num_fds()}

    def close(self) -> None:
        self.stop.set()
        for t in [*self._threads, self._watch_thread]:
            t.join(5)
        self.pool.shutdown()
        self.client.close()

    # --- timers -----------------------------------------------------------------------------

    def _every(self, interval: float, send: Callable[[int], None]) -> None:
        """Call ``send(slice)`` SLICES times per interval, evenly spaced, at a random phase."""
        slice_s = interval / SLICES
        i = 0
        next_at = time.monotonic() + self.rng.uniform(0, slice_s)
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            try:
                send(i % SLICES)
            except Exception:  # noqa: BLE001 - keep the timer going: a real agent retries too
                with self.lock:
                    self.counts["errors"] += 1
            i += 1
            next_at += slice_s
            if next_at < time.monotonic() - interval:  # fell far behind (a loaded machine): skip ahead
                next_at = time.monotonic()

    def _slice(self, which: int) -> list[tuple[str, int]]:
        with self.lock:
            return [(n, lease) for n, lease in self.leases.items() if hash(n) % SLICES == which]

    def _keepalive(self, which: int) -> None:
        part = self._slice(which)
        if not part:
            return
        ttls = self.client.keepalive_many([lease for _, lease in part], timeout=self.ttl)
        now = time.time()
        lost = []
        with self.lock:
            self.counts["keepalives"] += len(part)
            for node, lease in part:
                if ttls.get(lease, 0) > 0:
                    self.last_ack[node] = now
                elif self.leases.get(node) == lease:  # expired under us (a loaded machine)
                    lost.append(node)
            self.counts["relost"] = self.counts.get("relost", 0) + len(lost)
        if lost:  # as an agent does: it registers again with a new lease
            self.register(lost)

    def _progress(self, which: int) -> None:
        from stalwart.proto import records_pb2

        with self.lock:
            rnd, members = self.round, self.members
        part = [(n, lease) for n, lease in self._slice(which) if n in members]
        if not part or not rnd:
            return
        now = time.time()
        items = []
        for node, lease in part:
            self.steps[node] += 10  # ten steps per progress interval
            rec = records_pb2.ProgressRecord(node_id=node, round=rnd, step=self.steps[node], step_time=0.5,
                                             reported_at=now, busy_time=self.rng.uniform(0.40, 0.45))
            items.append((self.keys.progress(node), rec.SerializeToString(), lease))
        self.client.put_many(items, timeout=self.progress_interval * 2)
        with self.lock:
            self.counts["puts"] += len(items)

    def _watch_round(self) -> None:
        from stalwart.coord.watch import Watch
        from stalwart.proto import records_pb2

        kv = self.client.get(self.keys.round)
        if kv is not None:
            self._set_round(records_pb2.RoundRecord.FromString(kv.value))
        with Watch(self.client, self.keys.round, kv.mod_revision + 1 if kv else 0) as watch:
            while not self.stop.is_set():
                try:
                    batch = watch.get(timeout=0.5)
                except Exception:  # noqa: BLE001 - compacted or closed: read the round again
                    if self.stop.is_set():
                        return
                    batch, kv = [], self.client.get(self.keys.round)
                    if kv is not None:
                        self._set_round(records_pb2.RoundRecord.FromString(kv.value))
                    watch.close()
                    watch = Watch(self.client, self.keys.round, kv.mod_revision + 1 if kv else 0)
                for ev in batch:
                    if ev.value:
                        self._set_round(records_pb2.RoundRecord.FromString(ev.value))

    def _set_round(self, rec: Any) -> None:
        members = frozenset(m.node_id for m in rec.members)
        with self.lock:
            self.round, self.members = rec.number, members


def _serve(conn: Connection, endpoints: list[str], job: str, ttl: int, progress_interval: float, seed: int) -> None:
    nodes = SimNodes(endpoints, job, ttl, progress_interval, seed)
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "close":
            nodes.close()
            conn.send(None)
            return
        conn.send(getattr(nodes, cmd)(arg) if arg is not None else getattr(nodes, cmd)())


class Fleet:
    """Simulated nodes spread over ``processes`` processes (each with one etcd client)."""

    def __init__(self, endpoints: list[str], job: str, processes: int, ttl: int, progress_interval: float = 5.0,
                 seed: int = 1) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.owner: dict[str, int] = {}
        for i in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, endpoints, job, ttl, progress_interval, seed + i),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a simulated-agent process did not start")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _each(self, cmd: str, nodes: list[str] | None) -> list[Any]:
        if nodes is None:
            for c in self.conns:
                c.send((cmd, None))
            return [c.recv() for c in self.conns]
        parts: list[list[str]] = [[] for _ in self.conns]
        for n in nodes:
            parts[self.owner.setdefault(n, len(self.owner) % len(self.conns))].append(n)
        for c, part in zip(self.conns, parts, strict=True):
            c.send((cmd, part))
        return [c.recv() for c in self.conns]

    def register(self, nodes: list[str]) -> None:
        self._each("register", nodes)

    def silence(self, nodes: list[str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for part in self._each("silence", nodes):
            out.update(part)
        return out

    def revoke(self, nodes: list[str]) -> None:
        self._each("revoke", nodes)

    def stats(self) -> dict[str, Any]:
        parts = self._each("stats", None)
        out: dict[str, Any] = {k: sum(p.get(k, 0) for p in parts)
                               for k in ("puts", "keepalives", "errors", "live", "rss", "fds", "relost")}
        out["rss_max"] = max(p["rss"] for p in parts)
        out["fds_max"] = max(p["fds"] for p in parts)
        return out

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close", None))
                c.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def rss_and_fds(pid: int) -> tuple[int, int]:
    import psutil

    p = psutil.Process(pid)
    return int(p.memory_info().rss), int(p.num_fds())


def scrape(url: str, *metrics: str) -> dict[str, float]:
    """Sums of the named Prometheus metrics (every label set) at ``url``."""
    import urllib.request

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = dict.fromkeys(metrics, 0.0)
    for line in body.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def load() -> float:
    return os.getloadavg()[0]
