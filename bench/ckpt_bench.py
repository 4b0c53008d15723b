"""Checkpoint benchmark: stalwart.ckpt against torch.save, DCP async_save and the disk itself.

For each state size (a mix of fp32 and bf16 random tensors, like weights plus optimizer state) it
measures, on one disk, side by side:

* ``dd if=/dev/zero bs=8M conv=fsync`` — what the disk takes with fsync (the limit);
* ``torch.save`` — synchronous; its stall is the whole call, then an fsync makes it durable;
* ``torch.distributed.checkpoint.async_save`` — stall is the call (DCP stages to CPU memory);
  durable when its future resolves (DCP fsyncs by default);
* stalwart ``Checkpointer.save`` with ``snapshot="blocking"`` — stall is the call; durable when
  the manifest is committed;
* stalwart with ``snapshot="overlap"`` — the call returns at once; the copy runs in the background
  and must be done before the next optimizer step.

For the asynchronous ones it also measures, in separate runs, how much longer a simulated training
step (about 1 s of CPU matmuls) takes when it starts right after the call: on a CPU-only machine the
background copy, hashing and writing compete with it for the cores.

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


class _Method:
    """One way to checkpoint: ``start`` returns a handle; ``snapshot_done``/``durable`` wait on it."""

    name = ""

    def start(self, step: int) -> Any: ...

    def snapshot_done(self, handle: Any) -> None:
        return None

    def durable(self, handle: Any) -> float | None:
        """Wait until durable; may return its own measure of seconds since ``start``."""
        return None

    def close(self) -> None: ...


class _Dcp(_Method):
    name = "dcp.async_save"

    def __init__(self, workdir: str, state: dict[str, torch.Tensor]) -> None:
        self.workdir, self.state = workdir, state

    def start(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return dcp.async_save(self.state, checkpoint_id=os.path.join(self.workdir, f"dcp{step}"), no_dist=True)

    def durable(self, handle: Any) -> float | None:
        handle.result()
        for name in os.listdir(self.workdir):
            if name.startswith("dcp"):
                shutil.rmtree(os.path.join(self.workdir, name))
        return None


class _Stalwart(_Method):
    def __init__(self, workdir: str, state: dict[str, torch.Tensor], mode: str) -> None:
        self.name = f"stalwart {mode}"
        self.state = state
        self.root = os.path.join(workdir, f"stalwart-{mode}")
        self.ckpt = Checkpointer(self.root, SaveConfig(snapshot=mode))  # type: ignore[arg-type]

    def start(self, step: int) -> Any:
        return self.ckpt.save(step, self.state)

    def snapshot_done(self, handle: Any) -> None:
        handle.wait_snapshot()

    def durable(self, handle: Any) -> float | None:
        return handle.result().commit_s

    def close(self) -> None:
        self.ckpt.close()
        shutil.rmtree(self.root)


def run_method(method: _Method, nbytes: int, repeats: int, compute_iters: int,
               compute_alone_s: float) -> dict[str, float]:
    """Best of ``repeats`` (after a warm-up) of: the call's stall, the time to durable, and, in
    separate runs, how much longer a simulated training step takes when it starts right after the
    call (background copying and persisting compete with it for the CPUs)."""
    step = 0
    calls, durables, slowdowns = [], [], []
    try:
        for i in range(repeats + 1):
            started = time.perf_counter()
            handle = method.start(step)
            returned = time.perf_counter()
            own = method.durable(handle)
            durable = own if own is not None else time.perf_counter() - started
            step += 1
            if i:
                calls.append(returned - started)
                durables.append(durable)
        for _ in range(repeats):
            started = time.perf_counter()
            handle = method.start(step)
            simulated_compute(compute_iters)
            method.snapshot_done(handle)
            slowdowns.append(max(0.0, time.perf_counter() - started - compute_alone_s))
            method.durable(handle)
            step += 1
    finally:
        method.close()
        gc.collect()
    stall, durable = min(calls), min(durables)
    return {
        "stall_s": stall,
        "durable_s": durable,
        "step_slowdown_s": min(slowdowns),
        "throughput_GBps": nbytes / durable / 1e9,
        "persist_GBps": nbytes / (durable - stall) / 1e9,
    }


def simulated_compute(iterations: int) -> float:
    """A stand-in for forward/backward: matmuls on the CPU; returns how long they took."""
    a = torch.randn(512, 512)
    started = time.perf_counter()
    for _ in range(iterations):
        a = torch.tanh(a @ a / 512)
    return time.perf_counter() - started


def bench_size(workdir: str, nbytes: int, repeats: int) -> dict[str, Any]:
    print(f"\n== {nbytes / MiB:.0f} MiB: building the state", flush=True)
    state = make_state(nbytes)
    per_iter = min(simulated_compute(10) for _ in range(3)) / 10
    compute_iters = max(1, round(1.0 / per_iter))  # a simulated forward/backward of about 1 s
    compute_alone_s = min(simulated_compute(compute_iters) for _ in range(3))
    results: dict[str, Any] = {"bytes": nbytes, "simulated_step_s": compute_alone_s}
    results["dd"] = max((run_dd(workdir, nbytes) for _ in range(repeats)), key=lambda r: r["throughput_GBps"])
    print(f"   dd: {results['dd']}", flush=True)
    ts = min((run_torch_save(workdir, state, nbytes) for _ in range(repeats)), key=lambda r: r["durable_s"])
    ts["step_slowdown_s"] = ts["stall_s"]
    ts["persist_GBps"] = ts["throughput_GBps"]
    results["torch_save"] = ts
    print(f"   torch.save: {ts}", flush=True)
    methods: list[tuple[str, Any]] = [
        ("dcp_async_save", lambda: _Dcp(workdir, state)),
        ("stalwart_blocking", lambda: _Stalwart(workdir, state, "blocking")),
        ("stalwart_overlap", lambda: _Stalwart(workdir, state, "overlap")),
    ]
    for key, make in methods:
        results[key] = run_method(make(), nbytes, repeats, compute_iters, compute_alone_s)
        print(f"   {key}: {results[key]}", flush=True)
    state = {}  # free it (the lambdas above hold the name) before the next size
    gc.collect()
    for key in ("stalwart_blocking", "stalwart_overlap"):
        r = results[key]
        r["stall_vs_torch_save"] = r["stall_s"] / ts["stall_s"]
        r["stall_below_dcp"] = r["stall_s"] < results["dcp_async_save"]["stall_s"]
        r["persist_vs_dd"] = r["persist_GBps"] / results["dd"]["throughput_GBps"]
        r["targets_met"] = r["stall_vs_torch_save"] <= 0.05 and r["stall_below_dcp"] and r["persist_vs_dd"] >= 0.8
    return results


def print_table(all_results: list[dict[str, Any]]) -> None:
    header = (f"{'size':>6} {'method':<18} {'stall s':>8} {'/torch.save':>11} {'step +s':>8} {'durable s':>9} "
              f"{'GB/s':>5} {'persist GB/s':>12} {'/dd':>5}")  # fmt: skip
    print("\n" + header)
    print("-" * len(header))
    for res in all_results:
        size = f"{res['bytes'] / MiB:.0f}M"
        ts_stall = res["torch_save"]["stall_s"]
        dd = res["dd"]["throughput_GBps"]
        print(f"{size:>6} {'dd conv=fsync':<18} {'-':>8} {'-':>11} {'-':>8} {res['dd']['durable_s']:9.3f} "
              f"{dd:5.2f} {dd:12.2f} {1:5.0%}")
        for key, name in (("torch_save", "torch.save"), ("dcp_async_save", "dcp.async_save"),
                          ("stalwart_blocking", "stalwart blocking"), ("stalwart_overlap", "stalwart overlap")):
            r = res[key]
            print(f"{size:>6} {name:<18} {r['stall_s']:8.3f} {r['stall_s'] / ts_stall:11.1%} "
                  f"{r['step_slowdown_s']:8.3f} {r['durable_s']:9.3f} {r['throughput_GBps']:5.2f} "
                  f"{r['persist_GBps']:12.2f} {r['persist_GBps'] / dd:5.0%}")
        print()
    print("stall: time the call blocks training; step +s: how much longer a ~1 s simulated CPU step")
    print("took when started right after the call (background work competes for the CPUs); GB/s: from")
    print("the call to durable; persist GB/s: after the stall. Best of the runs for each.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256M,1G,4G", help="comma-separated state sizes (default 256M,1G,4G)")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs per competitor (best is kept)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="where the JSON goes")
    args = parser.parse_args(argv)
    # DCP warns (from its background thread too) that it saves without a process group: intended.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
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
