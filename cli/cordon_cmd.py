"""``stalwart cordon NODE`` / ``stalwart uncordon NODE``: operator holds, written to etcd.

A cordoned node joins no new round; it stays in the current one until the world changes for
another reason (``--drain`` takes it out now). ``uncordon`` lifts a cordon, a drain and a
quarantine. Holds are kept in etcd, so they apply whichever daemon leads, now or later, and
to nodes that are not registered yet.

Exit codes: 0 written; 1 etcd could not be written; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from stalwart.cli.status_cmd import EXIT_ETCD, EXIT_OK, EXIT_USAGE, add_etcd_arguments, etcd_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cordon", help="keep a node out of new rounds (--drain: out of the current one too)")
    p.add_argument("node")
    p.add_argument("--drain", action="store_true", help="take the node out of the current round now")
    p.add_argument("--reason", default="", help="shown in the daemon's logs and in status")
    add_etcd_arguments(p)
    p.set_defaults(func=run_cordon)
    u = sub.add_parser("uncordon", help="let a cordoned, drained or quarantined node rejoin")
    u.add_argument("node")
    add_etcd_arguments(u)
    u.set_defaults(func=run_uncordon)


def _write(args: argparse.Namespace, hold_name: str, reason: str) -> int:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.errors import CoordError, EtcdConfigError
    from stalwart.daemon.codec import Hold
    from stalwart.daemon.status import set_hold

    try:
        with EtcdClient(etcd_config(args)) as client:
            set_hold(client, args.job, args.node, Hold(hold_name), reason)
    except EtcdConfigError as exc:
        print(f"stalwart {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CoordError as exc:
        print(f"stalwart {args.command}: {exc}", file=sys.stderr)
        return EXIT_ETCD
    done = {"cordon": "cordoned", "drain": "drained", "none": "uncordoned"}[hold_name]
    print(f"node {args.node} {done} in job {args.job}")
    return EXIT_OK


def run_cordon(args: argparse.Namespace) -> int:
    return _write(args, "drain" if args.drain else "cordon", args.reason)


def run_uncordon(args: argparse.Namespace) -> int:
    return _write(args, "none", "")
