"""``stalwart version``: the versions that matter when reporting a problem."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess

_DISTRIBUTIONS = ["stalwart", "torch", "deepspeed", "grpcio", "protobuf", "etcd-sdk-python", "zstandard"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print stalwart's version and those of its dependencies")
    p.add_argument("--short", action="store_true", help="print stalwart's version only")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _etcd_version() -> str:
    exe = shutil.which("etcd")
    if not exe:
        return "not found"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    first = out.splitlines()[0] if out else ""
    return first.split(":", 1)[-1].strip() or "unknown"


def collect() -> dict[str, str]:
    versions = {name: _dist_version(name) for name in _DISTRIBUTIONS}
    versions["etcd"] = _etcd_version()
    return versions


def run(args: argparse.Namespace) -> int:
    if args.short:
        print(f"stalwart {_dist_version('stalwart')}")
        return 0
    versions = collect()
    if args.json:
        print(json.dumps(versions, indent=2))
    else:
        width = max(len(k) for k in versions)
        for name, ver in versions.items():
            print(f"{name:<{width}}  {ver}")
    return 0
