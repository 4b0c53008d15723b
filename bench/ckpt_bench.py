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
training job that checkpoints periodically); the best run is reported.

``--mode throughput`` measures what the stall figure hides: a training loop on the CPU (an MLP with
Adam whose parameters and moments make ``--state`` bytes; forward, backward, optimizer step) runs
for ``--seconds`` of wall time without checkpointing and then with a stalwart overlap save every
``--every`` steps, for each ``--configs`` entry (SaveConfig fields, e.g. ``background_nice=19``),
``--runs`` times interleaved; it reports steps/s, the throughput lost (%), the CPU time per step of
the whole process (background threads included), the CPU floor (the least the extra CPU work can
cost when training leaves too few idle cores to absorb it: :func:`cpu_floor`) and the stall.
Then it restores the last checkpoint into the live tensors from storage, once as it is and once
with reads throttled to ``--throttle-mbps`` (``load(read_bytes_per_s=...)``: every chunk read
waits its turn), so the cost of a restore from slow storage shows.

Prints a table and writes JSON to ``bench/results/`` (``--out``); ``--dir`` (created if missing) is
the scratch directory on the disk to measure. This is a benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from stalwart.ckpt import Checkpointer, RetentionPolicy, SaveConfig, SaveHandle, load

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


# --- throughput mode: a training loop with and without checkpointing ---------------------------


class _Model(torch.nn.Module):
    """An MLP of ``depth`` square layers; with Adam its saved state is ~12 bytes per parameter."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(width, width, generator=gen) / width**0.5) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.layers:
            x = torch.tanh(x @ w)
        return x


class _Trainer:
    """Forward, backward and an Adam step on the CPU; its state (parameters and both Adam moments,
    fp32) is about ``nbytes``."""

    def __init__(self, nbytes: int, depth: int, batch: int) -> None:
        width = max(64, int((nbytes / 12 / depth) ** 0.5) // 64 * 64)
        self.width, self.depth, self.batch = width, depth, batch
        self.model = _Model(width, depth)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1)
        self.step_no = 0

    def forward_backward(self) -> None:
        x = torch.randn(self.batch, self.width, generator=self.gen)
        target = torch.randn(self.batch, self.width, generator=self.gen)
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(x), target).backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.step_no += 1

    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.model.layers):
            out[f"param.{i}"] = p.data
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{i}.{key}"] = value
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state().values())


def train_for(trainer: _Trainer, seconds: float, every: int, ckpt: Checkpointer | None) -> dict[str, Any]:
    """Train for ``seconds`` of wall time, saving every ``every`` steps when ``ckpt`` is given
    (overlap snapshot: the copy runs during the next forward/backward, waited on before the
    optimizer step). Counts the steps done in the window."""
    stalls: list[float] = []
    snapshot_waits: list[float] = []
    handle: SaveHandle | None = None
    steps = 0
    cpu_started = time.process_time()
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        trainer.forward_backward()
        if handle is not None:
            waited = time.perf_counter()
            handle.wait_snapshot()
            snapshot_waits.append(time.perf_counter() - waited)
            handle = None
        trainer.optimizer_step()
        steps += 1
        if ckpt is not None and steps % every == 0:
            called = time.perf_counter()
            handle = ckpt.save(trainer.step_no, trainer.state())
            stalls.append(time.perf_counter() - called)
    elapsed = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started  # every thread of the process: training and background
    durable_s = None
    saves = len(stalls)
    if ckpt is not None:
        if handle is not None:
            handle.wait_snapshot()
        drained = time.perf_counter()
        ckpt.wait()
        durable_s = time.perf_counter() - drained
    return {
        "steps": steps,
        "elapsed_s": elapsed,
        "steps_per_s": steps / elapsed,
        "cpu_s_per_step": cpu_s / max(steps, 1),
        "saves": saves,
        "stall_s": statistics.median(stalls) if stalls else 0.0,
        "snapshot_wait_s": statistics.median(snapshot_waits) if snapshot_waits else 0.0,
        "tail_drain_s": durable_s,
    }


def restore(root: str, trainer: _Trainer, rate: float | None) -> dict[str, float]:
    targets = trainer.state()
    started = time.perf_counter()
    result = load(root, targets, read_bytes_per_s=rate)  # the loader's read budget: a slow shared link
    seconds = time.perf_counter() - started
    return {"step": result.step, "seconds": seconds, "bytes_read": result.bytes_read,
            "GBps": result.bytes_read / seconds / 1e9}  # fmt: skip


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_floor(step_s: float, cpu_per_step: float, extra_per_step: float, cores: int) -> float:
    """The least throughput checkpointing can cost when its CPU work has to fit beside training's:
    a step needs ``cpu_per_step`` CPU seconds, and checkpointing ``extra_per_step`` more; with
    ``cores`` cores a step cannot take less than ``(cpu + extra) / cores`` of wall time, nor less
    than it did without checkpoints. 0 when idle cores can absorb the work."""
    fastest = max(step_s, (cpu_per_step + max(extra_per_step, 0.0)) / cores)
    return 1.0 - step_s / fastest


def bench_throughput(workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    nbytes = parse_size(args.state)
    trainer = _Trainer(nbytes, args.depth, args.batch)
    for _ in range(3):  # warm-up, and the Adam moments exist from here on
        trainer.forward_backward()
        trainer.optimizer_step()
    state_bytes = trainer.state_bytes()
    configs: list[tuple[str, SaveConfig]] = [
        (name, SaveConfig(snapshot="overlap", retention=RetentionPolicy(keep_last=1), **kwargs))
        for name, kwargs in parse_configs(args.configs)
    ]  # fmt: skip
    print(f"== throughput: state {state_bytes / MiB:.0f} MiB (MLP {trainer.depth} x {trainer.width}^2, Adam), "
          f"batch {trainer.batch}, every {args.every} steps, {args.seconds:.0f} s windows, {args.runs} runs; "
          f"load {load_average()}", flush=True)  # fmt: skip
    root = os.path.join(workdir, "throughput")
    runs: dict[str, list[dict[str, Any]]] = {"none": []}
    runs.update({name: [] for name, _ in configs})
    for run in range(args.runs):  # interleaved, so drifting load on a shared machine hits all alike
        load_before = load_average()
        base = train_for(trainer, args.seconds, args.every, None)
        base["load"] = load_before
        runs["none"].append(base)
        print(f"   run {run + 1} no checkpoint: {base['steps_per_s']:.3f} steps/s, load {load_before}", flush=True)
        for name, config in configs:
            shutil.rmtree(root, ignore_errors=True)
            load_before = load_average()
            with Checkpointer(root, config) as ckpt:
                ckpt.save(trainer.step_no, trainer.state()).result()  # warm: the host buffer exists
                r = train_for(trainer, args.seconds, args.every, ckpt)
            r["load"] = load_before
            r["lost"] = 1.0 - r["steps_per_s"] / base["steps_per_s"]
            r["cpu_extra"] = r["cpu_s_per_step"] / base["cpu_s_per_step"] - 1.0
            runs[name].append(r)
            print(f"   run {run + 1} {name}: {r['steps_per_s']:.3f} steps/s, lost {r['lost']:.1%}, "
                  f"CPU/step {r['cpu_extra']:+.1%}, {r['saves']} saves, stall {r['stall_s'] * 1e3:.1f} ms, "
                  f"load {load_before}", flush=True)  # fmt: skip
    restores: dict[str, list[dict[str, Any]]] = {"storage": [], "storage_throttled": []}
    rate = args.throttle_mbps * 1e6 if args.throttle_mbps > 0 else None
    for _ in range(args.runs):
        restores["storage"].append(restore(root, trainer, None))
        if rate is not None:
            restores["storage_throttled"].append(restore(root, trainer, rate))
    shutil.rmtree(root, ignore_errors=True)
    base_sps = statistics.median(r["steps_per_s"] for r in runs["none"])
    cores = len(os.sched_getaffinity(0))
    base_cpu = statistics.median(r["cpu_s_per_step"] for r in runs["none"])
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
            "step_s": 1.0 / statistics.median(r["steps_per_s"] for r in rs),
            "lost": statistics.median(r["lost"] for r in rs) if name != "none" else 0.0,
            "cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in rs),
            "cpu_extra": statistics.median(r["cpu_extra"] for r in rs) if name != "none" else 0.0,
            "saves": statistics.median(r["saves"] for r in rs),
            "stall_s": statistics.median(r["stall_s"] for r in rs),
            "snapshot_wait_s": statistics.median(r["snapshot_wait_s"] for r in rs),
            "lost_each": [r.get("lost", 0.0) for r in rs],
        }
        extra = summary[name]["cpu_s_per_step"] - base_cpu
        summary[name]["cpu_floor"] = cpu_floor(1.0 / base_sps, base_cpu, extra, cores) if name != "none" else 0.0
    return {
        "state_bytes": state_bytes,
        "model": {"width": trainer.width, "depth": trainer.depth, "batch": trainer.batch},
        "every": args.every,
        "seconds": args.seconds,
        "configs": {name: {k: v for k, v in kw} for name, kw in
                    ((n, sorted(k.items())) for n, k in parse_configs(args.configs))},
        "baseline_steps_per_s": base_sps,
        "cores": cores,
        "busy_cores": base_cpu * base_sps,  # what training alone keeps busy
        "runs": runs,
        "summary": summary,
        "restore": {key: ({"seconds": statistics.median(r["seconds"] for r in rs),
                           "GBps": statistics.median(r["GBps"] for r in rs),
                           "bytes_read": rs[0]["bytes_read"], "runs": rs} if rs else None)
                    for key, rs in restores.items()},
        "throttle_MBps": args.throttle_mbps,
    }  # fmt: skip


def parse_configs(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``name[:field=value[+field=value...]],...`` -> SaveConfig keyword arguments per name."""
    out: list[tuple[str, dict[str, Any]]] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, spec = item.partition(":")
        kwargs: dict[str, Any] = {}
        for pair in filter(None, spec.split("+")):
            key, _, value = pair.partition("=")
            kwargs[key] = float(value) if "." in value else int(value)
        out.append((name, kwargs))
    return out


def print_throughput(res: dict[str, Any]) -> None:
    size = f"{res['state_bytes'] / MiB:.0f}M"
    header = (f"{'state':>6} {'checkpoint':<22} {'steps/s':>8} {'step s':>7} {'lost':>6} {'lost each run':<22} "
              f"{'CPU s/step':>10} {'CPU +':>6} {'CPU floor':>9} {'saves':>5} {'stall ms':>8} "
              f"{'snap wait ms':>12}")  # fmt: skip
    print("\n" + header)
    print("-" * len(header))
    for name, s in res["summary"].items():
        label = "none" if name == "none" else f"every {res['every']}: {name}"
        each = " ".join(f"{x:.1%}" for x in s["lost_each"]) if name != "none" else "-"
        lost = f"{s['lost']:6.1%}" if name != "none" else f"{'-':>6}"
        cpu_extra = f"{s['cpu_extra']:6.1%}" if name != "none" else f"{'-':>6}"
        floor = f"{s['cpu_floor']:9.1%}" if name != "none" else f"{'-':>9}"
        print(f"{size:>6} {label:<22} {s['steps_per_s']:8.3f} {s['step_s']:7.3f} {lost} {each:<22} "
              f"{s['cpu_s_per_step']:10.3f} {cpu_extra} {floor} {s['saves']:5.0f} {s['stall_s'] * 1e3:8.1f} "
              f"{s['snapshot_wait_s'] * 1e3:12.1f}")
    print()
    for key, label in (("storage", "restore from storage"),
                       ("storage_throttled", f"restore, storage at {res['throttle_MBps']:.0f} MB/s")):
        r = res["restore"].get(key)
        if r:
            print(f"{size:>6} {label:<34} {r['seconds']:7.2f} s  {r['GBps']:5.2f} GB/s  "
                  f"({r['bytes_read'] / MiB:.0f} MiB read)")
    print("\nsteps/s: median of the runs (each a fixed wall-time window, no-checkpoint and checkpoint runs")
    print("interleaved); lost: median of each run's throughput lost against the no-checkpoint run before it;")
    print("CPU s/step: CPU time of the whole process (training and background threads) per step; CPU +:")
    print("median extra CPU per step against the no-checkpoint run (what checkpointing costs in CPU work,")
    print("unlike steps/s not disturbed by other tenants of the machine).")
    print(f"CPU floor: the least throughput that extra CPU work can cost here: training alone keeps "
          f"{res['busy_cores']:.2f} of {res['cores']} cores busy,")
    print("so checkpoint work beyond the idle cores' share lengthens every step (no pacing or priority")
    print("gets under it; only less work per checkpoint, or idle cores, does).")
    print("stall: median time save() blocks; snap wait: median wait for the overlapped snapshot before the")
    print("optimizer step. Restore: median time to load the last checkpoint into the live tensors (the")
    print("unthrottled read is mostly from the page cache).")



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("stall", "throughput"), default="stall",
                        help="stall: save stall and persist speed against the others (default); "
                             "throughput: steps/s of a training loop with and without checkpointing")
    parser.add_argument("--sizes", default="256M,1G,4G", help="stall: comma-separated state sizes (default 256M,1G,4G)")
    parser.add_argument("--repeats", type=int, default=2, help="stall: measured runs per competitor (best is kept)")
    parser.add_argument("--state", default="1G", help="throughput: training state size (default 1G)")
    parser.add_argument("--every", type=int, default=10, help="throughput: checkpoint every N steps (default 10)")
    parser.add_argument("--seconds", type=float, default=60.0, help="throughput: wall time of each window (default 60)")
    parser.add_argument("--runs", type=int, default=3, help="throughput: runs of each (median reported, default 3)")
    parser.add_argument("--batch", type=int, default=8, help="throughput: batch size (default 8)")
    parser.add_argument("--depth", type=int, default=8, help="throughput: layers of the MLP (default 8)")
    parser.add_argument("--configs", default="default",
                        help="throughput: SaveConfigs to compare, 'name[:field=value[+field=value]],...' "
                             "(default: 'default', SaveConfig's defaults with an overlap snapshot)")
    parser.add_argument("--throttle-mbps", type=float, default=100.0,
                        help="throughput: storage read rate of the throttled restore in MB/s (0: none; default 100)")
    parser.add_argument("--dir", default=None, help="scratch directory on the disk to measure (created if missing)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="where the JSON goes")
    args = parser.parse_args(argv)
    # DCP warns (from its background thread too) that it saves without a process group: intended.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.makedirs(args.out, exist_ok=True)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or args.out)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.is_available()},
        "load_before": load_average(),
    }  # fmt: skip
    try:
        if args.mode == "throughput":
            report["throughput"] = bench_throughput(workdir, args)
        else:
            report["results"] = [bench_size(workdir, parse_size(s), args.repeats) for s in args.sizes.split(",")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["load_after"] = load_average()
    if args.mode == "throughput":
        print_throughput(report["throughput"])
    else:
        print_table(report["results"])
    print(f"load average (1, 5, 15 min): before {report['load_before']}, after {report['load_after']}")
    name = "ckpt_throughput" if args.mode == "throughput" else "ckpt_bench"
    path = os.path.join(args.out, f"{name}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
