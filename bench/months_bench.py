"""Months in minutes: a 1,000-node job's control traffic and checkpoint retention over >= 90
simulated days, clock-compressed, against a real etcd and a real ``stalwart daemon``.

What is compressed, and how: a simulated day is ``ckpts_per_day`` checkpoints (48: one every 30
minutes) and ``faults_per_day`` node faults. Each checkpoint is a real (tiny) checkpoint saved
with ``stalwart.ckpt`` under the retention policy, plus its commit record in etcd; each fault
revokes a member's lease (what etcd does when a lease expires, without waiting out the TTL),
the daemon opens a smaller round, the node registers again and the next checkpoint regrows the
world: two rounds per fault. Meanwhile the simulated agents (``sim_agents.py``: 3 s leases kept
alive every TTL/3, progress every ``progress_interval`` real seconds) write all the time. The
daemon compacts every ``compact_interval`` real seconds and keeps ``keep_ckpt_records`` commit
records; it logs at info level to a rotated file.

Sampled once per simulated day: etcd's key count, database size (file and in use), revision,
the daemon's and the simulated agents' RSS and open file descriptors, the daemon's log files, the
checkpoint storage. The run passes when each stays bounded (see :func:`bounded`).

    .venv/bin/python bench/months_bench.py                        # 1,000 nodes, 90 days
    .venv/bin/python bench/months_bench.py --nodes 100 --days 5   # a quick look

Prints a table (every 10th day) and writes JSON and a plot to bench/results/months.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sim_agents  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    nodes: int = 1000
    days: int = 90
    ckpts_per_day: int = 48
    faults_per_day: int = 6
    processes: int = 2
    ttl: int = 3
    progress_interval: float = 1.0
    compact_interval: float = 2.0
    keep_ckpt_records: int = 20
    keep_last: int = 3
    log_max_bytes: int = 1 << 20
    log_backups: int = 3
    quiet: bool = False


@dataclass
class Sample:
    day: float
    wall_s: float
    keys: int
    db_bytes: int
    db_in_use_bytes: int
    revision: int
    compacted_revision: int
    daemon_rss: int
    daemon_fds: int
    sim_rss_max: int
    sim_fds_max: int
    log_files: int
    log_bytes: int
    ckpt_dirs: int
    ckpt_bytes: int
    ckpt_records: int
    rounds: int
    checkpoints: int


@dataclass
class Report:
    config: Config
    samples: list[Sample] = field(default_factory=list)
    rounds: int = 0
    checkpoints: int = 0
    faults: int = 0
    wall_s: float = 0.0
    leases_expired: int = 0  # node leases that expired under a loaded machine (the node registered again)
    verdicts: dict[str, bool] = field(default_factory=dict)


def _dir_size(path: Path, pattern: str = "*") -> tuple[int, int]:
    files = [p for p in path.rglob(pattern) if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def bounded(samples: list[Sample], cfg: Config) -> dict[str, bool]:
    """The key count stays within the layout's bound (per node: node, health, progress and fault
    history; the newest ``keep_ckpt_records`` commit records; a few singletons). Each other figure
    of the second half of the run stays within its bound of the first half's peak (after the
    first day, when the job forms): checkpoint storage does not grow at all (commit records stay
    within a few of ``keep_ckpt_records``: pruning follows a commit by a pass), the database
    within 1.5x + 1 MiB (the file grows in steps; etcd reuses freed pages but never returns them
    without a defragmentation),
    memory within 1.25x + 16 MiB (allocator noise), fds within 8."""
    if len(samples) < 4:
        return {"enough samples": False}
    body = samples[1:]
    half = len(body) // 2
    first, second = body[:half], body[half:]

    def peak(part: list[Sample], name: str) -> int:
        return max(getattr(s, name) for s in part)

    return {
        "keys": peak(samples, "keys") <= 4 * cfg.nodes + cfg.keep_ckpt_records + 8,
        # a sample may fall between a commit and its pruning (a pass later; a few under load)
        "ckpt_records": peak(samples, "ckpt_records") <= cfg.keep_ckpt_records + 8,
        "db_size": peak(second, "db_bytes") <= 1.5 * peak(first, "db_bytes") + (1 << 20),
        "daemon_rss": peak(second, "daemon_rss") <= 1.25 * peak(first, "daemon_rss") + (16 << 20),
        "sim_rss": peak(second, "sim_rss_max") <= 1.25 * peak(first, "sim_rss_max") + (16 << 20),
        "daemon_fds": peak(second, "daemon_fds") <= peak(first, "daemon_fds") + 8,
        "sim_fds": peak(second, "sim_fds_max") <= peak(first, "sim_fds_max") + 8,
        "log_files": peak(second, "log_files") <= peak(first, "log_files") + 1,
        "ckpt_storage": peak(second, "ckpt_dirs") <= peak(first, "ckpt_dirs"),
        "compacted": samples[-1].compacted_revision > samples[0].compacted_revision,
    }


def run(cfg: Config, workdir: Path) -> Report:
    """One accelerated run in ``workdir`` (etcd data, daemon logs, checkpoints go there)."""
    import torch

    from stalwart.ckpt.coord import SingleCoordinator
    from stalwart.ckpt.retention import RetentionPolicy
    from stalwart.ckpt.saver import Checkpointer, SaveConfig
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.keys import JobKeys
    from stalwart.coord.local import LocalEtcd, free_port
    from stalwart.proto import records_pb2

    def say(msg: str) -> None:
        if not cfg.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg} (load {sim_agents.load():.1f})", file=sys.stderr, flush=True)

    job, keys = "months", JobKeys("months")
    report = Report(cfg)
    rng = random.Random(90)
    logs, store = workdir / "logs", workdir / "ckpt"
    logs.mkdir(parents=True, exist_ok=True)
    with LocalEtcd(workdir / "etcd", 1) as etcd:
        client = EtcdClient(etcd.client_config(timeout=30.0))
        metrics_port = free_port()
        daemon = subprocess.Popen(
            [sys.executable, "-m", "stalwart.cli.main", "--log-level", "info", "--log-file", str(logs / "daemon.log"),
             "--log-max-bytes", str(cfg.log_max_bytes), "--log-backups", str(cfg.log_backups), "daemon",
             "--endpoints", ",".join(etcd.endpoints), "--job", job, "--daemon-id", "months",
             "--lease-ttl", "3", "--tick-interval", "0.2", "--min-nodes", "1", "--max-nodes", str(cfg.nodes),
             "--join-timeout", "600", "--regrow-cooldown", "0", "--stall-timeout", "3600",
             # a simulated fault is a lost host; its loopback address refuses like a restarting agent's
             "--agent-restart-grace", "0",
             "--quarantine-window", "0.5",  # an hour or so of simulated time: random faults quarantine nobody
             "--compact-interval", str(cfg.compact_interval), "--keep-ckpt-records", str(cfg.keep_ckpt_records),
             "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port)],
            stdout=subprocess.DEVNULL, stderr=open(logs / "daemon.stderr", "wb"),  # noqa: SIM115 - child owns it
            start_new_session=True)
        fleet = sim_agents.Fleet(etcd.endpoints, job, cfg.processes, cfg.ttl, cfg.progress_interval)
        saver = Checkpointer(str(store), SaveConfig(retention=RetentionPolicy(keep_last=cfg.keep_last),
                                                    encode_threads=1), SingleCoordinator())
        state = {"w": torch.zeros(4096)}
        t0 = time.monotonic()
        try:
            while client.get(keys.leader) is None:
                if daemon.poll() is not None or time.monotonic() - t0 > 30:
                    raise RuntimeError(f"the daemon did not lead; see {logs}")
                time.sleep(0.05)
            nodes = [f"node{i:05d}" for i in range(cfg.nodes)]
            fleet.register(nodes)

            def current() -> records_pb2.RoundRecord | None:
                kv = client.get(keys.round)
                return records_pb2.RoundRecord.FromString(kv.value) if kv else None

            def wait_round(pred: Any, what: str, timeout: float = 180.0) -> records_pb2.RoundRecord:
                deadline = time.monotonic() + timeout
                while True:
                    rec = current()
                    if rec is not None and pred(rec):
                        return rec
                    if time.monotonic() > deadline or daemon.poll() is not None:
                        raise RuntimeError(f"no round {what} within {timeout} s; see {logs}")
                    time.sleep(0.01)

            first = wait_round(lambda r: len(r.members) == cfg.nodes and not r.closed, "with every node")
            say(f"{cfg.nodes} nodes: first round {first.number}")
            report.samples.append(_sample(0.0, t0, client, keys, daemon.pid, fleet, logs, store, metrics_port,
                                          etcd.endpoints[0], first.number, 0))
            step, fault_every = 0, max(1, cfg.ckpts_per_day // max(cfg.faults_per_day, 1))
            back: str | None = None  # the last fault's node, until a round has it again

            def checkpoint(day: int) -> None:
                nonlocal step
                step += 100
                saver.save(step, {"w": state["w"].fill_(step)}, {"day": day}).result(60)
                client.create(keys.ckpt(step), records_pb2.CheckpointRecord(step=step).SerializeToString())
                report.checkpoints += 1

            def in_round(node: str) -> bool:
                rnd = current()
                return rnd is not None and not rnd.closed and node in {m.node_id for m in rnd.members}

            for day in range(cfg.days):
                for c in range(cfg.ckpts_per_day):
                    checkpoint(day)
                    if cfg.faults_per_day and c % fault_every == fault_every - 1:
                        # Each fault gets its own regrow (two rounds a fault): a node whose
                        # registration the daemon saw only after the commits since its fault is
                        # regrown by one more commit.
                        for _ in range(200):
                            if back is None or in_round(back):
                                break
                            checkpoint(day)
                            time.sleep(0.02)
                        rnd = current()
                        members = [m.node_id for m in rnd.members] if rnd else nodes
                        victim = rng.choice(members)
                        fleet.revoke([victim])
                        wait_round(lambda r, v=victim: v not in {m.node_id for m in r.members}, f"without {victim}")
                        fleet.register([victim])  # back: the next checkpoint regrows the world
                        back = victim
                        report.faults += 1
                if day + 1 == cfg.days:
                    _await_compaction(cfg, metrics_port)
                rnd = current()
                report.samples.append(_sample(day + 1.0, t0, client, keys, daemon.pid, fleet, logs, store,
                                              metrics_port, etcd.endpoints[0], rnd.number if rnd else 0,
                                              report.checkpoints))
                s = report.samples[-1]
                if (day + 1) % 10 == 0 or day + 1 == cfg.days:
                    say(f"day {day + 1}/{cfg.days}: round {s.rounds}, {s.checkpoints} checkpoints, {s.keys} keys, "
                        f"db {s.db_bytes / 2**20:.1f} MiB, daemon {s.daemon_rss / 2**20:.0f} MiB {s.daemon_fds} fds")
            report.rounds = report.samples[-1].rounds
        finally:
            report.wall_s = time.monotonic() - t0
            report.leases_expired = int(fleet.stats()["relost"])
            saver.close()
            fleet.close()
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(15)
            except subprocess.TimeoutExpired:
                daemon.kill()
            client.close()
    report.verdicts = bounded(report.samples, cfg)
    return report


def _await_compaction(cfg: Config, metrics_port: int) -> None:
    """A short run can end before the daemon's second compaction tick (it compacts to the revision
    seen one interval earlier): wait for the first compaction so the last sample shows it."""
    if not cfg.compact_interval:
        return
    deadline = time.monotonic() + 3 * cfg.compact_interval + 10
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    while time.monotonic() < deadline:
        if sim_agents.scrape(url, "stalwart_daemon_compacted_revision")["stalwart_daemon_compacted_revision"] > 0:
            return
        time.sleep(0.1)


def _sample(day: float, t0: float, client: Any, keys: Any, daemon_pid: int, fleet: sim_agents.Fleet, logs: Path,
            store: Path, metrics_port: int, etcd_endpoint: str, rounds: int, checkpoints: int) -> Sample:
    kvs, revision = client.get_prefix("/")
    ckpt_records = sum(1 for kv in kvs if kv.key.startswith(keys.ckpt_prefix))
    etcd_m = sim_agents.scrape(f"http://{etcd_endpoint}/metrics", "etcd_mvcc_db_total_size_in_use_in_bytes",
                               "etcd_mvcc_db_total_size_in_bytes")
    daemon_m = sim_agents.scrape(f"http://127.0.0.1:{metrics_port}/metrics", "stalwart_daemon_compacted_revision")
    rss, fds = sim_agents.rss_and_fds(daemon_pid)
    sim = fleet.stats()
    log_files, log_bytes = _dir_size(logs, "daemon.log*")
    ckpt_dirs = sum(1 for p in store.iterdir() if p.is_dir()) if store.exists() else 0
    _, ckpt_bytes = _dir_size(store) if store.exists() else (0, 0)
    return Sample(day, time.monotonic() - t0, len(kvs), int(etcd_m["etcd_mvcc_db_total_size_in_bytes"]),
                  int(etcd_m["etcd_mvcc_db_total_size_in_use_in_bytes"]), revision,
                  int(daemon_m["stalwart_daemon_compacted_revision"]), rss, fds, sim["rss_max"], sim["fds_max"],
                  log_files, log_bytes, ckpt_dirs, ckpt_bytes, ckpt_records, rounds, checkpoints)


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report.samples
    days = [x.day for x in s]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), sharex=True)
    series = [
        ("etcd keys", [[x.keys for x in s]], ["keys"]),
        ("etcd database (MiB)", [[x.db_bytes / 2**20 for x in s], [x.db_in_use_bytes / 2**20 for x in s]],
         ["file", "in use"]),
        ("RSS (MiB)", [[x.daemon_rss / 2**20 for x in s], [x.sim_rss_max / 2**20 for x in s]],
         ["daemon", "simulated agents (one process)"]),
        ("open file descriptors", [[x.daemon_fds for x in s], [x.sim_fds_max for x in s]],
         ["daemon", "simulated agents (one process)"]),
        ("daemon log (KiB), files", [[x.log_bytes / 1024 for x in s], [x.log_files * 100 for x in s]],
         ["bytes (KiB)", "files x 100"]),
        ("checkpoints kept", [[x.ckpt_dirs for x in s], [x.ckpt_records for x in s]],
         ["on storage", "commit records in etcd"]),
    ]
    for ax, (title, ys, labels) in zip(axes.flat, series, strict=True):
        for y, label in zip(ys, labels, strict=True):
            ax.plot(days, y, label=label)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("simulated days")
    c = report.config
    fig.suptitle(f"{c.nodes} nodes, {c.days} simulated days: {report.rounds} rounds, {report.checkpoints} "
                 f"checkpoints, {report.faults} faults in {report.wall_s / 60:.1f} min")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table(report: Report) -> str:
    rows = [f"{'day':>4} {'rounds':>7} {'ckpts':>6} {'keys':>6} {'db MiB':>7} {'in use':>7} {'revision':>9} "
            f"{'compacted':>9} {'daemon MiB':>10} {'fds':>4} {'agents MiB':>10} {'fds':>4} {'logs':>5} "
            f"{'ckpt dirs':>9}"]
    for x in report.samples:
        if x.day % 10 == 0 or x is report.samples[-1] or x.day == 1:
            rows.append(f"{x.day:>4.0f} {x.rounds:>7} {x.checkpoints:>6} {x.keys:>6} {x.db_bytes / 2**20:>7.1f} "
                        f"{x.db_in_use_bytes / 2**20:>7.1f} {x.revision:>9} {x.compacted_revision:>9} "
                        f"{x.daemon_rss / 2**20:>10.1f} {x.daemon_fds:>4} {x.sim_rss_max / 2**20:>10.1f} "
                        f"{x.sim_fds_max:>4} {x.log_files:>5} {x.ckpt_dirs:>9}")
    rows.append("bounded: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in report.verdicts.items()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Config()
    for name, value in asdict(defaults).items():
        if name != "quiet":
            ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    ap.add_argument("--out", type=Path, default=RESULTS / "months.json")
    args = ap.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in asdict(defaults) if k != "quiet"})
    with tempfile.TemporaryDirectory(prefix="stalwart-months-") as tmp:
        report = run(cfg, Path(tmp))
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**asdict(report), "load_1min": sim_agents.load()}, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if all(report.verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
