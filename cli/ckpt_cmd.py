"""``stalwart ckpt``: list, verify, inspect, export and garbage-collect checkpoints under a root.

Exit codes: 0 all good; 1 a checkpoint is corrupt or unreadable (verify, inspect), or gc could not
remove something (a read-only root); 2 bad usage or a bad ROOT (missing, not a directory, a step
directory instead of the root); 3 no such checkpoint (or none at all). Results go to stdout; an
error is one line on stderr, never a traceback.

``stalwart.ckpt`` (and so torch) is imported only when a ckpt action runs, so that other commands
start fast.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable

EXIT_OK, EXIT_BAD, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
_STEP_DIR = re.compile(r"step-(\d{12})")


def _error(message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)


def _root_problem(root: str) -> str | None:
    """Why ``root`` cannot be a checkpoint root, with a hint when it is a step directory."""
    if not os.path.exists(root):
        return f"{root} does not exist"
    if not os.path.isdir(root):
        return f"{root} is not a directory"
    path = os.path.abspath(root)
    match = _STEP_DIR.fullmatch(os.path.basename(path))
    if match or os.path.exists(os.path.join(path, "manifest.json")):
        step = f" {int(match.group(1))}" if match else ""
        return (f"{root} is a checkpoint's step directory, not the checkpoint root; "
                f"hint: pass its parent, e.g. {os.path.dirname(path)}{step}")
    return None


def _guarded(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Validate ROOT first, and turn any checkpoint or file-system error into one line on stderr."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        problem = _root_problem(args.root)  # before importing torch: a typo fails fast
        if problem:
            _error(problem)
            return EXIT_USAGE
        from stalwart.ckpt import CheckpointError

        try:
            return run(args)
        except (CheckpointError, OSError) as exc:
            _error(f"{type(exc).__name__}: {exc}")
            return EXIT_BAD

    return wrapper


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="list, verify, inspect and garbage-collect checkpoints")
    cmds = p.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    ls = cmds.add_parser("list", help="checkpoints under ROOT, oldest first")
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_guarded(run_list))

    ver = cmds.add_parser("verify", help="read every chunk and check every checksum (exit 1 if any fails)")
    ver.add_argument("root")
    ver.add_argument("step", nargs="?", type=int, help="one step; default: every committed checkpoint")
    ver.add_argument("--no-mark", action="store_true", help="do not record a successful verify")
    ver.add_argument("--progress", choices=["auto", "always", "never"], default="auto",
                     help="progress lines on stderr: auto shows them once a verify takes over a second")
    ver.set_defaults(func=_guarded(run_verify))

    ins = cmds.add_parser("inspect", help="tensors, layouts, sizes and compression ratio of one checkpoint")
    ins.add_argument("root")
    ins.add_argument("step", type=int)
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=_guarded(run_inspect))

    exp = cmds.add_parser("export", help="one checkpoint as a consolidated state dict (safetensors or torch .pt)")
    exp.add_argument("root")
    exp.add_argument("step", type=int)
    exp.add_argument("--to", choices=["safetensors", "pt"], default="safetensors", dest="fmt",
                     help="output format (default safetensors; pt loads with torch.load(weights_only=True))")
    exp.add_argument("--out", default=None, help="output file (default: ./step-STEP.safetensors or .pt)")
    exp.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                     help="cast floating-point weights (default: as saved, fp32 master weights)")
    exp.add_argument("--all", action="store_true",
                     help="every tensor under its checkpoint name (optimizer state too), not only the model's")
    exp.add_argument("--force", action="store_true", help="replace an existing output file")
    exp.set_defaults(func=_guarded(run_export))

    gc = cmds.add_parser("gc", help="remove checkpoints outside the retention policy and unfinished saves")
    gc.add_argument("root")
    gc.add_argument("--keep-last", type=int, default=3, help="newest committed checkpoints to keep (default 3)")
    gc.add_argument("--keep-every", type=int, default=0, help="also keep steps that are multiples of this")
    gc.add_argument("--grace-s", type=float, default=3600.0,
                    help="unfinished saves newer than every commit are kept this long (default 3600)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    gc.set_defaults(func=_guarded(run_gc))


_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
# The trainer's tensor names (stalwart.trainer.zero_state): a model's state dict is its fp32 master
# weights, frozen parameters and buffers, under the module's own names; Adam's moments are left out.
_MODEL_PREFIXES = ("fp32/", "frozen/", "buffer/")


def _model_name(name: str) -> str | None:
    for prefix in _MODEL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run_list(args: argparse.Namespace) -> int:
    from stalwart.ckpt import CheckpointError, inspect, list_checkpoints

    infos = list_checkpoints(args.root)
    rows = []
    for info in infos:
        try:
            summary = inspect(args.root, info.step) if info.committed else None
            state = "committed" if info.committed else "unfinished"
        except CheckpointError as exc:
            summary, state = None, f"unreadable ({type(exc).__name__})"
        rows.append(
            {
                "step": info.step,
                "state": state,
                "verified": bool(summary and info.verified_digest == summary["manifest_digest"]),
                "world_size": summary["world_size"] if summary else None,
                "logical_bytes": summary["logical_bytes"] if summary else None,
                "stored_bytes": summary["file_bytes"] if summary else None,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK if rows else EXIT_NOT_FOUND
    if not rows:
        _error(f"no checkpoints under {args.root}")
        return EXIT_NOT_FOUND
    print(f"{'step':>12}  {'state':<24} {'verified':<8} {'world':>5} {'size':>10} {'on disk':>10}")
    for r in rows:
        logical = _size(r["logical_bytes"]) if r["logical_bytes"] is not None else "-"
        stored = _size(r["stored_bytes"]) if r["stored_bytes"] is not None else "-"
        world = r["world_size"] if r["world_size"] is not None else "-"
        print(f"{r['step']:>12}  {r['state']:<24} {'yes' if r['verified'] else 'no':<8} {world:>5} "
              f"{logical:>10} {stored:>10}")
    return EXIT_OK


class _Progress:
    """Progress lines on stderr, at most every half second (``auto``: once a verify runs over a second)."""

    def __init__(self, step: int, mode: str) -> None:
        self.step, self.mode = step, mode
        self.started = time.monotonic()
        self.last = 0.0 if mode == "always" else self.started

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.mode == "never" or (self.mode == "auto" and now - self.started < 1.0):
            return
        if self.last and now - self.last < 0.5 and done < total:
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        print(f"verify step {self.step}: {pct:5.1f}% ({_size(done)} of {_size(total)})", file=sys.stderr, flush=True)


def run_verify(args: argparse.Namespace) -> int:
    from stalwart.ckpt import CheckpointNotFound, list_checkpoints, verify

    if args.step is not None:
        steps = [args.step]
    else:
        steps = [c.step for c in list_checkpoints(args.root) if c.committed]
        if not steps:
            _error(f"no committed checkpoints under {args.root}")
            return EXIT_NOT_FOUND
    worst = EXIT_OK
    for step in steps:
        try:
            report = verify(args.root, step, progress=_Progress(step, args.progress), mark=not args.no_mark)
        except CheckpointNotFound as exc:
            _error(f"step {step}: not found: {exc}")
            worst = max(worst, EXIT_NOT_FOUND)
            continue
        if report.ok:
            print(f"step {step}: OK ({report.files_checked} files, {_size(report.bytes_checked)})")
            continue
        worst = max(worst, EXIT_BAD)
        print(f"step {step}: {len(report.problems)} problem(s)")
        for problem in report.problems:
            print(f"  {type(problem).__name__}: {problem}")
    return worst


def run_inspect(args: argparse.Namespace) -> int:
    from stalwart.ckpt import CheckpointError, CheckpointNotFound, inspect

    try:
        summary = inspect(args.root, args.step)
    except CheckpointNotFound as exc:
        _error(f"not found: {exc}")
        return EXIT_NOT_FOUND
    except CheckpointError as exc:
        _error(f"{type(exc).__name__}: {exc}")
        return EXIT_BAD
    if args.json:
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    print(f"step {summary['step']}  format {summary['format_version']}  world size {summary['world_size']}  "
          f"manifest {summary['manifest_digest']}")
    print(f"{_size(summary['logical_bytes'])} of tensors in {_size(summary['file_bytes'])} on disk, "
          f"compression ratio {summary['compression_ratio']:.2f}")
    print(f"{'tensor':<40} {'dtype':<9} {'shape':<20} {'size':>10} {'ratio':>6}  parts")
    for t in summary["tensors"]:
        ratio = t["raw_bytes"] / t["stored_bytes"] if t["stored_bytes"] else 1.0
        layouts = ", ".join(
            f"r{p['rank']}:" + ("flat" + str(p["region"]["flat"]) if "flat" in p["region"]
                                else "box@" + str(p["region"]["offsets"]) + "+" + str(p["region"]["lengths"]))
            for p in t["parts"][:4]
        )
        if len(t["parts"]) > 4:
            layouts += f", ... ({len(t['parts'])} parts)"
        print(f"{t['name']:<40} {t['dtype']:<9} {str(t['shape']):<20} {_size(t['raw_bytes']):>10} {ratio:>6.2f}  "
              f"{layouts}")
    return EXIT_OK


def run_gc(args: argparse.Namespace) -> int:
    from stalwart.ckpt import RetentionPolicy, collect_garbage

    try:
        policy = RetentionPolicy(args.keep_last, args.keep_every, args.grace_s)
    except ValueError as exc:
        _error(str(exc))
        return EXIT_USAGE
    report = collect_garbage(args.root, policy, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} committed: {report.removed or 'none'}")
    print(f"{verb} unfinished: {report.garbage_removed or 'none'}")
    if report.busy:
        print(f"in use, kept: {report.busy}")
    if report.damaged:
        print(f"damaged, kept and not counted: {[step for step, _ in report.damaged]}")
    print(f"kept: {report.kept or 'none'}")
    if report.errors:
        steps = ", ".join(str(step) for step, _ in report.errors)
        _error(f"cannot remove step(s) {steps} under {args.root}: {report.errors[0][1]}")
        return EXIT_BAD
    return EXIT_OK


def run_export(args: argparse.Namespace) -> int:
    import importlib.util

    out = args.out or f"step-{args.step}.{args.fmt}"
    if args.fmt == "safetensors" and importlib.util.find_spec("safetensors") is None:
        _error("safetensors is not installed: pip install 'stalwart[export]' (or use --to pt)")
        return EXIT_USAGE
    if os.path.exists(out) and not args.force:
        _error(f"{out} exists; pass --force to replace it")
        return EXIT_USAGE
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        _error(f"the directory of {out} does not exist")
        return EXIT_USAGE
    import torch

    from stalwart.ckpt import CheckpointNotFound, ExportFailed, export, read_manifest

    try:
        manifest = read_manifest(args.root, args.step)
    except CheckpointNotFound as exc:
        _error(f"not found: {exc}")
        return EXIT_NOT_FOUND
    rename = None if args.all else _model_name
    if rename is not None and not any(_model_name(n) for n in manifest.tensors):
        _error(f"step {args.step} has no model tensors ({', '.join(_MODEL_PREFIXES)}); pass --all to export "
               "every tensor under its checkpoint name")
        return EXIT_USAGE
    try:
        report = export(args.root, args.step, out, args.fmt, rename=rename,
                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    except ExportFailed as exc:
        _error(str(exc))
        return EXIT_BAD
    print(f"step {report.step} (saved by {report.world_size} ranks): {report.tensors} tensors, "
          f"{_size(report.bytes)} -> {report.path} ({report.format}), verified on load")
    return EXIT_OK
