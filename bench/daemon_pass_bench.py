"""The daemon's per-pass work against the world size, without etcd: one pass is what the loop
does with one watch batch (feed the round machine, feed the straggler detector, ask it for the
stragglers). For each size: a pass of every member's progress report, a pass with one report (the
common case at 10,000 nodes: reports arrive spread over the progress interval), a tick, a node
loss that opens the next round; and the straggler detector alone, fast against the simple form
that recomputes every median (the daemon's detector before it kept its busy times sorted).

    .venv/bin/python bench/daemon_pass_bench.py                 # 1k, 3k, 10k
    .venv/bin/python bench/daemon_pass_bench.py --sizes 1000 --no-simple

Prints a table and writes JSON to bench/results/daemon_pass.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "daemon"))  # the simple detector


@dataclass
class Result:
    nodes: int
    pass_all_reports_s: float
    pass_one_report_s: float
    tick_s: float
    node_loss_s: float
    detector_all_reports_s: float
    simple_detector_all_reports_s: float | None


def _best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def run_size(n: int, simple: bool, repeat: int) -> Result:
    from stalwart.daemon.policy import RoundPolicy
    from stalwart.daemon.round_events import LeaseLost, NodeRegistered, ProgressReport, Tick
    from stalwart.daemon.rounds import RoundMachine
    from stalwart.daemon.stragglers import StragglerDetector, StragglerPolicy

    rng = random.Random(n)
    nodes = [f"node{i:05d}" for i in range(n)]
    machine = RoundMachine(RoundPolicy(min_nodes=1, max_nodes=n, regrow_cooldown=0))
    now = 1.0
    [opened] = [d for d in machine.handle_batch([NodeRegistered(x, f"{x}:7077", 8) for x in nodes], now)
                if d.__class__.__name__ == "OpenRound"]
    detector = StragglerDetector(StragglerPolicy())
    detector.reset(nodes)
    step = 0

    def reports() -> list[ProgressReport]:
        nonlocal step
        step += 1
        return [ProgressReport(x, step, now, rng.uniform(0.9, 1.1)) for x in nodes]

    def one_pass(batch: list[ProgressReport]) -> None:
        nonlocal now
        now += 0.01
        machine.handle_batch(batch, now)
        for ev in batch:
            detector.report(ev.node_id, ev.step, ev.busy_time)
        detector.stragglers()

    all_s = _best(lambda: one_pass(reports()), repeat)
    one = reports()
    one_s = _best(lambda: one_pass(one[:1]), repeat * 20)
    tick_s = _best(lambda: one_pass([]) or machine.handle(Tick(), now), repeat * 20)
    victims = iter(nodes[::-1])
    loss_s = _best(lambda: machine.handle_batch([LeaseLost(next(victims))], now), repeat)

    def detector_pass(d: object) -> Callable[[], None]:
        def run() -> None:
            for ev in reports():
                d.report(ev.node_id, ev.step, ev.busy_time)  # type: ignore[attr-defined]
            d.stragglers()  # type: ignore[attr-defined]
        return run

    fast = StragglerDetector(StragglerPolicy())
    fast.reset(nodes)
    fast_s = _best(detector_pass(fast), repeat)
    simple_s = None
    if simple:
        from simple_stragglers import SimpleStragglerDetector

        slow = SimpleStragglerDetector(StragglerPolicy())
        slow.reset(nodes)
        simple_s = _best(detector_pass(slow), 1)
    del opened
    return Result(n, all_s, one_s, tick_s, loss_s, fast_s, simple_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,3000,10000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-simple", action="store_true", help="skip the simple detector (minutes at 10k)")
    ap.add_argument("--out", type=Path, default=RESULTS / "daemon_pass.json")
    args = ap.parse_args(argv)
    logging.disable(logging.INFO)
    results = []
    for n in [int(s) for s in args.sizes.split(",") if s.strip()]:
        r = run_size(n, not args.no_simple, args.repeat)
        results.append(r)
        print(f"{n} nodes done", file=sys.stderr, flush=True)
    print(f"{'nodes':>6} {'pass, all report':>17} {'pass, 1 report':>15} {'tick':>9} {'node loss':>10} "
          f"{'detector':>9} {'simple detector':>16}")
    for r in results:
        simple = f"{r.simple_detector_all_reports_s:>15.3f}s" if r.simple_detector_all_reports_s is not None else \
            f"{'-':>16}"
        print(f"{r.nodes:>6} {r.pass_all_reports_s * 1e3:>15.1f}ms {r.pass_one_report_s * 1e6:>13.0f}us "
              f"{r.tick_s * 1e6:>7.0f}us {r.node_loss_s * 1e3:>8.1f}ms {r.detector_all_reports_s * 1e3:>7.1f}ms "
              f"{simple}")
    print("pass: machine + detector for one watch batch; detector: every member reports once, then stragglers()")
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "load_1min": load},
                                    "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
