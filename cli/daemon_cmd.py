"""``stalwart daemon --config FILE``: run the rendezvous daemon of one job.

Every setting of the TOML file has a flag (a flag wins over the file, the file over the
default); ``--check`` validates the merged configuration and prints it without starting.

Exit codes: 0 stopped by SIGTERM/SIGINT; 2 invalid configuration or a port that cannot be bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import sys
import threading
import typing
from dataclasses import asdict, fields

EXIT_OK, EXIT_CONFIG = 0, 2

PASSWORD_ENV = "STALWART_ETCD_PASSWORD"


def _tables() -> list[tuple[str, type, str]]:
    """(table, dataclass, flag prefix): each field of each dataclass becomes a flag."""
    from stalwart.coord.config import EtcdConfig
    from stalwart.daemon.config import DaemonSettings
    from stalwart.daemon.policy import RoundPolicy

    return [("daemon", DaemonSettings, ""), ("etcd", EtcdConfig, "etcd-"), ("policy", RoundPolicy, "")]


def _flag_type(hint: object) -> object:
    for t in (int, float):
        if hint is t:
            return t
    if hint is bool:
        return _boolean
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[:1] == (int,):
        return _int_list
    if typing.get_origin(hint) is tuple:
        return _command
    return str


def _command(text: str) -> tuple[str, ...]:
    """A flag for a list setting (a command): split as a shell would, without running one."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"cannot split {text!r}: {exc}") from None


def _int_list(text: str) -> tuple[int, ...]:
    """A flag for a list of whole numbers (``world_sizes``): ``1,2,4,8``."""
    try:
        return tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


def _boolean(text: str) -> bool:
    """A flag for a boolean setting: true/false (also yes/no, 1/0)."""
    value = text.strip().lower()
    if value in ("true", "yes", "1", "on"):
        return True
    if value in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("daemon", help="run the rendezvous daemon of a job (leader or standby)")
    p.add_argument("--config", metavar="FILE", help="TOML file with [daemon], [etcd] and [policy] tables")
    p.add_argument("--check", action="store_true", help="validate the configuration, print it and exit")
    p.add_argument("--log-format", choices=["text", "json"], default=argparse.SUPPRESS,
                   help="one event a line, as text or as JSON objects (same as the global flag)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=argparse.SUPPRESS,
                   help="same as the global flag")
    for table, cls, prefix in _tables():
        group = p.add_argument_group(f"[{table}] settings (flags win over the file)")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            flag = "--" + prefix + f.name.replace("_", "-")
            hint = hints[f.name]
            kwargs: dict[str, object] = {"dest": f"cfg__{table}__{f.name}", "default": argparse.SUPPRESS,
                                         "metavar": f.name.upper()}
            if f.name == "endpoints":
                flag = "--endpoints"
                kwargs["help"] = "comma-separated HOST:PORT (default 127.0.0.1:2379)"
            else:
                kwargs["type"] = _flag_type(hint)
                default = "" if f.name in ("password", "daemon_id") else f" (default {f.default!r})"
                kwargs["help"] = f"{table}.{f.name}{default}"
            group.add_argument(flag, **kwargs)  # type: ignore[arg-type]
    p.set_defaults(func=run)


def overrides_from(args: argparse.Namespace, environ: typing.Mapping[str, str] | None = None
                   ) -> dict[str, dict[str, object]]:
    """The settings given as flags, per table; the etcd password may come from the environment
    (``STALWART_ETCD_PASSWORD``) so that it shows neither in a file nor in ``ps``."""
    out: dict[str, dict[str, object]] = {}
    for name, value in vars(args).items():
        if name.startswith("cfg__"):
            _, table, key = name.split("__", 2)
            out.setdefault(table, {})[key] = value
    password = (os.environ if environ is None else environ).get(PASSWORD_ENV)
    if password and "password" not in out.get("etcd", {}):
        out.setdefault("etcd", {})["password"] = password
    return out


_ABOUT_ROUND = re.compile(r"^round (\d+)\b")
_ABOUT_NODE = re.compile(r"\bnode ([A-Za-z0-9][A-Za-z0-9._-]*):")


class _RoundContext(logging.Filter):
    """Gives every log record that does not carry them the round (and node) it is about.

    A message that begins "round N" is about round N, even while the daemon's newest round is
    still N-1 (the machine logs its decision before the loop writes it); one that names
    "node X:" is about node X. Anything else gets the daemon's newest round.
    """

    def __init__(self, daemon: object) -> None:
        super().__init__()
        self._daemon = daemon

    def filter(self, record: logging.LogRecord) -> bool:
        if hasattr(record, "round") and hasattr(record, "node"):
            return True
        message = record.getMessage()
        if not hasattr(record, "round"):
            about = _ABOUT_ROUND.match(message)
            record.round = int(about.group(1)) if about else self._daemon.round_number  # type: ignore[attr-defined]
        if not hasattr(record, "node"):
            node = _ABOUT_NODE.search(message)
            if node:
                record.node = node.group(1)
        return True


def run(args: argparse.Namespace) -> int:
    from stalwart.daemon.config import ConfigError, load_config
    from stalwart.daemon.loop import Daemon

    try:
        config = load_config(args.config, overrides_from(args))
    except ConfigError as exc:
        print(f"stalwart daemon: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check:
        shown = {"daemon": asdict(config.daemon), "etcd": asdict(config.etcd), "policy": asdict(config.policy)}
        if shown["etcd"].get("password"):
            shown["etcd"]["password"] = "***"
        print(json.dumps(shown, indent=2))
        return EXIT_OK
    try:
        daemon = Daemon.from_config(config)
    except OSError as exc:
        print(f"stalwart daemon: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    context = _RoundContext(daemon)
    for handler in logging.getLogger().handlers:
        handler.addFilter(context)
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    logging.getLogger(__name__).info("daemon %s for job %s starting", config.daemon.daemon_id, config.daemon.job)
    try:
        daemon.run(stop)
    finally:
        daemon.close()
    return EXIT_OK
