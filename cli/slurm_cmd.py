"""``stalwart slurm wait``: the end of a batch job that runs a stalwart world (deploy/slurm/).

Polls the job in etcd until it is over and says how, so the batch script (and ``sacct``) ends
with a clear status. Exit codes: 0 training reached ``--until-step`` (a checkpoint of that step
committed); 1 etcd could not be read for ``--form-timeout``; 2 bad arguments; 3 the world can no
longer be formed (no open round for ``--form-timeout``; the daemon's reason is printed); 4 the job
gave up (training diverged).
"""

from __future__ import annotations

import argparse
import sys
import time

from stalwart.cli.status_cmd import add_etcd_arguments, etcd_config

EXIT_DONE, EXIT_ETCD, EXIT_USAGE, EXIT_CANNOT_FORM, EXIT_GAVE_UP = 0, 1, 2, 3, 4


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slurm", help="helpers for running a job under Slurm (deploy/slurm/)")
    inner = p.add_subparsers(dest="slurm_command", metavar="SUBCOMMAND", required=True)
    w = inner.add_parser("wait", help="wait until the job is over: last step reached, no world, or gave up")
    add_etcd_arguments(w)
    w.add_argument("--until-step", type=int, required=True, help="the job's last step")
    w.add_argument("--form-timeout", type=float, default=600.0,
                   help="seconds without an open round after which the world counts as lost (default 600)")
    w.add_argument("--interval", type=float, default=2.0, help="seconds between two reads of etcd (default 2)")
    w.set_defaults(func=run_wait)


def run_wait(args: argparse.Namespace) -> int:
    from stalwart.coord.client import EtcdClient
    from stalwart.coord.errors import CoordError, EtcdConfigError
    from stalwart.daemon.outcome import Outcome, decide
    from stalwart.daemon.status import read_status

    if args.until_step < 0 or args.form_timeout <= 0 or args.interval <= 0:
        print("stalwart slurm wait: --until-step must be >= 0, --form-timeout and --interval > 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = etcd_config(args)
    except EtcdConfigError as exc:
        print(f"stalwart slurm wait: {exc}", file=sys.stderr)
        return EXIT_USAGE
    unformed_since: float | None = time.monotonic()
    unread_since: float | None = None
    last_said = ""
    with EtcdClient(config) as client:
        while True:
            now = time.monotonic()
            try:
                st = read_status(client, args.job)
            except CoordError as exc:
                unread_since = unread_since or now
                if now - unread_since >= args.form_timeout:
                    print(f"stalwart slurm wait: etcd unreadable for {now - unread_since:.0f}s: {exc}",
                          file=sys.stderr)
                    return EXIT_ETCD
                time.sleep(args.interval)
                continue
            unread_since = None
            round_open = bool(st.round) and not st.round["closed"]  # type: ignore[index]
            unformed_since = None if round_open else (unformed_since or now)
            gave_up = next((f"node {r.node}: {r.gave_up}" for r in st.nodes if r.gave_up), "")
            verdict = decide(committed_step=int(st.checkpoint["step"]) if st.checkpoint else None,  # type: ignore[call-overload]
                             until_step=args.until_step, round_open=round_open, gave_up=gave_up,
                             leading=st.leading, status_reason=str((st.status or {}).get("reason", "")),
                             unformed_since=unformed_since, now=now, form_timeout=args.form_timeout)
            if verdict.outcome is Outcome.RUNNING:
                if verdict.reason != last_said:
                    print(f"stalwart slurm wait: job {args.job}: {verdict.reason}", flush=True)
                    last_said = verdict.reason
                time.sleep(args.interval)
                continue
            print(f"stalwart slurm wait: job {args.job}: {verdict.outcome.value}: {verdict.reason}", flush=True)
            return {Outcome.DONE: EXIT_DONE, Outcome.CANNOT_FORM: EXIT_CANNOT_FORM,
                    Outcome.GAVE_UP: EXIT_GAVE_UP}[verdict.outcome]
