"""``stalwart status``: the job's round, nodes and newest checkpoint, read from etcd.

Also home of the etcd connection flags shared by the commands that talk to etcd directly
(``status``, ``cordon``, ``uncordon``).

Exit codes: 0 shown; 1 etcd could not be read; 2 bad arguments; 3 shown, but no daemon leads the
job (no round opens, shrinks or regrows; the text says so on the ``leader:`` line, the JSON has
``"leading": false``), or etcd holds nothing of the job at all (a mistyped ``--job``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_OK, EXIT_ETCD, EXIT_USAGE, EXIT_NO_LEADER = 0, 1, 2, 3
PASSWORD_ENV = "STALWART_ETCD_PASSWORD"


def add_etcd_arguments(p: argparse.ArgumentParser, *, job_required: bool = True) -> None:
    """``--endpoints``, ``--job`` and the TLS/auth flags."""
    p.add_argument("--endpoints", default="127.0.0.1:2379",
                   help="etcd endpoints, comma-separated HOST:PORT (https:// for TLS; default 127.0.0.1:2379)")
    p.add_argument("--job", required=job_required, help="the job's name (its keys live under /stalwart/JOB/)")
    p.add_argument("--etcd-timeout", type=float, default=5.0, help="deadline of one etcd call (default 5)")
    p.add_argument("--ca-file", help="CA bundle for TLS")
    p.add_argument("--cert-file", help="client certificate for mutual TLS")
    p.add_argument("--key-file", help="client key for mutual TLS")
    p.add_argument("--user", help=f"etcd user (password from ${PASSWORD_ENV} or --password)")
    p.add_argument("--password", help=f"etcd password (prefer ${PASSWORD_ENV} or --password-file: flags show in ps)")
    p.add_argument("--password-file", help="file holding the etcd password")


def etcd_config(args: argparse.Namespace):  # -> EtcdConfig (imported lazily: fast --help)
    from stalwart.coord.config import EtcdConfig

    password = args.password
    if password is None and args.password_file is None:
        password = os.environ.get(PASSWORD_ENV)
    return EtcdConfig(endpoints=args.endpoints, timeout=args.etcd_timeout,
                      attempt_timeout=min(2.0, args.etcd_timeout), ca_file=args.ca_file,
                      cert_file=args.cert_file, key_file=args.key_file, user=args.user,
                      password=password if args.user else None,
                      password_file=args.password_file if args.user else None)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="the job's round, world, step rate, goodput, last faults and their cost, "
                                      "nodes and newest checkpoint")
    add_etcd_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.errors import CoordError, EtcdConfigError
    from stalwart.daemon.status import format_table, read_status

    try:
        config = etcd_config(args)
    except EtcdConfigError as exc:
        print(f"stalwart status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with EtcdClient(config) as client:
            status = read_status(client, args.job)
    except EtcdConfigError as exc:
        print(f"stalwart status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CoordError as exc:
        print(f"stalwart status: {exc}", file=sys.stderr)
        return EXIT_ETCD
    if args.json:
        print(json.dumps(status.to_dict(), indent=2))
    else:
        print(format_table(status))
    if not status.exists:
        print(f"stalwart status: job {args.job!r} has nothing in etcd (a typo?)", file=sys.stderr)
        return EXIT_NO_LEADER
    return EXIT_OK if status.leading else EXIT_NO_LEADER
