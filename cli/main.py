"""Entry point of the ``stalwart`` command.

Each subcommand module exposes ``register(subparsers)``; this module only wires them up.
Commands are thin: parse arguments, call one function, print.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stalwart.cli import (
    agent_cmd,
    chaos_cmd,
    ckpt_cmd,
    cordon_cmd,
    daemon_cmd,
    logs,
    slurm_cmd,
    status_cmd,
    version_cmd,
)

# Subcommand modules, each with ``register(subparsers) -> None``. Later features append here.
_COMMANDS = [version_cmd, chaos_cmd, ckpt_cmd, agent_cmd, daemon_cmd, status_cmd, cordon_cmd, slurm_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stalwart",
        description="Fault-tolerant elastic training for PyTorch and DeepSpeed.",
    )
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="one event a line, as text or as JSON objects")
    parser.add_argument("--log-file", metavar="PATH", help="log to this file, rotated (default: stderr)")
    parser.add_argument("--log-max-bytes", type=int, default=64 << 20, help="rotate the log file at this size")
    parser.add_argument("--log-backups", type=int, default=4, help="rotated log files kept")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format, args.log_file, args.log_max_bytes, args.log_backups)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
