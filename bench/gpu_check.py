"""GPU check: the parts of stalwart that exist only on a GPU, run once on a GPU machine.

One short run (well inside 10 minutes) of five parts; each prints a table, and all of them go into
one JSON file (``--out``):

1. ``nvml`` — the agent's real NVML health probe (``make_probe("nvml", ...)``): time to initialise
   and to poll, the verdict and findings the agent would report, and the NVML fields beside them
   (PCIe link and replay counter, throttle reasons, ECC mode, temperature, power, memory).
2. ``snapshot`` — the checkpoint snapshot stall for GPU-resident state (half fp32, half bf16, like
   weights plus optimizer state) with ``stalwart.ckpt.Checkpointer`` (pinned host buffers, a copy
   stream) in ``blocking`` and ``overlap`` mode, beside ``torch.save`` and DCP ``async_save`` of
   the same state (the competitors of ``bench/ckpt_bench.py``). Then the *step slowdown*: a
   synthetic device step (a matmul loop, about 1 s on a GPU, 0.2 s on the CPU) alone and right
   after an overlap-mode save, split into what the copy alone costs (a device-to-host copy on a
   side stream into a reused pinned buffer, no checkpointer) and what the persist thread costs
   (the save's copy finished before the step starts: hashing, writing and the GIL).
3. ``replica`` — the upper bound of a peer-memory replica copy for the same sizes: device to
   pinned host, then host to another GPU (or, with one, to a second host buffer), against the
   PCIe link (from NVML) and the host memory copy rate.
4. ``trainer`` — a one-device DeepSpeed (ZeRO-1) step loop through ``stalwart.trainer.Trainer``
   with checkpoints; then the world is left and a new Trainer (a model built with another seed, a
   new engine, process group and checkpointer) restores from disk, and every saved tensor
   (fp32 weights, Adam moments) is compared bitwise.
5. ``abort`` — with two GPUs or more: an NCCL all-reduce whose peer is SIGKILLed, aborted with the
   trainer's abort (``ncclCommAbort``), and the time the survivor takes to get out. Without CUDA
   the same harness runs over gloo (a dead peer's connection closes), so the harness is tested.

A part that cannot run here says why in its place ("no CUDA device", "one GPU: NCCL abort needs
two"). Every part has a time budget; one that runs over it fails with a message saying so and the
others still run. This is a check, not a test: it asserts nothing, but it exits 1 when a part
failed (``trainer``: the restored state differs).

    python bench/gpu_check.py                      # on a GPU machine: 1, 4 and 16 GB
    python bench/gpu_check.py --device cpu         # the CPU path, with small sizes
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
GB = 10**9
MiB = 1 << 20
PARTS = ("nvml", "snapshot", "replica", "trainer", "abort")
# Seconds per part; on a GPU they add up to 9 minutes, so a run ends inside 10 whatever happens.
DEFAULT_BUDGETS = {"nvml": 20.0, "snapshot": 300.0, "replica": 60.0, "trainer": 120.0, "abort": 40.0}
CPU_BUDGETS = {"nvml": 10.0, "snapshot": 60.0, "replica": 20.0, "trainer": 120.0, "abort": 40.0}

# PCIe per-lane rates in GT/s and line-code efficiency, per generation (gen 6 counted as 1.0
# payload per transfer, its FLIT overhead aside).
_PCIE = {1: (2.5, 8 / 10), 2: (5.0, 8 / 10), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130), 5: (32.0, 128 / 130),
         6: (64.0, 1.0)}


# --- pure helpers (unit-tested) ---------------------------------------------------------------

def parse_sizes_gb(text: str) -> list[float]:
    """``"1,4,16"`` -> ``[1.0, 4.0, 16.0]`` (decimal GB of state). Refuses empty or non-positive."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("GB").removesuffix("G")
        if not part:
            continue
        value = float(part)
        if not value > 0:
            raise ValueError(f"sizes must be positive GB, got {part!r}")
        sizes.append(value)
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sizes


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB per second; 0 for a non-positive time."""
    return nbytes / seconds / GB if seconds > 0 else 0.0


def slowdown_pct(alone_s: float, after_s: float) -> float:
    """How much longer ``after_s`` is than ``alone_s``, in percent (may be negative: noise)."""
    return (after_s - alone_s) / alone_s * 100.0 if alone_s > 0 else 0.0


def pcie_limit_gbps(gen: int | None, width: int | None) -> float | None:
    """The payload rate of a PCIe link in GB/s per direction (gen 5 x16: 63.0), None if unknown."""
    if not gen or not width or gen not in _PCIE:
        return None
    rate, efficiency = _PCIE[gen]
    return rate * efficiency * width / 8


def throttle_reasons(mask: int, names: dict[int, str]) -> list[str]:
    """The names of the bits set in an NVML clocks-event mask (unknown bits as hex)."""
    found = [name for bit, name in sorted(names.items()) if mask & bit]
    rest = mask & ~sum(names)
    if rest:
        found.append(f"0x{rest:x}")
    return found


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table: floats with 4 significant digits, number columns right-aligned."""

    def cell(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return "-" if v is None else str(v)
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    raw = [list(row) for row in rows]
    body = [[cell(v) for v in row] for row in raw]
    numeric = [all(isinstance(r[i], int | float) and not isinstance(r[i], bool) or r[i] is None for r in raw)
               and any(r[i] is not None for r in raw) for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if numeric[i] else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(list(headers)), line(["-" * w for w in widths]), *(line(r) for r in body)])


class PartTimeout(RuntimeError):
    """A part ran past its budget."""


class Budget:
    """A part's deadline; ``check()`` between measurements fails fast once it has passed."""

    def __init__(self, part: str, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.part, self.seconds, self._clock = part, seconds, clock
        self.started = clock()

    def left(self) -> float:
        return self.seconds - (self._clock() - self.started)

    def check(self, what: str = "") -> None:
        if self.left() < 0:
            raise PartTimeout(f"part {self.part!r} exceeded its budget of {self.seconds:.0f} s"
                              + (f" (at {what})" if what else ""))


def run_part(name: str, fn: Callable[[Budget], dict[str, Any]], budget: Budget) -> dict[str, Any]:
    """``{"results": ...}``, ``{"skipped": why}`` (a part returns that itself) or ``{"error": ...}``;
    always with ``seconds``."""
    started = time.monotonic()
    try:
        out = fn(budget)
    except Exception as exc:  # one part failing must not hide the others
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = time.monotonic() - started
    return out


# --- context ----------------------------------------------------------------------------------

class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.sizes = [int(s * GB) for s in args.sizes]
        self.workdir = tempfile.mkdtemp(prefix="gpu-check-", dir=args.dir)
        self.pcie_gbps: float | None = None  # filled by the nvml part

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _ckpt_bench() -> Any:
    """bench/ckpt_bench.py as a module (bench/ is not a package): its competitors are reused."""
    module = sys.modules.get("ckpt_bench")
    if module is None:
        spec = importlib.util.spec_from_file_location("ckpt_bench", os.path.join(HERE, "ckpt_bench.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["ckpt_bench"] = module
        spec.loader.exec_module(module)
    return module


def _free_host_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            with contextlib.suppress(Exception):
                empty()  # pinned blocks of the previous size: the next size's buffers are bigger


# --- part 1: NVML ------------------------------------------------------------------------------

def nvml_fields(nvml: Any, handle: Any) -> dict[str, Any]:
    """What NVML says about one GPU beside the probe's findings; a field it does not support is
    ``"unsupported"`` (or the error's text)."""

    def read(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except nvml.NVMLError as exc:
            return "unsupported" if isinstance(exc, getattr(nvml, "NVMLError_NotSupported", ())) else str(exc)

    def text(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v

    fields: dict[str, Any] = {
        "name": read(lambda: text(nvml.nvmlDeviceGetName(handle))),
        "pcie_gen": read(lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
        "pcie_width": read(lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
        "pcie_gen_max": read(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        "pcie_width_max": read(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
        "pcie_replay_counter": read(lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle)),
        "ecc_mode": read(lambda: list(nvml.nvmlDeviceGetEccMode(handle))),
        "ecc_dbe_volatile": read(lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)),
        "remapped_rows": read(lambda: list(nvml.nvmlDeviceGetRemappedRows(handle))),
        "temperature_c": read(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        "power_w": read(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000),
        "memory_total_gb": read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).total / GB),
    }
    names = {getattr(nvml, k): k.removeprefix("nvmlClocksThrottleReason").removeprefix("nvmlClocksEventReason")
             for k in dir(nvml)
             if k.startswith(("nvmlClocksThrottleReason", "nvmlClocksEventReason"))
             and isinstance(getattr(nvml, k), int) and getattr(nvml, k) & (getattr(nvml, k) - 1) == 0
             and getattr(nvml, k) > 0}  # fmt: skip
    get_reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    mask = read(lambda: int(get_reasons(handle))) if get_reasons is not None else "unsupported"
    fields["throttle_reasons"] = throttle_reasons(mask, names) if isinstance(mask, int) else mask
    return fields


def part_nvml(ctx: Ctx, budget: Budget) -> dict[str, Any]:
    from stalwart.agent.health import ProbeUnavailable, make_probe, verdict

    started = time.perf_counter()
    try:
        probe = make_probe("nvml", ctx.gpus)
    except ProbeUnavailable as exc:
        fallback = make_probe("auto", ctx.gpus)
        try:
            why = f"no NVML ({exc})" if ctx.cuda else f"no CUDA device; no NVML ({exc})"
            return {"skipped": why, "fallback": {"probe": fallback.name, "verdict": verdict(fallback.poll()).name,
                                                 "findings": [f.__dict__ for f in fallback.poll()]}}
        finally:
            fallback.close()
    init_s = time.perf_counter() - started
    try:
        polls = []
        for _ in range(20):
            t0 = time.perf_counter()
            findings = probe.poll()
            polls.append(time.perf_counter() - t0)
        budget.check("polling")
        nvml = probe._nvml  # type: ignore[attr-defined]  # the probe's own module and handles
        devices = [nvml_fields(nvml, h) for h in probe._handles]  # type: ignore[attr-defined]
    finally:
        probe.close()
    if devices and isinstance(devices[0]["pcie_gen"], int) and isinstance(devices[0]["pcie_width"], int):
        ctx.pcie_gbps = pcie_limit_gbps(devices[0]["pcie_gen"], devices[0]["pcie_width"])
    found = [{"device": f.device, "severity": f.severity.name, "code": f.code, "detail": f.detail} for f in findings]
    return {"results": {
        "probe": probe.name, "devices": len(devices), "init_s": init_s,
        "poll_us_median": statistics.median(polls) * 1e6, "poll_us_max": max(polls) * 1e6,
        "verdict": verdict(findings).name, "findings": found, "fields": devices, "pcie_limit_GBps": ctx.pcie_gbps,
    }}  # fmt: skip


def print_nvml(out: dict[str, Any]) -> None:
    r = out["results"]
    print(f"probe {r['probe']}: {r['devices']} GPU(s), init {r['init_s'] * 1e3:.1f} ms, poll "
          f"{r['poll_us_median']:.0f} µs (max {r['poll_us_max']:.0f}); verdict {r['verdict']}, "
          f"findings {r['findings'] or 'none'}")
    keys = [k for k in r["fields"][0] if k != "name"] if r["fields"] else []
    print(format_table(["field", *(f"GPU {i}" for i in range(len(r["fields"])))],
                       [[k, *(str(d[k]) for d in r["fields"])] for k in keys]))


# --- the synthetic step ------------------------------------------------------------------------

class DeviceStep:
    """A stand-in for forward/backward + optimizer step: a matmul loop on the device, calibrated to
    ``target_s``. ``run(before_update)`` calls ``before_update`` (where a training loop calls
    ``handle.wait_snapshot()``) before the last tenth, the "optimizer step"."""

    def __init__(self, device: torch.device, target_s: float) -> None:
        self.device = device
        n = 8192 if device.type == "cuda" else 256
        self.a = torch.randn(n, n, device=device) / n**0.5
        self.iters = 4
        once = min(self.run()["wall_s"] for _ in range(3)) / self.iters
        self.iters = max(10, round(target_s / once))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # this stream only: not a copy stream's work

    def run(self, before_update: Callable[[], None] | None = None) -> dict[str, float]:
        """``wall_s`` from start to the last kernel done on the step's stream; ``launch_s``: when
        the Python loop had issued every kernel (on a GPU, a GIL held elsewhere shows here)."""
        a = self.a
        cut = self.iters - max(1, self.iters // 10)
        started = time.perf_counter()
        for i in range(self.iters):
            if i == cut and before_update is not None:
                before_update()
            a = torch.tanh(a @ a)
        launched = time.perf_counter()
        self._sync()
        done = time.perf_counter()
        return {"wall_s": done - started, "launch_s": launched - started}


def _step_alone(step: DeviceStep, repeats: int) -> dict[str, float]:
    runs = [step.run() for _ in range(repeats)]
    return min(runs, key=lambda r: r["wall_s"])


# --- part 2: snapshot stall ---------------------------------------------------------------------

def make_device_state(nbytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    """ckpt_bench's layout (half fp32, half bf16 by bytes, tensors of at most 64 MiB), made on
    ``device`` directly (16 GB of random numbers on the host would take minutes)."""
    state: dict[str, torch.Tensor] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype, share in ((torch.float32, nbytes // 2), (torch.bfloat16, nbytes - nbytes // 2)):
        itemsize = torch.empty((), dtype=dtype).element_size()
        left = share
        while left >= itemsize:
            n = min(left, 64 * MiB) // itemsize
            state[f"{str(dtype).split('.')[-1]}_{len(state):04d}"] = torch.randn(
                n, generator=gen, device=device).to(dtype)
            left -= n * itemsize
    return state


class _Saver:
    """ckpt_bench's stalwart competitor, keeping one checkpoint (16 GB states on a small disk)."""

    def __init__(self, workdir: str, state: dict[str, torch.Tensor], mode: str) -> None:
        from stalwart.ckpt import Checkpointer, RetentionPolicy, SaveConfig

        self.name = f"stalwart {mode}"
        self.state = state
        self.root = os.path.join(workdir, f"stalwart-{mode}")
        config = SaveConfig(snapshot=mode, retention=RetentionPolicy(keep_last=1))  # type: ignore[arg-type]
        self.ckpt = Checkpointer(self.root, config)

    def start(self, step: int) -> Any:
        return self.ckpt.save(step, self.state)

    def snapshot_done(self, handle: Any) -> None:
        handle.wait_snapshot()

    def durable(self, handle: Any) -> float | None:
        return float(handle.result().commit_s)

    def close(self) -> None:
        self.ckpt.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _measure_async(method: Any, repeats: int, budget: Budget) -> dict[str, float]:
    """Best of ``repeats`` after a warm-up: the call's stall, when the snapshot is done, durable."""
    stalls, snaps, durables = [], [], []
    for i in range(repeats + 1):
        budget.check(method.name)
        started = time.perf_counter()
        handle = method.start(i)
        returned = time.perf_counter()
        method.snapshot_done(handle)
        snapped = time.perf_counter()
        own = method.durable(handle)
        durable = own if own is not None else time.perf_counter() - started
        if i:
            stalls.append(returned - started)
            snaps.append(snapped - started)
            durables.append(durable)
    return {"stall_s": min(stalls), "snapshot_s": min(snaps), "durable_s": min(durables)}


def _slowdown(ctx: Ctx, state: dict[str, torch.Tensor], nbytes: int, step: DeviceStep, alone: dict[str, float],
              budget: Budget) -> dict[str, Any]:
    """The step right after an overlap-mode save, and the two halves of it taken apart."""
    repeats = ctx.args.repeats
    method = _Saver(ctx.workdir, state, "overlap")
    alones = [alone]  # interleaved with the others: a machine whose load changes affects all alike
    try:
        full, persist_only = [], []
        for i in range(repeats + 1):  # the first save warms the host buffer up
            budget.check("step after save")
            alones.append(step.run())
            handle = method.start(100 + 2 * i)
            run = step.run(before_update=handle.wait_snapshot)
            handle.result()
            if i:
                full.append(run)
            budget.check("step after copy")
            handle = method.start(101 + 2 * i)
            handle.wait_snapshot()
            run = step.run(before_update=handle.wait_snapshot)  # the persist thread alone competes
            handle.result()
            if i:
                persist_only.append(run)
    finally:
        method.close()
        _free_host_cache()
    out: dict[str, Any] = {}
    best = min(full, key=lambda r: r["wall_s"])
    out["after_save_s"], out["launch_after_save_s"] = best["wall_s"], best["launch_s"]
    best = min(persist_only, key=lambda r: r["wall_s"])
    out["persist_only_s"], out["launch_persist_only_s"] = best["wall_s"], best["launch_s"]
    if ctx.cuda:  # the copy alone: a side stream, a reused pinned buffer, no checkpointer thread
        tensors = list(state.values())
        pinned = torch.empty(sum(t.nbytes for t in tensors), dtype=torch.uint8, pin_memory=True)
        views, off = [], 0
        for t in tensors:
            views.append(pinned[off:off + t.nbytes].view(t.dtype))
            off += t.nbytes
        stream = torch.cuda.Stream()
        runs = []
        for i in range(repeats + 1):
            budget.check("step beside a copy")
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for t, v in zip(tensors, views, strict=True):
                    v.copy_(t, non_blocking=True)
                copied = stream.record_event()
            run = step.run(before_update=copied.synchronize)
            copied.synchronize()
            if i:
                runs.append(run)
            alones.append(step.run())
        best = min(runs, key=lambda r: r["wall_s"])
        out["copy_only_s"], out["launch_copy_only_s"] = best["wall_s"], best["launch_s"]
    alone = min(alones, key=lambda r: r["wall_s"])
    out["step_alone_s"], out["launch_alone_s"] = alone["wall_s"], alone["launch_s"]
    for key in ("after_save_s", "persist_only_s", "copy_only_s"):
        if key in out:
            out[key.removesuffix("_s") + "_pct"] = slowdown_pct(alone["wall_s"], out[key])
    out["cause"] = slowdown_cause(out, cuda=ctx.cuda)
    return out


def slowdown_cause(r: dict[str, Any], cuda: bool, threshold_pct: float = 2.0) -> str:
    """Which half of an overlap save slows the step (from ``_slowdown``'s figures)."""
    total = r.get("after_save_pct", 0.0)
    if total < threshold_pct:
        return f"none: the step after a save is within {threshold_pct:g} % of the step alone"
    if not cuda:
        return ("CPU: the save's background copy, hashing and writing compete with the step for the cores "
                f"(persist alone +{r.get('persist_only_pct', 0.0):.0f} %); a GPU step would not need them")
    parts = []
    if r.get("copy_only_pct", 0.0) >= threshold_pct:
        parts.append("the device-to-host copy itself (copy engine / memory bandwidth)")
    if r.get("persist_only_pct", 0.0) >= threshold_pct:
        launch_grew = r.get("launch_persist_only_s", 0.0) > 1.5 * r.get("launch_alone_s", 0.0) + 0.01
        parts.append("the persist thread" + (" holding the GIL (the step's kernel launches were late)"
                                             if launch_grew else " (host CPU or memory bandwidth)"))
    if not parts:
        parts.append("the step waiting on the save's copy (wait_snapshot/stream ordering), not the copy "
                     "or the persist thread alone")
    return "; ".join(parts)


def _spin(seconds: float) -> int:
    """Iterations of a pure-Python loop in ``seconds``: it runs only while it holds the GIL."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def gil_share(work: Callable[[], None], seconds: float = 0.3) -> float:
    """The main thread's pure-Python rate while another thread repeats ``work``, relative to
    alone: near 1 where ``work`` releases the GIL (and a core is free), far below where it holds it."""
    alone = _spin(seconds)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    time.sleep(0.02)
    beside = _spin(seconds)
    stop.set()
    worker.join()
    return beside / alone if alone else 0.0


def persist_gil(chunk_bytes: int = 8 << 20) -> dict[str, float]:
    """How much of the GIL the persist thread's per-chunk work leaves the training thread: the
    checkpoint's own chunk encoder (xxh3, the auto compression sample) on random and on zero
    chunks (the latter are compressed), and a pure-Python loop as the held-GIL reference."""
    from stalwart.ckpt import codec

    policy = codec.CodecPolicy()
    rand = memoryview(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8).numpy())
    zeros = memoryview(bytes(chunk_bytes))
    return {"encode_random": gil_share(lambda: codec.encode(rand, policy)),
            "encode_zeros": gil_share(lambda: codec.encode(zeros, policy)),
            "python_loop": gil_share(lambda: _spin(0.005) and None)}


def part_snapshot(ctx: Ctx, budget: Budget) -> dict[str, Any]:
    cb = _ckpt_bench()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    step = DeviceStep(ctx.device, 1.0 if ctx.cuda else 0.2)
    rows = []
    for nbytes in ctx.sizes:
        budget.check(f"{nbytes / GB:g} GB")
        state = make_device_state(nbytes, ctx.device)
        ctx.sync()
        actual = sum(t.nbytes for t in state.values())
        alone = _step_alone(step, 3)
        res: dict[str, Any] = {"bytes": actual, "step_alone_s": alone["wall_s"]}
        ts = cb.run_torch_save(ctx.workdir, state, actual)
        res["torch_save"] = {**ts, "snapshot_s": ts["stall_s"]}
        for key in ("dcp_async_save", "stalwart_blocking", "stalwart_overlap"):
            method = (cb._Dcp(ctx.workdir, state) if key == "dcp_async_save"
                      else _Saver(ctx.workdir, state, key.removeprefix("stalwart_")))
            try:
                res[key] = _measure_async(method, ctx.args.repeats, budget)
            finally:
                method.close()
            _free_host_cache()
        res["step_slowdown"] = _slowdown(ctx, state, actual, step, alone, budget)
        alone = {"wall_s": res["step_slowdown"]["step_alone_s"]}
        res["step_alone_s"] = alone["wall_s"]
        for key in ("torch_save", "dcp_async_save", "stalwart_blocking", "stalwart_overlap"):
            r = res[key]
            r["stall_pct_of_step"] = r["stall_s"] / alone["wall_s"] * 100
            r["durable_GBps"] = gbps(actual, r["durable_s"])
        rows.append(res)
        state = {}
        _free_host_cache()
    return {"results": {"device": str(ctx.device), "step_iters": step.iters, "sizes": rows,
                        "gil_left_to_training": persist_gil()}}


def print_snapshot(out: dict[str, Any]) -> None:
    rows = []
    for s in out["results"]["sizes"]:
        for key in ("torch_save", "dcp_async_save", "stalwart_blocking", "stalwart_overlap"):
            r = s[key]
            rows.append([f"{s['bytes'] / GB:.3g}", key, r["stall_s"] * 1e3, r["stall_pct_of_step"],
                         r["snapshot_s"] * 1e3, r["durable_s"], r["durable_GBps"]])
    print(format_table(["GB", "method", "stall ms", "% of step", "snapshot ms", "durable s", "GB/s"], rows))
    rows = []
    for s in out["results"]["sizes"]:
        d = s["step_slowdown"]
        rows.append([f"{s['bytes'] / GB:.3g}", d["step_alone_s"], d["after_save_s"], d["after_save_pct"],
                     d.get("copy_only_pct"), d["persist_only_pct"], d["launch_alone_s"],
                     d["launch_persist_only_s"]])
    print()
    print(format_table(["GB", "step s", "after save s", "+%", "copy only +%", "persist only +%", "launch s",
                        "launch beside persist s"], rows))
    for s in out["results"]["sizes"]:
        print(f"  {s['bytes'] / GB:.3g} GB: {s['step_slowdown']['cause']}")
    gil = out["results"]["gil_left_to_training"]
    print("  Python speed of the training thread beside the persist thread's chunk work (1 = GIL released): "
          + ", ".join(f"{k} {v:.2f}" for k, v in gil.items()))


# --- part 3: replica copy -----------------------------------------------------------------------

def _best(fn: Callable[[], None], sync: Callable[[], None], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def copy() -> None:
        dst.copy_(src, non_blocking=True)

    return copy


def part_replica(ctx: Ctx, budget: Budget) -> dict[str, Any]:
    rows = []
    for nbytes in ctx.sizes:
        budget.check(f"{nbytes / GB:g} GB")
        row: dict[str, Any] = {"bytes": nbytes}
        host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
        host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
        host_a.fill_(1)
        host_b.fill_(0)  # touched: page faults are not counted
        row["host_copy_s"] = _best(_copier(host_b, host_a), ctx.sync)
        if ctx.cuda:
            src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).fill_(3)
            row["d2h_s"] = _best(_copier(host_a, src), ctx.sync)
            if ctx.gpus > 1:
                dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
                row["h2d_peer_s"] = _best(_copier(dst, host_a), ctx.sync)
                row["d2d_peer_s"] = _best(_copier(dst, src), ctx.sync)
                row["second_hop"] = "host -> cuda:1"
                dst = None
            else:
                row["second_hop"] = "host -> host (one GPU)"
            src = None
        else:
            row["second_hop"] = "host -> host (no CUDA device)"
        first = row.get("d2h_s", 0.0)
        second = row.get("h2d_peer_s", row["host_copy_s"])
        row["d2h_GBps"] = gbps(nbytes, first) if first else None
        row["second_hop_GBps"] = gbps(nbytes, second)
        row["host_copy_GBps"] = gbps(nbytes, row["host_copy_s"])
        row["d2d_peer_GBps"] = gbps(nbytes, row["d2d_peer_s"]) if "d2d_peer_s" in row else None
        row["replica_sequential_GBps"] = gbps(nbytes, first + second)  # copy, then send
        row["replica_pipelined_GBps"] = min(v for v in (row["d2h_GBps"], row["second_hop_GBps"]) if v)
        row["pcie_limit_GBps"] = ctx.pcie_gbps
        row["d2h_vs_pcie"] = row["d2h_GBps"] / ctx.pcie_gbps if row["d2h_GBps"] and ctx.pcie_gbps else None
        rows.append(row)
        host_a = host_b = None
        _free_host_cache()
        budget.check(f"{nbytes / GB:g} GB done")
    return {"results": {"note": "upper bound for a peer replica: plain torch copies of the same bytes "
                                "(the replica itself is not built yet)", "sizes": rows}}


def print_replica(out: dict[str, Any]) -> None:
    rows = [[f"{r['bytes'] / GB:.3g}", r["d2h_GBps"], r["second_hop"], r["second_hop_GBps"], r["d2d_peer_GBps"],
             r["replica_sequential_GBps"], r["replica_pipelined_GBps"], r["host_copy_GBps"], r["pcie_limit_GBps"]]
            for r in out["results"]["sizes"]]
    print(format_table(["GB", "d2h GB/s", "second hop", "GB/s", "d2d peer", "replica seq", "replica pipe",
                        "host memcpy", "PCIe limit"], rows))
    print("  " + out["results"]["note"])


# --- part 4: trainer save and restore ------------------------------------------------------------

TRAIN_STEPS, SAVE_EVERY = 6, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(ctx_cuda: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".venv", "torch_extensions"))
    if not ctx_cuda:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def state_digests(state: dict[str, Any]) -> dict[str, str]:
    """xxh3-128 of each tensor's bytes (a ``Shard``'s local tensor), for a bitwise comparison."""
    import xxhash

    out = {}
    for name, value in state.items():
        t = getattr(value, "tensor", value).detach().reshape(-1).contiguous().cpu()
        out[name] = xxhash.xxh3_128_hexdigest(t.view(torch.uint8).numpy().tobytes()) + f":{t.dtype}:{t.numel()}"
    return out


def compare_digests(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """Names whose tensors differ, are missing, or are extra; empty when bitwise equal."""
    return sorted(n for n in set(saved) | set(restored) if saved.get(n) != restored.get(n))


def _train_phase(phase: str, root: str, seed: int) -> dict[str, Any]:
    """One Trainer: ``save`` trains and checkpoints; ``restore`` builds a fresh model (another
    seed, so nothing matches by chance) and engine and only restores."""
    import torch.nn.functional as F
    from torch import nn

    from stalwart.trainer import HealthConfig, Trainer, TrainerConfig

    cuda = torch.cuda.is_available()
    torch.manual_seed(seed)
    dim = 64
    model = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, dim, generator=gen), torch.randn(dim, dim, generator=gen) / dim**0.5
    y = torch.tanh(x @ w)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    x, y = x.to(device), y.to(device)
    ds_config = {"zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "gradient_clipping": 1.0}
    config = TrainerConfig(checkpoint_dir=root, global_batch=8, micro_batch=4, dataset_len=64,
                           total_steps=TRAIN_STEPS, save_every_steps=SAVE_EVERY, health=HealthConfig(enabled=False))
    os.environ["MASTER_PORT"] = str(_free_port())  # a world of its own for each phase
    started = time.perf_counter()
    trainer = Trainer.initialize(model, ds_config, config, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    init_s = time.perf_counter() - started
    engine = trainer.engine
    losses, step_s = [], []
    for batch in trainer.batches():
        t0 = time.perf_counter()
        for indices in batch.micro_batches:
            idx = torch.tensor(indices, device=device)
            loss = F.mse_loss(engine(x[idx]), y[idx])
            engine.backward(loss)
            engine.step()
        losses.append(trainer.step_done(loss.item()))
        step_s.append(time.perf_counter() - t0)
    info = trainer.finish()
    host_bytes, disk_bytes = getattr(trainer, "_restore_bytes", (0, 0))
    return {"phase": phase, "restored_step": trainer.restored.step, "step": trainer.step, "losses": losses,
            "init_s": init_s, "step_s": step_s, "digests": state_digests(trainer.state.save_tensors()),
            "device": str(device), "restore_disk_bytes": disk_bytes, "restore_host_bytes": host_bytes,
            "commit": None if info is None else {"step": info.step, "snapshot_s": info.snapshot_s,
                                                 "commit_s": info.commit_s, "bytes": info.logical_bytes}}


def child_train(root: str, out_path: str) -> None:
    """Part 4's process: train and checkpoint, leave the world, then restore into a new Trainer
    (new model, engine, process group and checkpointer: nothing but the disk carries the state)."""
    from stalwart.trainer.reform import leave_world

    reports = {"save": _train_phase("save", root, seed=0)}
    leave_world()
    reports["restore"] = _train_phase("restore", root, seed=12345)
    leave_world()
    with open(out_path, "w") as f:
        json.dump(reports, f)


def part_trainer(ctx: Ctx, budget: Budget) -> dict[str, Any]:
    root = os.path.join(ctx.workdir, "trainer-ckpt")
    env = _child_env(ctx.cuda)
    if ctx.cuda:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    out = os.path.join(ctx.workdir, "trainer.json")
    log = os.path.join(ctx.workdir, "trainer.log")
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "train", "--child-root", root, "--child-out", out]
    with open(log, "wb") as logf:
        try:
            rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                timeout=max(5.0, budget.left())).returncode
        except subprocess.TimeoutExpired:
            raise PartTimeout(f"part 'trainer' exceeded its budget of {budget.seconds:.0f} s") from None
    if rc != 0:
        with open(log, errors="replace") as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"the training process exited {rc}:\n{tail}")
    with open(out) as f:
        reports = json.load(f)
    saved, restored = reports["save"], reports["restore"]
    differ = compare_digests(saved["digests"], restored["digests"])
    return {"results": {
        "device": saved["device"], "steps": saved["step"], "restored_step": restored["restored_step"],
        "tensors": len(saved["digests"]), "differ": differ[:20],
        "bitwise_equal": not differ and restored["restored_step"] == saved["step"] and bool(saved["digests"]),
        "restore_disk_bytes": restored["restore_disk_bytes"], "losses": saved["losses"], "init_s": saved["init_s"],
        "restore_init_s": restored["init_s"], "step_s_median": statistics.median(saved["step_s"]),
        "last_commit": saved["commit"],
    }}  # fmt: skip


def print_trainer(out: dict[str, Any]) -> None:
    r = out["results"]
    c = r["last_commit"] or {}
    print(format_table(
        ["device", "steps", "restored at", "tensors", "bitwise equal", "read from disk B", "init s", "restore s",
         "step s", "snapshot ms"],
        [[r["device"], r["steps"], r["restored_step"], r["tensors"], r["bitwise_equal"], r["restore_disk_bytes"],
          r["init_s"], r["restore_init_s"], r["step_s_median"], c.get("snapshot_s", 0.0) * 1e3]]))
    if r["differ"]:
        print(f"  differ: {r['differ']}")


# --- part 5: aborting a collective whose peer died ----------------------------------------------

def child_abort(rank: int, port: int, backend: str, marker: str, out_path: str, abort_after: float) -> None:
    """Rank 1 dies (SIGKILL) in the middle of all-reduces; rank 0 aborts its groups the way the
    trainer does (``_abort_all_groups``) ``abort_after`` seconds after it learns of the death,
    and records when its collective gave up."""
    import datetime

    import torch.distributed as dist

    from stalwart.trainer.reforming import _abort_all_groups

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.ones(1 << 20, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    if backend == "nccl":
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        with open(marker, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    aborted: list[float] = []

    def watchdog() -> None:  # stands in for the agent's Reform reaching a rank stuck in a collective
        while not os.path.exists(marker):
            time.sleep(0.005)
        time.sleep(abort_after)
        aborted.append(time.time())
        _abort_all_groups()

    threading.Thread(target=watchdog, daemon=True).start()
    error = ""
    deadline = time.monotonic() + 25
    try:
        while time.monotonic() < deadline:
            dist.all_reduce(t)
            if backend == "nccl":
                torch.cuda.synchronize()
            if aborted:  # a collective may return after the abort instead of raising
                break
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        error = f"{type(exc).__name__}: {first.rsplit('] ', 1)[-1][:200]}"  # without the source location
    out_at = time.time()
    with open(marker) as f:
        killed_at = float(f.read())
    with open(out_path, "w") as f:
        json.dump({"killed_at": killed_at, "out_at": out_at, "aborted_at": aborted[0] if aborted else None,
                   "error": error}, f)
    os._exit(0)  # the group is broken: no orderly shutdown


def part_abort(ctx: Ctx, budget: Budget) -> dict[str, Any]:
    if ctx.cuda and ctx.gpus < 2:
        return {"skipped": "one GPU: NCCL abort needs two"}
    backend = "nccl" if ctx.cuda else "gloo"
    marker = os.path.join(ctx.workdir, "abort-killed")
    out = os.path.join(ctx.workdir, "abort.json")
    port = _free_port()
    abort_after = ctx.args.abort_after
    procs = []
    env = _child_env(ctx.cuda)
    for rank in (0, 1):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "abort", "--child-rank", str(rank),
               "--child-port", str(port), "--child-backend", backend, "--child-root", marker, "--child-out", out,
               "--abort-after", str(abort_after)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=max(5.0, budget.left()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise PartTimeout(f"part 'abort' exceeded its budget of {budget.seconds:.0f} s") from None
    if not os.path.exists(out):
        raise RuntimeError("the survivor wrote no result:\n" + outputs[0].decode(errors="replace")[-2000:])
    with open(out) as f:
        r = json.load(f)
    note = "" if ctx.cuda else ("no CUDA device: the same harness over gloo (a dead peer's connection "
                                "closes at once; NCCL's abort path needs two GPUs)")
    return {"results": {
        "backend": backend, "abort_after_s": abort_after, "survivor_out_s": r["out_at"] - r["killed_at"],
        "aborted": r["aborted_at"] is not None, "error": r["error"], "note": note,
    }}  # fmt: skip


def print_abort(out: dict[str, Any]) -> None:
    r = out["results"]
    print(format_table(["backend", "abort after s", "aborted", "survivor out s", "error"],
                       [[r["backend"], r["abort_after_s"], r["aborted"], r["survivor_out_s"], r["error"][:60]]]))
    if r["note"]:
        print("  " + r["note"])


# --- main --------------------------------------------------------------------------------------

PRINTERS = {"nvml": print_nvml, "snapshot": print_snapshot, "replica": print_replica, "trainer": print_trainer,
            "abort": print_abort}
RUNNERS = {"nvml": part_nvml, "snapshot": part_snapshot, "replica": part_replica, "trainer": part_trainer,
           "abort": part_abort}


def summary(parts: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """One line per part: its status and headline figure."""
    rows = []
    for name in PARTS:
        p = parts.get(name, {"skipped": "not run"})
        if "skipped" in p:
            rows.append([name, "skipped", p["skipped"]])
        elif "error" in p:
            rows.append([name, "FAILED", p["error"].splitlines()[0][:100]])
        else:
            r = p["results"]
            if name == "nvml":
                head = f"verdict {r['verdict']}, poll {r['poll_us_median']:.0f} µs, {len(r['findings'])} findings"
            elif name == "snapshot":
                head = "; ".join(f"{s['bytes'] / GB:.3g} GB: overlap stall {s['stalwart_overlap']['stall_s'] * 1e3:.1f}"
                                 f" ms ({s['stalwart_overlap']['stall_pct_of_step']:.2f} % of step), step after "
                                 f"save {s['step_slowdown']['after_save_pct']:+.1f} %" for s in r["sizes"])
            elif name == "replica":
                head = "; ".join(f"{s['bytes'] / GB:.3g} GB: {s['replica_pipelined_GBps']:.1f} GB/s"
                                 for s in r["sizes"])
            elif name == "trainer":
                head = f"restored step {r['restored_step']}, bitwise equal: {r['bitwise_equal']}"
            else:
                head = f"{r['backend']}: survivor out in {r['survivor_out_s']:.3f} s"
            ok = not (name == "trainer" and not r["bitwise_equal"])
            rows.append([name, "ok" if ok else "FAILED", head])
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--sizes", default=None, help="GB of state per size (default 1,4,16 on a GPU, "
                                                      "0.01,0.05 on the CPU)")
    parser.add_argument("--skip", default="", help=f"comma-separated parts to skip, of {','.join(PARTS)}")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_check.json"), help="the JSON report")
    parser.add_argument("--dir", default=None, help="scratch directory on the checkpoint disk (default: tmp)")
    parser.add_argument("--repeats", type=int, default=1, help="measured runs after a warm-up (best is kept)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    parser.add_argument("--abort-after", type=float, default=1.0, help="abort part: seconds before the abort")
    for name in ("child", "child-root", "child-out", "child-backend"):
        parser.add_argument(f"--{name}", default=None, help=argparse.SUPPRESS)
    for name in ("child-rank", "child-port"):
        parser.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child == "train":
        child_train(args.child_root, args.child_out)
        return 0
    if args.child == "abort":
        child_abort(args.child_rank, args.child_port, args.child_backend, args.child_root, args.child_out,
                    args.abort_after)
        return 0
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: no CUDA device here (torch {torch.__version__})", file=sys.stderr)
        return 2
    args.sizes = parse_sizes_gb(args.sizes or ("1,4,16" if args.device == "cuda" else "0.01,0.05"))
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(PARTS):
        print(f"--skip: unknown parts {sorted(skip - set(PARTS))}; parts are {','.join(PARTS)}", file=sys.stderr)
        return 2
    budgets = {k: v * args.budget_scale for k, v in (DEFAULT_BUDGETS if args.device == "cuda" else CPU_BUDGETS).items()}
    ctx = Ctx(args)
    started = time.monotonic()
    parts: dict[str, dict[str, Any]] = {}
    current = [""]
    # A part stuck inside one call (a hung collective or driver call) cannot check its budget:
    # past the sum of all budgets, say where, write what there is, and exit 3.
    total = sum(budgets.values()) + 30

    def overrun() -> None:
        print(f"\ngpu check: total budget of {total:.0f} s exceeded in part {current[0]!r}; exiting",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr)
        parts[current[0]] = {"error": f"PartTimeout: stuck past the total budget of {total:.0f} s"}
        with contextlib.suppress(Exception):
            write_report(args.out, ctx, parts, started)
        shutil.rmtree(ctx.workdir, ignore_errors=True)
        os._exit(3)

    timer = threading.Timer(total, overrun)
    timer.daemon = True
    timer.start()
    print(f"gpu check on {ctx.device} ({ctx.gpus} GPU(s)), torch {torch.__version__}, sizes {args.sizes} GB",
          flush=True)
    try:
        for name in PARTS:
            print(f"\n== {name}", flush=True)
            current[0] = name
            if name in skip:
                parts[name] = {"skipped": "skipped by --skip"}
            else:
                parts[name] = run_part(name, lambda b, n=name: RUNNERS[n](ctx, b), Budget(name, budgets[name]))
            p = parts[name]
            if "skipped" in p:
                print(f"skipped: {p['skipped']}")
            elif "error" in p:
                print(f"FAILED: {p['error']}")
            else:
                PRINTERS[name](p)
            sys.stdout.flush()
    finally:
        shutil.rmtree(ctx.workdir, ignore_errors=True)
    timer.cancel()
    print("\n== summary")
    print(format_table(["part", "status", "result"], summary(parts)))
    report = write_report(args.out, ctx, parts, started)
    print(f"wrote {args.out} in {report['total_s']:.1f} s")
    return 1 if any(r[1] == "FAILED" for r in report["summary"]) else 0


def write_report(path: str, ctx: Ctx, parts: dict[str, dict[str, Any]], started: float) -> dict[str, Any]:
    args = ctx.args
    rows = summary(parts)
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "device": str(ctx.device), "gpus": ctx.gpus,
                    "gpu_name": torch.cuda.get_device_name(0) if ctx.cuda else None},
        "sizes_gb": args.sizes, "parts": parts, "summary": rows, "total_s": time.monotonic() - started,
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    return report


if __name__ == "__main__":
    sys.exit(main())
