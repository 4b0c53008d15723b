"""Kill one node of a 3-node torchrun job and time the recovery, per rendezvous backend.

Each trial starts 3 torchrun processes on loopback (``--nnodes 2:3 --nproc-per-node 1``, one per
simulated node) running ``examples/elastic_gloo.py``, waits until all three train at world size
3, SIGKILLs every process of the last node (its torchrun and its worker), and measures the time
from the kill to the first step completed at world size 2. A trial that has not resumed within
``--timeout`` seconds counts as not recovered.

Backends, side by side: ``stalwart`` (etcd), ``c10d`` as it is, and ``c10d`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its workaround). All get the same rendezvous timing
settings (keep-alive 1 s × 3, last call 2 s), so the comparison is about correctness, not
timeouts. The killed node is never the one hosting c10d's rendezvous store.

    python bench/recovery_bench.py --trials 5            # prints a table, writes bench/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "elastic_gloo.py"
sys.path.insert(0, str(REPO))

from stalwart.chaos.cluster import kill_tree  # noqa: E402
from stalwart.coord.local import LocalEtcd, free_port  # noqa: E402

TIMING = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,join_timeout=120"


@dataclass
class Mode:
    name: str
    backend: str
    env: dict[str, str] = field(default_factory=dict)


MODES = {
    "stalwart": Mode("stalwart", "stalwart"),
    "c10d": Mode("c10d", "c10d"),
    "c10d+no-shared-store": Mode("c10d+no-shared-store", "c10d", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}


@dataclass
class Trial:
    mode: str
    recovered: bool
    seconds: float | None  # kill -> first step at world size 2
    detail: str


def rows(log: Path) -> list[dict[str, float]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


def start_node(mode: Mode, endpoint: str, job: str, node: str, log: Path, out: Path) -> subprocess.Popen[bytes]:
    conf = TIMING + (f",node_id={node}" if mode.backend == "stalwart" else "")
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
            "--max-restarts", "20", "--monitor-interval", "0.2", "--local-addr", "127.0.0.1",
            "--rdzv-backend", mode.backend, "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--rdzv-conf", conf,
            str(SCRIPT), "--steps", "1000000", "--step-time", "0.05", "--steps-log", str(log), "--node-id", node]
    env = dict(os.environ, OMP_NUM_THREADS="1", **mode.env)
    with open(out, "ab") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def run_trial(mode: Mode, etcd: LocalEtcd | None, workdir: Path, index: int, timeout: float) -> Trial:
    log = workdir / f"{mode.name}-{index}.jsonl"
    job = f"bench-{mode.name.replace('+', '-')}-{index}-{os.getpid()}"
    endpoint = etcd.endpoints[0] if etcd else f"127.0.0.1:{free_port()}"
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for i in range(3):
            name = f"node{i}"
            nodes[name] = start_node(mode, endpoint, job, name, log, workdir / f"{mode.name}-{index}-{name}.out")
            if i == 0 and mode.backend == "c10d":
                time.sleep(1.0)  # let node0 host c10d's store, so the victim is never the host
        deadline = time.monotonic() + 120
        while {r["node"] for r in rows(log) if r["world"] == 3} != {"node0", "node1", "node2"}:
            if time.monotonic() > deadline:
                return Trial(mode.name, False, None, "never formed the first world of 3")
            time.sleep(0.1)
        kill_tree(nodes["node2"].pid)
        killed = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            resumed = [r["t"] for r in rows(log) if r["t"] > killed and r["world"] == 2]
            if resumed:
                return Trial(mode.name, True, min(resumed) - killed, "resumed at world size 2")
            time.sleep(0.05)
        alive = [n for n, p in nodes.items() if p.poll() is None and n != "node2"]
        return Trial(mode.name, False, None, f"no step at world size 2 within {timeout:g} s; alive: {alive}")
    finally:
        for p in nodes.values():
            kill_tree(p.pid)
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per mode")
    parser.add_argument("--stalwart-trials", type=int, default=None, help="override --trials for stalwart")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds to wait for recovery")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    args = parser.parse_args()

    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="stalwart-recovery-") as tmp:
        workdir = Path(tmp)
        with LocalEtcd(workdir / "etcd", 1) as etcd:
            for name in args.modes.split(","):
                mode = MODES[name]
                n = args.stalwart_trials if name == "stalwart" and args.stalwart_trials else args.trials
                for i in range(n):
                    t = run_trial(mode, etcd if mode.backend == "stalwart" else None, workdir, i, args.timeout)
                    trials.append(t)
                    secs = f"{t.seconds:.2f} s" if t.seconds is not None else "-"
                    print(f"[{name} {i + 1}/{n}] {'recovered' if t.recovered else 'FAILED'} {secs}: {t.detail}",
                          flush=True)

    summary = []
    for name in args.modes.split(","):
        mine = [t for t in trials if t.mode == name]
        times = [t.seconds for t in mine if t.seconds is not None]
        summary.append({
            "mode": name,
            "trials": len(mine),
            "recovered": sum(t.recovered for t in mine),
            "median_s": statistics.median(times) if times else None,
            "min_s": min(times) if times else None,
            "max_s": max(times) if times else None,
        })
    print()
    print(f"{'backend':<22} {'recovered':>10} {'median s':>9} {'min s':>7} {'max s':>7}")
    for s in summary:
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{s['mode']:<22} {s['recovered']:>4}/{s['trials']:<5} {fmt(s['median_s']):>9} "
              f"{fmt(s['min_s']):>7} {fmt(s['max_s']):>7}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "trials": [asdict(t) for t in trials],
                               "timeout_s": args.timeout, "rdzv_conf": TIMING}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
