"""Time recovery from faults: stalwart per fault kind beside torchrun ``c10d``, and per rendezvous backend.

Two suites (``--suite``):

``faults`` (default): the DeepSpeed example job (``examples/train_gpt.py``, ZeRO-1, 3 simulated
nodes of one worker) under the whole stalwart system (etcd, daemon, agents: the chaos runner with
one fault per trial) and under torchrun ``c10d`` (3 torchrun processes, the store workaround on),
the same fault injected once training runs at world size 3. Per fault kind and system: *detection*
(stalwart: the round that drops or restarts the node; torchrun: the first worker, other than the
victim, that a torchrun stops or replaces) and *fault to resumed step* (the first step recorded
after the fault by a restored world). Kinds: ``kill-worker`` (SIGKILL one worker), ``kill-node``
(the node's agent or torchrun and its worker, SIGKILL), ``hang-worker`` (SIGSTOP one worker;
torchrun has no hang detection, so it only recovers if a collective times out), ``network-cut``
(stalwart only, needs root: torchrun's nodes share loopback here). ``kill-worker`` runs three
stalwart shapes: 2 nodes + 1 warm spare each (the spare takes the rank: 2 -> 2), 3 nodes without
spares (the node leaves while it warms a replacement and the others re-form in place: 3 -> 2), and 3
nodes restarting every worker (``reform_in_place = false``).

``rendezvous``: the older comparison below, kept for the torchrun backend.

Kill one node of a 3-node torchrun job and time the recovery, per rendezvous backend. Each trial
starts 3 torchrun processes on loopback (``--nnodes 2:3 --nproc-per-node 1``, one per simulated
node) running ``examples/elastic_gloo.py``, waits until all three train at world size 3, SIGKILLs
every process of the last node (its torchrun and its worker), and measures the time from the kill to
the first step completed at world size 2. A trial that has not resumed within ``--timeout`` seconds
counts as not recovered.

Backends, side by side: ``stalwart`` (etcd), ``c10d`` as it is, and ``c10d`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its workaround). All get the same rendezvous timing
settings (keep-alive 1 s × 3, last call 2 s), so the comparison is about correctness, not
timeouts. The killed node is never the one hosting c10d's rendezvous store.

    python bench/recovery_bench.py --trials 3                      # faults suite: table + bench/results/faults.json
    python bench/recovery_bench.py --suite rendezvous --trials 5   # writes bench/results/recovery.json
    python bench/recovery_bench.py --kinds kill-worker --trials 10 --c10d-trials 10 --skip-restart \
        --out bench/results/faults-kill-worker.json                   # a dead worker: 2 -> 2 and 3 -> 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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


# -- the faults suite ------------------------------------------------------------------------------

GPT = REPO / "examples" / "train_gpt.py"
FAULT_KINDS = ("kill-worker", "kill-node", "hang-worker", "network-cut")
FAULT_AT_STEP = 25
JOB = {"checkpoint_every": 5, "zero_stage": 1, "global_batch": 12, "micro_batch": 2, "step_time": 0.05,
       "samples": 48000}


@dataclass
class FaultTrial:
    system: str
    kind: str
    detected_s: float | None  # fault -> the system acted on it (stalwart: the new round decided)
    resumed_s: float | None  # fault -> first step of the restored world
    detail: str
    case: str = ""  # the cluster shape, e.g. "3 nodes" or "2 nodes + spare"
    phases: dict[str, float] = field(default_factory=dict)  # stalwart in place: seconds from the fault
    # stalwart: the first restore after the fault, bytes over the world's ranks by source
    restore: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One row of the table: a fault on a cluster shape, for stalwart (in place or restarting),
    with or without peer replicas, storage reads as they are or throttled."""

    kind: str
    nodes: int = 3
    spares: int = 0
    reform_in_place: bool = True
    peer_replicas: int = 1
    throttled: bool = False  # restore reads from storage at --throttle-mbps per rank

    @property
    def label(self) -> str:
        spare = f" + {self.spares} spare" if self.spares else ""
        mode = "" if self.reform_in_place else ", restart"
        peers = "" if self.kind != "kill-node" else (", peers" if self.peer_replicas else ", storage")
        slow = ", throttled" if self.throttled else ""
        return f"{self.nodes} nodes{spare}{mode}{peers}{slow}"


def _phases(steps_log: Path, fault_at: float, decided_at: float | None) -> dict[str, float]:
    """Where the time went, from the step record of rank 0 (its re-form timings) and the round."""
    out: dict[str, float] = {}
    if decided_at is not None:
        out["decided"] = decided_at - fault_at
    events = [e for e in rows(steps_log) if e.get("t", 0) > fault_at]
    reform = next((e for e in events if e.get("event") == "reform"), None)
    if reform is not None:
        t = reform.get("timings", {})
        for name, key in (("error_seen", "error_seen_at"), ("reform_begun", "started_at"), ("left_old", "left_at"),
                          ("group_up", "group_up_at"), ("engine_built", "engine_built_at"),
                          ("restored", "restored_at")):
            if t.get(key):
                out[name] = t[key] - fault_at
        start = reform["t"]
    else:
        restore = next((e for e in events if e.get("event") == "restore"), None)
        if restore is None:
            return out
        out["restored"] = restore["t"] - fault_at
        start = restore["t"]
    first = next((e["t"] for e in events if e.get("event") == "step" and e["t"] > start), None)
    if first is not None:
        out["first_step"] = first - fault_at
    return out


def stalwart_trial(case: Case, workdir: Path, index: int, timeout: float, throttle_mbps: float = 1.0) -> FaultTrial:
    from stalwart.chaos.netns import unavailable_reason
    from stalwart.chaos.runner import Runner
    from stalwart.chaos.scenario import from_mapping

    kind = case.kind
    if kind == "network-cut" and unavailable_reason():
        return FaultTrial("stalwart", kind, None, None, str(unavailable_reason()), case.label)
    victim = f"node{case.nodes - 1}"
    scenario = from_mapping({
        "name": f"bench-{kind}", "seed": index,
        "cluster": {"etcd_members": 1, "daemons": 1, "nodes": case.nodes, "workers_per_node": 1, "lease_ttl": 2,
                    "spares": case.spares, "reform_in_place": case.reform_in_place,
                    # a node of its own address, as on separate hosts: its survivors can name it lost
                    "node_network": kind == "kill-node"},
        "job": {**JOB, "steps": FAULT_AT_STEP + 50, "peer_replicas": case.peer_replicas,
                "restore_read_mbps": throttle_mbps if case.throttled else 0.0},
        "fault": [{"kind": kind, "at_step": FAULT_AT_STEP, "node": victim, "duration": 4.0}],
    })
    work = workdir / (f"stalwart-{kind}-{case.nodes}-{case.spares}-{int(case.reform_in_place)}-"
                      f"{case.peer_replicas}-{int(case.throttled)}-{index}")
    runner = Runner(scenario, work, progress=lambda line: None, timeout=timeout + 150, reference=False)
    report = runner.run()
    if not report.faults:
        return FaultTrial("stalwart", kind, None, None, "; ".join(report.notes) or "not injected", case.label)
    f = report.faults[0]
    failed = [name for name, ok in report.checks.items() if not ok]
    first_new = next((r for r in report.rounds if r.t > f.injected_at), None)
    t0 = json_first_t(work / "run" / "steps.jsonl", report)
    phases = _phases(work / "run" / "steps.jsonl", t0 + f.injected_at,
                     None if first_new is None or first_new.decided_at is None else t0 + first_new.decided_at)
    after = next((r for r in report.restores if r.t > f.injected_at), None)
    restore = {} if after is None else {"step": after.step, "own_memory": after.own_memory_bytes,
                                        "peer_memory": after.peer_memory_bytes, "storage": after.storage_bytes}
    return FaultTrial("stalwart", kind, f.detection_s, f.recovery_s,
                      "resumed" if not failed else f"checks failed: {failed}", case.label, phases, restore)


def json_first_t(steps_log: Path, report: object) -> float:
    """The run's start on the record's clock: the first step's time minus its offset in the report."""
    first = next(e for e in rows(steps_log) if e.get("event") == "step")
    return float(first["t"]) - report.samples[0].t  # type: ignore[attr-defined]


def _workers(torchrun: subprocess.Popen[bytes]) -> set[int]:
    import psutil

    try:
        return {c.pid for c in psutil.Process(torchrun.pid).children() if c.status() != psutil.STATUS_ZOMBIE}
    except psutil.NoSuchProcess:
        return set()


def torchrun_trial(case: Case, workdir: Path, index: int, timeout: float) -> FaultTrial:
    kind, label = case.kind, f"{case.nodes} nodes"
    if kind == "network-cut":
        return FaultTrial("c10d", kind, None, None, "not measured: torchrun's simulated nodes share loopback here",
                          label)
    log = workdir / f"c10d-{kind}-{case.nodes}-{index}.jsonl"
    job = f"bench-c10d-{kind}-{case.nodes}-{index}-{os.getpid()}"
    endpoint = f"127.0.0.1:{free_port()}"
    built = REPO / ".venv" / "torch_extensions"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(built)))
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(case.nodes):
            args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{case.nodes - 1}:{case.nodes}",
                    "--nproc-per-node", "1",
                    "--max-restarts", "20", "--monitor-interval", "0.2", "--local-addr", "127.0.0.1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--rdzv-conf", TIMING,
                    str(GPT), "--ckpt-dir", str(workdir / f"c10d-{kind}-{case.nodes}-{index}-ckpt"),
                    "--steps", "100000",
                    "--global-batch", str(JOB["global_batch"]), "--micro-batch", str(JOB["micro_batch"]),
                    "--dataset-len", str(JOB["samples"]), "--zero-stage", str(JOB["zero_stage"]),
                    "--save-every", str(JOB["checkpoint_every"]), "--steps-log", str(log),
                    "--step-sleep", str(JOB["step_time"]), "--dropout", "0"]
            with open(workdir / f"c10d-{kind}-{case.nodes}-{index}-node{i}.out", "ab") as out:
                nodes.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
            if i == 0:
                time.sleep(1.0)  # node0 hosts c10d's store; the victim is node2
        deadline = time.monotonic() + 180
        while not any(r.get("event") == "step" and r.get("world_size") == case.nodes and r["step"] >= FAULT_AT_STEP
                      for r in rows(log)):
            if time.monotonic() > deadline:
                return FaultTrial("c10d", kind, None, None, f"never trained at world size {case.nodes}", label)
            time.sleep(0.1)
        victim = nodes[-1]
        survivors = nodes[:-1] if kind == "kill-node" else nodes
        before = [_workers(n) for n in survivors]
        worker = min(_workers(victim))
        fault_at = time.time()
        if kind == "kill-worker":
            os.kill(worker, 9)
        elif kind == "kill-node":
            kill_tree(victim.pid)
        elif kind == "hang-worker":
            os.kill(worker, 19)  # SIGSTOP
        detected: float | None = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = time.time()
            gone = {worker} if kind != "hang-worker" else set()  # a stopped worker is still there
            if detected is None and any(_workers(n) != b - gone for n, b in zip(survivors, before, strict=True)):
                detected = now - fault_at  # a torchrun stopped or replaced a worker: the fault was acted on
            events = [r for r in rows(log) if r.get("t", 0) > fault_at]
            restores = [r["t"] for r in events if r.get("event") == "restore"]
            if restores:
                steps = [r["t"] for r in events if r.get("event") == "step" and r["t"] > min(restores)]
                if steps:
                    return FaultTrial("c10d", kind, detected, min(steps) - fault_at, "resumed", label)
            time.sleep(0.05)
        return FaultTrial("c10d", kind, detected, None, f"no resumed step within {timeout:g} s", label)
    finally:
        for p in nodes:
            kill_tree(p.pid)
            p.wait()


CASES = {
    "kill-worker": [Case("kill-worker", nodes=2, spares=1), Case("kill-worker", nodes=3),
                    Case("kill-worker", nodes=3, reform_in_place=False)],
    "kill-node": [Case("kill-node", nodes=3), Case("kill-node", nodes=3, peer_replicas=0),
                  Case("kill-node", nodes=3, throttled=True),
                  Case("kill-node", nodes=3, peer_replicas=0, throttled=True)],
    "hang-worker": [Case("hang-worker", nodes=3)],
    "network-cut": [Case("network-cut", nodes=3)],
}
PHASES = ("decided", "error_seen", "reform_begun", "group_up", "engine_built", "restored", "first_step")


def faults_suite(args: argparse.Namespace) -> int:
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        print(f"unknown fault kind {unknown[0]!r} (known: {list(FAULT_KINDS)})", file=sys.stderr)
        return 2
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"  # noqa: E731
    trials: list[FaultTrial] = []
    with contextlib.ExitStack() as stack:
        if args.keep:
            workdir = Path(args.keep)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stalwart-faults-")))
        for kind in kinds:
            runs: list[tuple[str, Case]] = [("stalwart", c) for c in CASES[kind]]
            runs += [("c10d", c) for c in {(c.nodes): c for c in CASES[kind]
                                           if c.reform_in_place and c.peer_replicas and not c.throttled}.values()]
            runs = [(system, c) for system, c in runs if system in args.systems.split(",")
                    and (c.reform_in_place or not args.skip_restart)
                    and (not args.nodes or c.nodes in [int(n) for n in args.nodes.split(",")])]
            for system, case in runs:
                n = args.trials if system == "stalwart" else args.c10d_trials
                for i in range(n):
                    if system == "stalwart":
                        t = stalwart_trial(case, workdir, i, args.timeout, args.throttle_mbps)
                    else:
                        t = torchrun_trial(case, workdir, i, args.timeout)
                    trials.append(t)
                    print(f"[{kind} {system} {t.case} {i + 1}/{n}] detected {fmt(t.detected_s)} s, "
                          f"resumed {fmt(t.resumed_s)} s: {t.detail}", flush=True)
                    if t.detail.startswith("not measured") or "root" in t.detail:
                        break  # the same for every trial

    def med(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    summary = []
    for key in dict.fromkeys((t.kind, t.system, t.case) for t in trials):
        mine = [t for t in trials if (t.kind, t.system, t.case) == key]
        row: dict[str, object] = {
            "kind": key[0], "system": key[1], "case": key[2], "trials": len(mine),
            "resumed": sum(t.resumed_s is not None for t in mine),
            "detect_median_s": med([t.detected_s for t in mine]),
            "resume_median_s": med([t.resumed_s for t in mine]),
            "resume_max_s": max((t.resumed_s for t in mine if t.resumed_s is not None), default=None),
            "phases_median_s": {p: med([t.phases.get(p) for t in mine]) for p in PHASES
                                if any(p in t.phases for t in mine)},
            "restore_bytes_median": {k: med([t.restore.get(k) for t in mine])  # type: ignore[misc]
                                     for k in ("own_memory", "peer_memory", "storage")
                                     if any(k in t.restore for t in mine)},
        }
        summary.append(row)
    for row in summary:  # stalwart's median beside torchrun's on the same fault and node count
        nodes = str(row["case"]).split()[0]
        ref = next((r for r in summary if r["system"] == "c10d" and r["kind"] == row["kind"]
                    and str(r["case"]).split()[0] == nodes), None)
        s_res, c_res = row["resume_median_s"], ref["resume_median_s"] if ref else None
        row["ratio_to_c10d"] = s_res / c_res if isinstance(s_res, float) and isinstance(c_res, float) else None
    print()
    print(f"{'fault':<12} {'system':<9} {'case':<24} {'ok':>5} {'detect':>7} {'resumed':>8} {'max':>6} {'ratio':>6}"
          f"   phases (median s from the fault)")
    for r in summary:
        phases = " ".join(f"{k}={fmt(v)}" for k, v in r["phases_median_s"].items())  # type: ignore[attr-defined]
        print(f"{r['kind']:<12} {r['system']:<9} {r['case']:<24} {r['resumed']}/{r['trials']:<3} "
              f"{fmt(r['detect_median_s']):>7} {fmt(r['resume_median_s']):>8} {fmt(r['resume_max_s']):>6} "
              f"{fmt(r['ratio_to_c10d']):>6}   {phases}")
    print("(medians in seconds from the fault; ratio = stalwart resumed / c10d resumed with the same node count)")
    nodes_lost = [r for r in summary if r["kind"] == "kill-node" and r["system"] == "stalwart"]
    if nodes_lost:
        print(f"\nkill-node restores (medians; storage throttled to {args.throttle_mbps:g} MB/s per rank "
              "where marked):")
        fmtb = lambda v: f"{int(v):,}" if v is not None else "-"  # noqa: E731
        print(f"{'case':<34} {'own memory B':>13} {'peer memory B':>14} {'storage B':>10} {'restore s':>10} "
              f"{'resumed s':>10}")
        for r in nodes_lost:
            b, ph = r["restore_bytes_median"], r["phases_median_s"]
            took = ph["restored"] - ph["engine_built"] if "restored" in ph and "engine_built" in ph else None  # type: ignore[operator]
            r["restore_s_median"] = took
            print(f"{r['case']:<34} {fmtb(b.get('own_memory')):>13} {fmtb(b.get('peer_memory')):>14} "  # type: ignore[attr-defined]
                  f"{fmtb(b.get('storage')):>10} {fmt(took):>10} {fmt(r['resume_median_s']):>10}")  # type: ignore[attr-defined]
        for slow in (False, True):
            same = [r for r in nodes_lost if ("throttled" in str(r["case"])) == slow]
            peer = next((r for r in same if "peers" in str(r["case"])), None)
            disk = next((r for r in same if "storage" in str(r["case"])), None)
            if peer and disk and isinstance(peer.get("restore_s_median"), float) and \
                    isinstance(disk.get("restore_s_median"), float) and peer["restore_s_median"] > 0:
                ratio = disk["restore_s_median"] / peer["restore_s_median"]  # type: ignore[operator]
                print(f"restore from storage / from peers{' (throttled)' if slow else ''}: {ratio:.1f}x")
    out = Path(args.out or REPO / "bench" / "results" / "faults.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "trials": [asdict(t) for t in trials], "job": JOB,
                               "fault_at_step": FAULT_AT_STEP, "rdzv_conf": TIMING, "timeout_s": args.timeout},
                              indent=2))
    print(f"\nwrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("faults", "rendezvous"), default="faults")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS), help="faults suite: comma-separated kinds")
    parser.add_argument("--trials", type=int, default=3, help="trials per mode (faults suite: per stalwart case)")
    parser.add_argument("--c10d-trials", type=int, default=3, help="faults suite: trials per torchrun case")
    parser.add_argument("--systems", default="stalwart,c10d", help="faults suite: which systems to run")
    parser.add_argument("--nodes", default="", help="faults suite: only the cases of these node counts (e.g. 2)")
    parser.add_argument("--stalwart-trials", type=int, default=None, help="override --trials for stalwart")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds to wait for recovery")
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/<suite>.json)")
    parser.add_argument("--skip-restart", action="store_true",
                        help="faults suite: leave out stalwart's restart-everything cases")
    parser.add_argument("--throttle-mbps", type=float, default=1.0,
                        help="faults suite: restore reads from storage per rank in the throttled kill-node cases")
    parser.add_argument("--keep", default=None, help="faults suite: run in this folder and keep it (logs, records)")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=JOB["zero_stage"],
                        help="faults suite: the job's ZeRO stage")
    args = parser.parse_args()
    JOB["zero_stage"] = args.zero_stage
    # SIGTERM unwinds like Ctrl-C, so every trial's processes are torn down by its ``finally``.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.suite == "faults":
        return faults_suite(args)
    args.out = args.out or str(REPO / "bench" / "results" / "recovery.json")

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
