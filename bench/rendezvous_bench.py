"""Rendezvous at scale under real traffic: N simulated agents against one local etcd and a real
``stalwart daemon``.

The simulated agents (``sim_agents.py``: a few processes, batched etcd clients) write what real
agents write, as often: a lease kept alive every TTL/3, a node and a health record, a progress
record every 5 s naming the current round. For each N (default 1,000, 5,000 and 10,000):

1. start ``stalwart daemon`` (``max_nodes = N``) and wait until it leads;
2. register N nodes -> **first formation**: from the first lease grant to the round record with
   N members in etcd;
3. steady state for ``--steady`` seconds of traffic -> the daemon's CPU (cores) and RSS, etcd's
   writes per second (``etcd_mvcc_put_total``), keep-alives per second, the database size;
4. ``--losses`` times: one member dies silently (its keep-alives stop) -> **loss to round**: from
   etcd deleting its node key (the lease expired; seen by a watch of this bench) to the next round
   record without it; p50 and p99. Also shown: from the nominal expiry (last answered keep-alive
   + TTL), which adds etcd's own expiry granularity (it checks leases every 500 ms).

Progress is printed to stderr during the run; the machine's load average with every figure.

    .venv/bin/python bench/rendezvous_bench.py                    # 1k, 5k, 10k
    .venv/bin/python bench/rendezvous_bench.py --sizes 1000 --losses 5

Prints a table and writes JSON to bench/results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_agents  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROGRESS_INTERVAL = 5.0  # agent.config: progress_interval


@dataclass
class Result:
    nodes: int
    first_round_s: float
    register_s: float
    steady_s: float
    daemon_cores: float  # CPU seconds per second over the steady window
    daemon_rss_mib: float
    etcd_writes_per_s: float
    etcd_writes_per_node_min: float
    keepalives_per_s: float
    db_size_mib: float
    loss_to_round_s: list[float] = field(default_factory=list)  # from the node key's deletion
    expiry_to_round_s: list[float] = field(default_factory=list)  # from last keep-alive + TTL
    loss_p50_s: float = 0.0
    loss_p99_s: float = 0.0
    daemon_cores_losses: float = 0.0
    load_1min: float = 0.0
    sim_errors: int = 0


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg} (load {sim_agents.load():.1f})", file=sys.stderr, flush=True)


class KeyWatch:
    """Times of round records (number, member set) and of node-key deletions, as this bench sees them."""

    def __init__(self, client: object, job: str) -> None:
        from stalwart.coord.keys import JobKeys
        from stalwart.coord.watch import Watch

        self.keys = JobKeys(job)
        self.rounds: list[tuple[float, int, frozenset[str]]] = []
        self.deleted: dict[str, float] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._watch = Watch(client, self.keys.prefix, 0)  # type: ignore[arg-type]
        self._watch.wait_ready(10)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from stalwart.coord.keys import Kind
        from stalwart.coord.watch import EventType
        from stalwart.proto import records_pb2

        while not self._stop.is_set():
            for ev in self._watch.get(timeout=0.2):
                at = time.monotonic()
                parsed = self.keys.parse(ev.key)
                if parsed is None:
                    continue
                if parsed.kind is Kind.ROUND and ev.value:
                    rec = records_pb2.RoundRecord.FromString(ev.value)
                    with self._cond:
                        self.rounds.append((at, rec.number, frozenset(m.node_id for m in rec.members)))
                        self._cond.notify_all()
                elif parsed.kind is Kind.NODE and ev.type is EventType.DELETE and parsed.name:
                    with self._cond:
                        self.deleted[parsed.name] = at

    def wait_round(self, pred: object, timeout: float) -> tuple[float, int, frozenset[str]]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for item in self.rounds:
                    if pred(item[2]):  # type: ignore[operator]
                        return item
                left = deadline - time.monotonic()
                if left <= 0:
                    last = [(number, len(members)) for _, number, members in self.rounds[-1:]]
                    raise TimeoutError(f"no such round within {timeout} s; last (number, members): {last}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._watch.close()


def _etcd_counts(endpoint: str) -> dict[str, float]:
    return sim_agents.scrape(f"http://{endpoint}/metrics", "etcd_mvcc_put_total", "etcd_mvcc_delete_total",
                             "etcd_mvcc_db_total_size_in_bytes")


def run_size(n: int, endpoints: list[str], args: argparse.Namespace, log_dir: Path) -> Result:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.config import EtcdConfig
    from stalwart.coord.keys import JobKeys

    job = f"bench{n}"
    client = EtcdClient(EtcdConfig(endpoints=tuple(endpoints), timeout=30.0))
    client.delete(JobKeys(job).prefix, prefix=True)
    log = open(log_dir / f"daemon-{n}.log", "wb")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen(
        [sys.executable, "-m", "stalwart.cli.main", "--log-level", "warning", "daemon",
         "--endpoints", ",".join(endpoints), "--job", job, "--daemon-id", f"bench-{n}",
         "--min-nodes", "1", "--max-nodes", str(n), "--join-timeout", "600", "--regrow-cooldown", "3600",
         "--agent-restart-grace", "0",  # a simulated loss is a lost host (its loopback address refuses)
         "--metrics-port", "0"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    watch = KeyWatch(client, job)
    fleet = sim_agents.Fleet(endpoints, job, args.processes, args.ttl, PROGRESS_INTERVAL, seed=n)
    try:
        deadline = time.monotonic() + 30
        while client.get(JobKeys(job).leader) is None:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError(f"daemon did not lead; see {log_dir / f'daemon-{n}.log'}")
            time.sleep(0.05)
        time.sleep(0.5)
        nodes = [f"node{i:05d}" for i in range(n)]
        say(f"{n} nodes: registering")
        t0 = time.monotonic()
        fleet.register(nodes)
        t_registered = time.monotonic()
        say(f"{n} nodes: registered in {t_registered - t0:.1f} s; waiting for the first round")
        t_first, _, _ = watch.wait_round(lambda m: len(m) == n, 300)
        say(f"{n} nodes: first round after {t_first - t0:.2f} s; steady traffic for {args.steady:.0f} s")

        time.sleep(PROGRESS_INTERVAL)  # every node has learned the round and reports progress
        cpu0, e0, s0, w0 = sim_agents.cpu_seconds(daemon.pid), _etcd_counts(endpoints[0]), fleet.stats(), \
            time.monotonic()
        for _ in range(int(args.steady // 5)):
            time.sleep(5)
            st = fleet.stats()
            say(f"{n} nodes: steady, {(st['puts'] - s0['puts']) / (time.monotonic() - w0):.0f} puts/s, "
                f"{(st['keepalives'] - s0['keepalives']) / (time.monotonic() - w0):.0f} keep-alives/s, "
                f"daemon {(sim_agents.cpu_seconds(daemon.pid) - cpu0) / (time.monotonic() - w0):.2f} cores")
        cpu1, e1, s1, w1 = sim_agents.cpu_seconds(daemon.pid), _etcd_counts(endpoints[0]), fleet.stats(), \
            time.monotonic()
        steady = w1 - w0
        rss, _ = sim_agents.rss_and_fds(daemon.pid)
        writes = (e1["etcd_mvcc_put_total"] - e0["etcd_mvcc_put_total"]) / steady

        rng = random.Random(n)
        losses, expiries = [], []
        live = set(nodes)
        for i in range(args.losses):
            victim = rng.choice(sorted(live))
            live.discard(victim)
            last_ack = fleet.silence([victim])[victim]
            wall_to_mono = time.monotonic() - time.time()
            # not "exactly the live nodes": on a loaded machine other simulated leases may lapse too
            t_round, number, _ = watch.wait_round(lambda m, v=victim: v not in m and len(m) >= len(live) - 50, 60)
            t_deleted = watch.deleted.get(victim, t_round)
            losses.append(t_round - t_deleted)
            expiries.append(t_round - (last_ack + args.ttl + wall_to_mono))
            say(f"{n} nodes: loss {i + 1}/{args.losses}: round {number} {losses[-1]:.3f} s after the node key "
                f"went, {expiries[-1]:.3f} s after nominal expiry")
            time.sleep(args.gap)
        cpu2, w2 = sim_agents.cpu_seconds(daemon.pid), time.monotonic()
        db = client.db_size()
        q = statistics.quantiles(losses, n=100, method="inclusive") if len(losses) > 1 else losses * 99
        return Result(
            nodes=n, first_round_s=t_first - t0, register_s=t_registered - t0, steady_s=steady,
            daemon_cores=(cpu1 - cpu0) / steady, daemon_rss_mib=rss / 2**20, etcd_writes_per_s=writes,
            etcd_writes_per_node_min=writes * 60 / n,
            keepalives_per_s=(s1["keepalives"] - s0["keepalives"]) / steady, db_size_mib=db / 2**20,
            loss_to_round_s=losses, expiry_to_round_s=expiries, loss_p50_s=statistics.median(losses),
            loss_p99_s=q[98], daemon_cores_losses=(cpu2 - cpu1) / (w2 - w1), load_1min=sim_agents.load(),
            sim_errors=int(fleet.stats()["errors"]),
        )
    finally:
        fleet.close()
        watch.close()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(15)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        client.delete(JobKeys(job).prefix, prefix=True)
        client.close()


def table(results: list[Result]) -> str:
    head = (f"{'nodes':>6} {'1st round':>10} {'loss p50':>9} {'loss p99':>9} {'expiry p50':>11} "
            f"{'daemon':>7} {'(losses)':>9} {'RSS':>8} {'writes/s':>9} {'/node/min':>10} {'keepalive/s':>12} "
            f"{'DB':>8} {'load':>5}")
    rows = [head]
    for r in results:
        rows.append(f"{r.nodes:>6} {r.first_round_s:>9.2f}s {r.loss_p50_s:>8.3f}s {r.loss_p99_s:>8.3f}s "
                    f"{statistics.median(r.expiry_to_round_s):>10.3f}s {r.daemon_cores:>6.2f}c "
                    f"{r.daemon_cores_losses:>8.2f}c {r.daemon_rss_mib:>6.0f}Mi {r.etcd_writes_per_s:>9.0f} "
                    f"{r.etcd_writes_per_node_min:>10.1f} {r.keepalives_per_s:>12.0f} {r.db_size_mib:>6.1f}Mi "
                    f"{r.load_1min:>5.1f}")
    rows.append("1st round: first lease grant -> round record with every node. loss: node key deleted by etcd "
                "(lease expired) -> next round record; expiry: from last keep-alive + TTL. daemon: cores in "
                "steady traffic (and while losses are decided). writes: etcd_mvcc_put_total.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,5000,10000", help="comma-separated node counts")
    ap.add_argument("--processes", type=int, default=4, help="simulated-agent processes")
    ap.add_argument("--ttl", type=int, default=5, help="node lease TTL (agent.config lease_ttl)")
    ap.add_argument("--steady", type=float, default=30.0, help="seconds of steady traffic measured")
    ap.add_argument("--losses", type=int, default=7, help="node losses, one at a time")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between losses")
    ap.add_argument("--out", type=Path, default=RESULTS / "rendezvous.json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    from stalwart.coord.local import LocalEtcd

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="stalwart-rdzv-bench-") as tmp:
        with LocalEtcd(Path(tmp) / "etcd", 1) as etcd:
            for n in sizes:
                results.append(run_size(n, etcd.endpoints, args, Path(tmp)))
                print(table(results[-1:]).splitlines()[1], flush=True)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count()}, "processes": args.processes, "lease_ttl": args.ttl,
        "progress_interval": PROGRESS_INTERVAL, "results": [asdict(r) for r in results],
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
