"""Rendezvous at scale: N simulated nodes against one local etcd and a real ``stalwart daemon``.

For each N (default 1,000, 5,000 and 10,000):

1. start ``stalwart daemon`` (a separate process, ``max_nodes = N``, so the first round opens as
   soon as all N are registered) and wait until it leads;
2. register N nodes, each with its own lease (granted in parallel by worker processes, each
   with its own etcd client and a thread pool) -> **time to the first round**: from the first
   grant to the round record with N members appearing in etcd (also shown: the part after the
   last registration, i.e. what the daemon adds);
3. revoke the leases of 1 % of the nodes at once (a seeded random choice) -> **time to the next
   round**: from the first revoke to a round record without them;
4. the daemon's CPU time (user + system) and etcd's requests per second (all clients, from
   etcd's own ``grpc_server_handled_total``) over steps 2-3.

Revoking stands in for nodes dying: etcd then deletes the node keys at once, as it does when a
lease expires, so "lease TTL + this" is the time from a silent node's death to a new round
(etcd expires a lease at most a TTL after its last refresh). Leases are granted with a TTL long
enough that the N leases need no keep-alive during a run.

    .venv/bin/python bench/rendezvous_bench.py                    # 1k, 5k, 10k
    .venv/bin/python bench/rendezvous_bench.py --sizes 1000 --workers 2

Prints a table and writes JSON to bench/results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Result:
    nodes: int
    register_s: float
    first_round_s: float
    first_round_after_last_registration_s: float
    killed: int
    next_round_s: float
    daemon_cpu_s: float
    daemon_cpu_form_s: float
    daemon_cpu_kill_s: float
    etcd_requests: int
    etcd_requests_per_s: float
    daemon_etcd_requests: int
    round_record_bytes: int


# --- worker processes: simulated agents, many per process --------------------------------------


def _register(client: object, keys: object, ttl: int, node: str) -> int:
    """One simulated agent: its own lease, its node key bound to it."""
    from stalwart.proto import records_pb2

    lease = client.grant(ttl)  # type: ignore[attr-defined]
    rec = records_pb2.NodeRecord(node_id=node, address=f"{node}:7077", devices=8, hostname=node,
                                 registered_at=time.time())
    client.put(keys.node(node), rec.SerializeToString(), lease=lease)  # type: ignore[attr-defined]
    return lease


def _worker(conn: Connection, endpoints: list[str], threads: int) -> None:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.config import EtcdConfig
    from stalwart.coord.keys import JobKeys

    client = EtcdClient(EtcdConfig(endpoints=tuple(endpoints), timeout=60.0, attempt_timeout=10.0))
    pool = ThreadPoolExecutor(threads)
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "register":
            job, ttl, nodes = arg
            register = functools.partial(_register, client, JobKeys(job), ttl)
            conn.send(list(pool.map(register, nodes)))
        elif cmd == "revoke":
            list(pool.map(client.revoke, arg))
            conn.send(len(arg))
        else:
            break
    pool.shutdown()
    client.close()


class Workers:
    def __init__(self, endpoints: list[str], count: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, endpoints, threads), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            assert c.recv() == "ready"

    def _scatter(self, cmd: str, items: list, extra: tuple = ()) -> list:
        parts = [items[i::len(self.conns)] for i in range(len(self.conns))]
        for conn, part in zip(self.conns, parts, strict=True):
            conn.send((cmd, (*extra, part) if extra else part))
        return [conn.recv() for conn in self.conns]

    def register(self, job: str, ttl: int, nodes: list[str]) -> dict[str, int]:
        parts = [nodes[i::len(self.conns)] for i in range(len(self.conns))]
        for conn, part in zip(self.conns, parts, strict=True):
            conn.send(("register", (job, ttl, part)))
        leases: dict[str, int] = {}
        for conn, part in zip(self.conns, parts, strict=True):
            leases.update(zip(part, conn.recv(), strict=True))
        return leases

    def revoke(self, leases: list[int]) -> None:
        self._scatter("revoke", leases)

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("stop", None))
        for proc in self.procs:
            proc.join(10)


# --- observing the daemon and etcd --------------------------------------------------------------


class RoundWatch:
    """Arrival time and member count of every round record of one job."""

    def __init__(self, client: object, job: str) -> None:
        from stalwart.coord.keys import JobKeys
        from stalwart.coord.watch import Watch

        self.seen: list[tuple[float, int, int, int]] = []  # (time, number, members, bytes)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch = Watch(client, JobKeys(job).round, 0)  # type: ignore[arg-type]
        self._watch.wait_ready(10)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from stalwart.proto import records_pb2

        while not self._stop.is_set():  # not ``for ev in watch``: it never ends once closed
            for ev in self._watch.get(timeout=0.2):
                if ev.value:
                    rec = records_pb2.RoundRecord.FromString(ev.value)
                    with self._cond:
                        self.seen.append((time.monotonic(), rec.number, len(rec.members), len(ev.value)))
                        self._cond.notify_all()

    def wait_members(self, count: int, timeout: float) -> tuple[float, int, int, int]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for item in self.seen:
                    if item[2] == count:
                        return item
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no round with {count} members within {timeout} s; seen {self.seen}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._watch.close()


def _scrape(url: str, metric: str) -> float:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(metric + "{") or line.startswith(metric + " "))


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_size(n: int, endpoints: list[str], workers: Workers, ttl: int, kill_fraction: float, seed: int,
             log_dir: Path) -> Result:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.config import EtcdConfig
    from stalwart.coord.keys import JobKeys
    from stalwart.coord.local import free_port

    job = f"bench{n}"
    etcd_metrics = f"http://{endpoints[0]}/metrics"
    metrics_port = free_port()
    client = EtcdClient(EtcdConfig(endpoints=tuple(endpoints), timeout=30.0))
    client.delete(JobKeys(job).prefix, prefix=True)
    log = open(log_dir / f"daemon-{n}.log", "wb")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen(
        [sys.executable, "-m", "stalwart.cli.main", "--log-level", "warning", "daemon",
         "--endpoints", ",".join(endpoints), "--job", job, "--daemon-id", f"bench-{n}",
         "--min-nodes", "1", "--max-nodes", str(n), "--join-timeout", "600", "--regrow-cooldown", "0",
         "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rounds = RoundWatch(client, job)
    try:
        deadline = time.monotonic() + 30
        while client.get(JobKeys(job).leader) is None:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError(f"daemon did not lead; see {log_dir / f'daemon-{n}.log'}")
            time.sleep(0.05)
        time.sleep(0.5)  # let it settle into its watch
        nodes = [f"node{i:05d}" for i in range(n)]
        cpu0, req0 = _cpu(daemon.pid), _scrape(etcd_metrics, "grpc_server_handled_total")
        dreq0 = _scrape(f"http://127.0.0.1:{metrics_port}/metrics", "stalwart_daemon_etcd_request_seconds_count")
        t0 = time.monotonic()
        leases = workers.register(job, ttl, nodes)
        t_registered = time.monotonic()
        t_first, _, _, size = rounds.wait_members(n, 120)
        cpu1 = _cpu(daemon.pid)

        killed = sorted(random.Random(seed).sample(nodes, max(1, int(n * kill_fraction))))
        t_kill = time.monotonic()
        workers.revoke([leases[k] for k in killed])
        t_next, _, _, _ = rounds.wait_members(n - len(killed), 120)
        t_end = time.monotonic()
        cpu2, req1 = _cpu(daemon.pid), _scrape(etcd_metrics, "grpc_server_handled_total")
        dreq1 = _scrape(f"http://127.0.0.1:{metrics_port}/metrics", "stalwart_daemon_etcd_request_seconds_count")
        result = Result(
            nodes=n, register_s=t_registered - t0, first_round_s=t_first - t0,
            first_round_after_last_registration_s=max(0.0, t_first - t_registered), killed=len(killed),
            next_round_s=t_next - t_kill, daemon_cpu_s=cpu2 - cpu0, daemon_cpu_form_s=cpu1 - cpu0,
            daemon_cpu_kill_s=cpu2 - cpu1, etcd_requests=int(req1 - req0),
            etcd_requests_per_s=(req1 - req0) / (t_end - t0), daemon_etcd_requests=int(dreq1 - dreq0),
            round_record_bytes=size,
        )
        workers.revoke([leases[k] for k in nodes if k not in set(killed)])  # clean up, untimed
        return result
    finally:
        rounds.close()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        client.close()


def table(results: list[Result], ttl_note: str) -> str:
    head = (f"{'nodes':>6} {'register':>9} {'1st round':>10} {'(+daemon)':>10} {'killed':>7} {'next round':>11} "
            f"{'daemon CPU':>11} {'etcd req/s':>11}")
    rows = [head]
    for r in results:
        rows.append(f"{r.nodes:>6} {r.register_s:>8.2f}s {r.first_round_s:>9.2f}s "
                    f"{r.first_round_after_last_registration_s:>9.2f}s {r.killed:>7} {r.next_round_s:>10.2f}s "
                    f"{r.daemon_cpu_s:>10.2f}s {r.etcd_requests_per_s:>11.0f}")
    rows.append(ttl_note)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,5000,10000", help="comma-separated node counts")
    ap.add_argument("--workers", type=int, default=6, help="registering processes")
    ap.add_argument("--threads", type=int, default=16, help="threads per registering process")
    ap.add_argument("--ttl", type=int, default=60, help="node lease TTL (long enough to need no keep-alive)")
    ap.add_argument("--kill-fraction", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--out", type=Path, default=RESULTS / "rendezvous.json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    from stalwart.coord.local import LocalEtcd

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="stalwart-rdzv-bench-") as tmp:
        with LocalEtcd(Path(tmp) / "etcd", 1) as etcd:
            workers = Workers(etcd.endpoints, args.workers, args.threads)
            try:
                for n in sizes:
                    r = run_size(n, etcd.endpoints, workers, args.ttl, args.kill_fraction, args.seed, Path(tmp))
                    results.append(r)
                    print(f"{n} nodes: first round {r.first_round_s:.2f} s, next round {r.next_round_s:.2f} s "
                          f"after revoking {r.killed}", flush=True)
            finally:
                workers.close()
    note = ("1st round: from the first lease grant to the round record in etcd; (+daemon): after the last "
            "registration; next round: from revoking 1 % of the leases. Add the lease TTL for nodes that die "
            "silently.")
    print(table(results, note))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count()}, "workers": args.workers, "threads": args.threads,
        "lease_ttl": args.ttl, "results": [asdict(r) for r in results],
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
