"""Checkpoint benchmark: stalwart.ckpt against torch.save, DCP async_save and the disk itself.

For each state size (a mix of fp32 and bf16 random tensors, like weights plus optimizer state) it
measures, on one disk, side by side:

* ``dd if=/dev/zero bs=8M conv=fsync`` — what the disk takes with fsync (the limit);
* ``torch.save`` — synchronous; its stall is the whole call, then an fsync makes it durable;
* ``torch.distributed.checkpoint.async_save`` — stall is the call (DCP stages to CPU memory);
  durable when its future resolves (DCP fsyncs by default);
* stalwart ``Checkpointer.save`` with ``snapshot="blocking"`` — stall is the call; durable when
  the manifest is committed;
* stalwart with ``snapshot="overlap"`` — the call returns at once and the copy overlaps a simulated
  forward/backward (CPU matmuls); its stall is how much longer that step took than alone.

Each competitor runs ``--repeats`` times after one warm-up (reusable buffers are warm, as in a
training job that checkpoints periodically); the best run is reported. Prints a table and writes
JSON to ``bench/results/``. This is a benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from stalwart.ckpt import Checkpointer, SaveConfig

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    """Half fp32, half bf16 by bytes, in tensors of at most 64 MiB."""
    state: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for dtype, share in ((torch.float32, nbytes // 2), (torch.bfloat16, nbytes - nbytes // 2)):
        itemsize = torch.empty((), dtype=dtype).element_size()
        left = share
        while left > 0:
            n = min(left, 64 * MiB) // itemsize
            name = f"{str(dtype).split('.')[-1]}_{len(state):04d}"
            state[name] = torch.randn(n, generator=gen).to(dtype)
            left -= n * itemsize
    return state


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def run_dd(workdir: str, nbytes: int) -> dict[str, float]:
    target = os.path.join(workdir, "dd.bin")
    count = max(1, nbytes // (8 * MiB))
    started = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=8M", f"count={count}", "conv=fsync"],
        check=True, capture_output=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    os.unlink(target)
    return {"durable_s": seconds, "throughput_GBps": count * 8 * MiB / seconds / 1e9}


def run_torch_save(workdir: str, state: dict[str, torch.Tensor], nbytes: int) -> dict[str, float]:
    target = os.path.join(workdir, "state.pt")
    started = time.perf_counter()
    torch.save(state, target)
    saved = time.perf_counter()
    fsync_path(target)
    fsync_path(workdir)
    durable = time.perf_counter()
    os.unlink(target)
    return {
        "stall_s": saved - started,
        "durable_s": durable - started,
        "throughput_GBps": nbytes / (durable - started) / 1e9,
    }


def run_dcp(workdir: str, state: dict[str, torch.Tensor], nbytes: int, repeats: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    best: dict[str, float] | None = None
    for i in range(repeats + 1):
        target = os.path.join(workdir, f"dcp{i}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=target, no_dist=True)
            returned = time.perf_counter()
            future.result()
            durable = time.perf_counter()
        shutil.rmtree(target)
        del future
        gc.collect()
        run = {"stall_s": returned - started, "durable_s": durable - started,
               "throughput_GBps": nbytes / (durable - started) / 1e9}  # fmt: skip
        if i > 0 and (best is None or run["durable_s"] < best["durable_s"]):
            best = run
    assert best is not None
    return best


def simulated_compute(iterations: int) -> float:
    """A stand-in for forward/backward: matmuls on the CPU; returns how long they took."""
    a = torch.randn(512, 512)
    started = time.perf_counter()
    for _ in range(iterations):
        a = torch.tanh(a @ a / 512)
    return time.perf_counter() - started


def run_stalwart(workdir: str, state: dict[str, torch.Tensor], nbytes: int, repeats: int, mode: str,
                 compute_iters: int, compute_alone_s: float) -> dict[str, float]:  # fmt: skip
    root = os.path.join(workdir, f"stalwart-{mode}")
    config = SaveConfig(snapshot=mode)  # type: ignore[arg-type]
    best: dict[str, float] | None = None
    with Checkpointer(root, config) as ckpt:
        for step in range(repeats + 1):
            started = time.perf_counter()
            handle = ckpt.save(step, state)
            returned = time.perf_counter()
            run: dict[str, float] = {"call_s": returned - started}
            if mode == "overlap":
                compute_s = simulated_compute(compute_iters)
                handle.wait_snapshot()
                snapshot_done = time.perf_counter()
                run["stall_s"] = max(0.0, (snapshot_done - started) - compute_alone_s)
                run["compute_slowdown_s"] = compute_s - compute_alone_s
            else:
                run["stall_s"] = run["call_s"]
            info = handle.result()
            run["durable_s"] = info.commit_s
            run["throughput_GBps"] = nbytes / info.commit_s / 1e9
            if step > 0 and (best is None or run["durable_s"] < best["durable_s"]):
                best = {**run, "durable_s": run["durable_s"], "stall_s": run["stall_s"]}
            if step > 0 and best is not None:
                best["stall_s"] = min(best["stall_s"], run["stall_s"])
    shutil.rmtree(root)
    gc.collect()
    assert best is not None
    return best


def bench_size(workdir: str, nbytes: int, repeats: int) -> dict[str, Any]:
    print(f"\n== {nbytes / MiB:.0f} MiB: building the state", flush=True)
    state = make_state(nbytes)
    per_iter = min(simulated_compute(10) for _ in range(3)) / 10
    compute_iters = max(1, round(1.0 / per_iter))  # a simulated forward/backward of about 1 s
    compute_alone_s = min(simulated_compute(compute_iters) for _ in range(3))
    results: dict[str, Any] = {"bytes": nbytes, "simulated_step_s": compute_alone_s}
    results["dd"] = max((run_dd(workdir, nbytes) for _ in range(repeats)), key=lambda r: r["throughput_GBps"])
    print(f"   dd: {results['dd']}", flush=True)
    results["torch_save"] = min(
        (run_torch_save(workdir, state, nbytes) for _ in range(repeats)), key=lambda r: r["durable_s"]
    )
    print(f"   torch.save: {results['torch_save']}", flush=True)
    results["dcp_async_save"] = run_dcp(workdir, state, nbytes, repeats)
    print(f"   dcp.async_save: {results['dcp_async_save']}", flush=True)
    for mode in ("blocking", "overlap"):
        results[f"stalwart_{mode}"] = run_stalwart(
            workdir, state, nbytes, repeats, mode, compute_iters, compute_alone_s
        )
        print(f"   stalwart {mode}: {results[f'stalwart_{mode}']}", flush=True)
    del state
    gc.collect()
    ts = results["torch_save"]["stall_s"]
    for mode in ("blocking", "overlap"):
        r = results[f"stalwart_{mode}"]
        r["stall_vs_torch_save"] = r["stall_s"] / ts
        r["stall_below_dcp"] = r["stall_s"] < results["dcp_async_save"]["stall_s"]
        r["throughput_vs_dd"] = r["throughput_GBps"] / results["dd"]["throughput_GBps"]
        r["targets_met"] = r["stall_vs_torch_save"] <= 0.05 and r["stall_below_dcp"] and r["throughput_vs_dd"] >= 0.8
    return results


def print_table(all_results: list[dict[str, Any]]) -> None:
    header = f"{'size':>6} {'method':<20} {'stall s':>8} {'durable s':>9} {'GB/s':>6} {'stall/ts':>8} {'vs dd':>6}"
    print("\n" + header)
    print("-" * len(header))
    for res in all_results:
        size = f"{res['bytes'] / MiB:.0f}M"
        ts_stall = res["torch_save"]["stall_s"]
        dd = res["dd"]["throughput_GBps"]
        rows = [
            ("dd conv=fsync", None, res["dd"]),
            ("torch.save", res["torch_save"]["stall_s"], res["torch_save"]),
            ("dcp.async_save", res["dcp_async_save"]["stall_s"], res["dcp_async_save"]),
            ("stalwart blocking", res["stalwart_blocking"]["stall_s"], res["stalwart_blocking"]),
            ("stalwart overlap", res["stalwart_overlap"]["stall_s"], res["stalwart_overlap"]),
        ]
        for name, stall, r in rows:
            stall_text = f"{stall:8.3f}" if stall is not None else f"{'-':>8}"
            ratio = f"{stall / ts_stall:8.1%}" if stall is not None else f"{'-':>8}"
            print(f"{size:>6} {name:<20} {stall_text} {r['durable_s']:9.3f} {r['throughput_GBps']:6.2f} "
                  f"{ratio} {r['throughput_GBps'] / dd:6.0%}")
        print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256M,1G,4G", help="comma-separated state sizes (default 256M,1G,4G)")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs per competitor (best is kept)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="where the JSON goes")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or args.out)
    all_results = []
    try:
        for nbytes in sizes:
            all_results.append(bench_size(workdir, nbytes, args.repeats))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(all_results)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "cuda": torch.cuda.is_available()},
        "results": all_results,
    }  # fmt: skip
    path = os.path.join(args.out, f"ckpt_bench_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
