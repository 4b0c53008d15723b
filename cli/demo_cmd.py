"""``stalwart demo``: the main job on one machine.

For now it runs the coordination self-check (a local 3-member etcd, simulated nodes,
injected faults, a report); the chaos runner's survival scenario will take its place.
"""

from __future__ import annotations

import argparse

from stalwart.coord.selfcheck import run_selfcheck


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a local cluster, inject faults and report how it survived")
    p.add_argument("--nodes", type=int, default=3, help="simulated nodes (default 3)")
    p.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds (default 2)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = run_selfcheck(nodes=args.nodes, ttl=args.ttl)
    print()
    print(report.table())
    print(f"\nresult: {'all checks passed' if report.passed else 'FAILED'}")
    return 0 if report.passed else 1
