"""``stalwart chaos run SCENARIO`` and ``stalwart demo``: a local cluster, training, faults, a report."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

SCENARIOS = Path(__file__).resolve().parent.parent / "chaos" / "scenarios"


def register(sub: argparse._SubParsersAction) -> None:
    chaos = sub.add_parser("chaos", help="fault injection against a real local run")
    csub = chaos.add_subparsers(dest="chaos_command", metavar="COMMAND", required=True)
    run = csub.add_parser("run", help="run a scenario file and write its report")
    run.add_argument("scenario", help=f"scenario file (TOML), or a name from {SCENARIOS.name}/")
    _common(run)
    run.set_defaults(func=run_scenario)
    demo = sub.add_parser("demo", help="the default chaos scenario on this machine, with a report")
    _common(demo)
    demo.set_defaults(func=run_demo, scenario="default")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="report directory (default: a new temporary directory)")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up after this many seconds (default: 900, or the scenario's random-fault "
                        "duration plus 900 when that is longer: the soak runs 1,800 s)")
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free reference run")


def default_timeout(scenario: object) -> float:
    """900 s, or a scenario's random-fault window plus 900 s (a run must outlast its faults)."""
    random = getattr(scenario, "random", None)
    return 900.0 + (float(random.duration_s) if random is not None else 0.0)


def _resolve(name: str) -> Path:
    path = Path(name)
    if path.exists():
        return path
    shipped = SCENARIOS / f"{name}.toml"
    if shipped.exists():
        return shipped
    shipped_names = sorted(p.stem for p in SCENARIOS.glob("*.toml"))
    raise SystemExit(f"stalwart chaos: no scenario {name!r} (not a file, and not one of {shipped_names})")


def run_scenario(args: argparse.Namespace) -> int:
    from stalwart.chaos import report as report_mod
    from stalwart.chaos.runner import Runner
    from stalwart.chaos.scenario import ScenarioError, load

    try:
        scenario = load(_resolve(args.scenario))
    except ScenarioError as exc:
        print(f"stalwart chaos: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"stalwart-chaos-{scenario.name}-"))
    faults = len(scenario.faults) + len(scenario.random_faults())
    print(f"scenario {scenario.name}: {scenario.cluster.nodes} nodes x {scenario.cluster.workers_per_node} workers, "
          f"{scenario.cluster.etcd_members} etcd members, {scenario.cluster.daemons} daemons, "
          f"{scenario.job.steps} steps, {faults} faults; working in {out}", flush=True)
    # SIGTERM (a timeout, systemd, kill) must tear the cluster down like Ctrl-C does.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    timeout = args.timeout if args.timeout is not None else default_timeout(scenario)
    runner = Runner(scenario, out / "work", progress=lambda line: print(line, flush=True), timeout=timeout,
                    reference=not args.no_reference)
    report = runner.run()
    paths = report_mod.write(report, out)
    print()
    print(f"{'fault':<20} {'target':<8} {'detected after s':>17} {'resumed after s':>16} {'lost s':>7} {'redone':>6}")
    for f in report.faults:
        det = "-" if f.detection_s is None else f"{f.detection_s:.2f}"
        res = "-" if f.recovery_s is None else f"{f.recovery_s:.2f}"
        lost = "-" if f.lost_s is None else f"{f.lost_s:.2f}"
        print(f"{f.kind:<20} {f.target:<8} {det:>17} {res:>16} {lost:>7} {f.redone_steps:>6}")
    if report.badput:
        causes = ", ".join(f"{cause} {v:.1f}" for cause, v in report.badput.items() if v > 0)
        print(f"\nlost time by cause (s): {causes}")
    print()
    for name, ok in report.checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    for note in report.notes:
        print(f"  note: {note}")
    print(f"\nresult: {'PASSED' if report.passed else 'FAILED'} in {report.wall_s:.0f} s, goodput {report.goodput:.0%}")
    print(f"report: {paths['markdown']}\npicture: {paths.get('picture', '- (needs stalwart[chaos])')}")
    return 0 if report.passed else 1


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_demo(args: argparse.Namespace) -> int:
    return run_scenario(args)
