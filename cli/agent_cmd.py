"""``stalwart agent --config FILE``: run the node agent (a systemd ``Type=notify`` service).

Start-up failures are one line on stderr, never a traceback. Exit codes: 0 stopped by
SIGTERM/SIGINT (or ``--check`` passed); 1 etcd refused the agent (credentials, permissions) or
failed while it registered; 2 invalid configuration, an unusable TLS file, or an address that
cannot be bound. An etcd that does not answer is waited for, with a warning a try, as the daemon
does; systemd hears ``READY=1`` only once the node is registered.

SIGTERM is a leave: the agent stops its workers and tells the daemon it leaves on purpose.
SIGUSR1 (the unit's ``RestartKillSignal=``, so ``systemctl restart``) is a hand-off: the workers
train on and the lease stays, and the next agent adopts both, so an upgrade costs no step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import asdict

from stalwart.agent.config import AgentConfig, AgentConfigError, load, security_warnings, tls_credentials
from stalwart.cli import logs, systemd
from stalwart.coord.config import PASSWORD_ENV

EXIT_OK, EXIT_ETCD, EXIT_CONFIG = 0, 1, 2
HANDOFF_SIGNAL = signal.SIGUSR1

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run the node agent")
    p.add_argument("--config", required=True, help="agent config file (TOML)")
    p.add_argument("--check", action="store_true",
                   help="validate the configuration and its TLS files, print it and exit")
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


def shown(config: AgentConfig) -> dict[str, object]:
    """The configuration as ``--check`` prints it: every setting, the etcd password masked."""
    out = asdict(config)
    if out["etcd"].get("password"):
        out["etcd"]["password"] = "***"
    out["progress_socket"] = str(config.socket_path)
    return out


def run(args: argparse.Namespace) -> int:
    from stalwart.agent.service import BindError
    from stalwart.coord.errors import CoordError

    overrides = {"node_id": args.node_id, "listen": args.listen, "state_dir": args.state_dir,
                 "insecure": args.insecure, "fault_injection": args.fault_injection, "spares": args.spares,
                 "reform_in_place": args.reform_in_place}
    try:
        config = load(args.config, overrides)
        if not config.insecure:
            tls_credentials(config.tls)  # a bad certificate is named here, not as "failed to bind"
    except AgentConfigError as exc:
        return _fail(exc, EXIT_CONFIG)
    os.environ.pop(PASSWORD_ENV, None)  # read; the workers, which inherit the environment, need not see it
    warnings = security_warnings(config)
    if args.check:
        print(json.dumps(shown(config), indent=2))
        for line in warnings:
            print(f"stalwart agent: warning: {line}", file=sys.stderr)
        return EXIT_OK
    for line in warnings:
        log.warning("%s", line, extra={"node": config.node_id})
    from stalwart.agent.health import ProbeUnavailable
    from stalwart.agent.node import NodeAgent  # after validation: a bad config costs no imports

    try:
        agent = NodeAgent(config)
    except ProbeUnavailable as exc:
        return _fail(exc, EXIT_CONFIG)
    context = logs.AgentContext(config.node_id, agent.round_number_nowait)
    for handler in logging.getLogger().handlers:
        handler.addFilter(context)
    stop = threading.Event()
    started = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        if started.is_set():
            agent.shutdown()

    def on_handoff(signum: int, frame: object) -> None:
        # A restart (the unit's RestartKillSignal): the workers and the lease stay for the successor.
        stop.set()
        if started.is_set():
            agent.handoff()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(HANDOFF_SIGNAL, on_handoff)
    try:
        if not agent.start(cancel=stop):
            agent.shutdown()
            return EXIT_OK  # stopped while waiting for etcd
    except (AgentConfigError, BindError) as exc:
        agent.shutdown()
        return _fail(exc, EXIT_CONFIG)
    except CoordError as exc:
        agent.shutdown()
        return _fail(exc, EXIT_ETCD)
    started.set()
    if stop.is_set():  # a signal came while starting
        agent.shutdown()
    systemd.notify("READY=1", f"STATUS=agent {config.node_id} serving on {agent.address}")
    # Pings only while the agent's loops go round: a loop stuck in a call gets the agent restarted
    # (its workers train on and the successor adopts them).
    stale_after = 2 * (systemd.watchdog_interval() or 0.0)
    systemd.start_watchdog(lambda: not stop.is_set() and agent.alive(stale_after), stop)
    agent.run()
    systemd.notify("STOPPING=1")
    return EXIT_OK


def _fail(exc: Exception, code: int) -> int:
    print(f"stalwart agent: {exc}", file=sys.stderr)
    return code
