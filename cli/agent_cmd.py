"""``stalwart agent --config FILE``: run the node agent (a systemd ``Type=notify`` service)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from stalwart.agent.config import AgentConfigError, load
from stalwart.cli import systemd


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run the node agent")
    p.add_argument("--config", required=True, help="agent config file (TOML)")
    p.add_argument("--node-id", help="override node_id")
    p.add_argument("--listen", help="override listen (HOST:PORT of the gRPC service)")
    p.add_argument("--state-dir", help="override state_dir (worker logs, progress socket)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="serve gRPC over plain TCP (no TLS); never on a shared network")
    p.add_argument("--enable-fault-injection", dest="fault_injection", action="store_true", default=None,
                   help="allow the InjectFault call (chaos testing only)")
    p.add_argument("--spares", type=int, help="override spares (warm spare processes on this node)")
    p.add_argument("--no-reform-in-place", dest="reform_in_place", action="store_false", default=None,
                   help="restart every worker at each round change instead of re-forming in place")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = {"node_id": args.node_id, "listen": args.listen, "state_dir": args.state_dir,
                 "insecure": args.insecure, "fault_injection": args.fault_injection, "spares": args.spares,
                 "reform_in_place": args.reform_in_place}
    try:
        config = load(args.config, overrides)
    except AgentConfigError as exc:
        print(f"stalwart agent: {exc}", file=sys.stderr)
        return 2
    from stalwart.agent.node import NodeAgent  # after validation: a bad config costs no imports

    agent = NodeAgent(config)
    try:
        agent.start()
    except AgentConfigError as exc:
        print(f"stalwart agent: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        agent.shutdown()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    systemd.notify("READY=1", f"STATUS=agent {config.node_id} serving on {agent.address}")
    systemd.start_watchdog(lambda: not stop.is_set(), stop)
    agent.run()
    systemd.notify("STOPPING=1")
    return 0
