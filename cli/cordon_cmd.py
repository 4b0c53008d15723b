"""``stalwart cordon NODE`` / ``stalwart uncordon NODE``: operator holds, written to etcd.

A cordoned node joins no new round; it stays in the current one until the world changes for
another reason (``--drain`` takes it out now). ``uncordon`` lifts a cordon, a drain and a
quarantine, then removes the node's hold and fault-history keys. Holds are kept in etcd, so
they apply whichever daemon leads, now or later.

A job or node etcd knows nothing about is refused (a typo would otherwise hold nothing and
say it worked); ``--force`` writes the hold anyway, e.g. for a node that has not registered yet.

Exit codes: 0 written; 1 etcd could not be written; 2 bad arguments; 3 unknown job or node.
"""

from __future__ import annotations

import argparse
import sys

from stalwart.cli.status_cmd import EXIT_ETCD, EXIT_OK, EXIT_USAGE, add_etcd_arguments, etcd_config

EXIT_UNKNOWN = 3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cordon", help="keep a node out of new rounds (--drain: out of the current one too)")
    p.add_argument("node")
    p.add_argument("--drain", action="store_true", help="take the node out of the current round now")
    p.add_argument("--reason", default="", help="shown in the daemon's logs and in status")
    p.add_argument("--force", action="store_true", help="hold a node (or job) etcd does not know yet")
    add_etcd_arguments(p)
    p.set_defaults(func=run_cordon)
    u = sub.add_parser("uncordon", help="let a cordoned, drained or quarantined node rejoin")
    u.add_argument("node")
    u.add_argument("--force", action="store_true", help="write even when etcd does not know the node")
    add_etcd_arguments(u)
    u.set_defaults(func=run_uncordon)


def _write(args: argparse.Namespace, hold_name: str, reason: str) -> int:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.errors import CoordError, EtcdConfigError
    from stalwart.daemon.codec import Hold
    from stalwart.daemon.status import UnknownTarget, check_known, clear_hold, read_status, set_hold

    try:
        with EtcdClient(etcd_config(args)) as client:
            if not args.force:
                check_known(read_status(client, args.job), args.node)
            if hold_name == "none":
                clear_hold(client, args.job, args.node)
            else:
                set_hold(client, args.job, args.node, Hold(hold_name), reason)
    except UnknownTarget as exc:
        print(f"stalwart {args.command}: {exc}; nothing written (--force to write anyway)", file=sys.stderr)
        return EXIT_UNKNOWN
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
