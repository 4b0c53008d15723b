"""Ordinary training noise must not look like a fault: the health checks' false-positive run.

Trains ``examples/train_gpt.py`` (dropout on, small batches: a noisy loss) for ``--steps`` steps
with the default health thresholds (``HealthConfig``) and no injected fault, then reads the step
record and reports the rollbacks (must be 0), the loss at the start and the end, and the largest
spike score any step reached (in floored MADs above the running median, the statistic the
detector thresholds), i.e. how much margin the default threshold leaves.

    python bench/health_noise.py                      # 2,000 steps, world size 1
    python bench/health_noise.py --nproc 2 --steps 500

Writes ``bench/results/health_noise.json`` and ``bench/results/health_noise.png`` (loss curve and
spike score per step). Exits 1 if any fault or rollback happened.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from stalwart.trainer.health import HealthConfig, HealthMonitor, spike_score  # noqa: E402
from stalwart.trainer.record import committed_steps, read_events  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace, work: Path) -> tuple[int, float]:
    record = work / "steps.jsonl"
    script_args = [str(REPO / "examples" / "train_gpt.py"), "--ckpt-dir", str(work / "ckpt"), "--steps-log",
                   str(record), "--steps", str(args.steps), "--dataset-len", str(args.dataset_len),
                   "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
                   "--save-every", str(args.save_every), "--dropout", str(args.dropout), "--seed", str(args.seed)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    if args.nproc == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()))
        cmd = [sys.executable, *script_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               *script_args]
    started = time.monotonic()
    with open(work / "run.log", "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    return rc, time.monotonic() - started


def analyse(events: list[dict], config: HealthConfig) -> dict:
    committed = committed_steps(events)
    steps = sorted(committed)
    losses = [committed[k]["loss"] for k in steps]
    # Replay the detector's statistic over the committed losses (the trainer's history is exactly these).
    monitor = HealthMonitor(config)
    scores: list[float | None] = []
    for k, loss in zip(steps, losses, strict=True):
        hist = [x for _, x in monitor.history]
        scores.append(spike_score(hist, loss, config.spike_rel_floor).score
                      if len(hist) >= config.spike_min_history else None)
        monitor.accept(k, loss, update_skipped=bool(committed[k].get("update_skipped")))
    valid = [s for s in scores if s is not None]
    worst = max(range(len(scores)), key=lambda i: scores[i] if scores[i] is not None else -math.inf)
    head, tail = losses[:10], losses[-50:]
    return {
        "steps": len(steps),
        "last_step": steps[-1] if steps else 0,
        "faults": sum(e["event"] == "fault" for e in events),
        "rollbacks": sum(e["event"] == "rollback" for e in events),
        "gave_up": sum(e["event"] == "gave_up" for e in events),
        "update_skipped": sum(bool(committed[k].get("update_skipped")) for k in steps),
        "loss_first": losses[0],
        "loss_start_mean10": statistics.fmean(head),
        "loss_end_mean50": statistics.fmean(tail),
        "loss_end_stdev50": statistics.stdev(tail) if len(tail) > 1 else 0.0,
        "loss_last": losses[-1],
        "score_max": max(valid) if valid else None,
        "score_max_step": steps[worst] if valid else None,
        "score_p99": sorted(valid)[int(0.99 * (len(valid) - 1))] if valid else None,
        "threshold": config.spike_threshold,
        "curve": {"step": steps, "loss": losses, "score": scores},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["curve"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=[2, 1])
    ax1.plot(c["step"], c["loss"], lw=0.7, color="tab:blue")
    ax1.set_ylabel("loss (mean over ranks)")
    ax1.set_title(f"health_noise: {result['steps']} steps, world {result['nproc']}, "
                  f"{result['rollbacks']} rollbacks")
    ax1.grid(alpha=0.3)
    pts = [(s, v) for s, v in zip(c["step"], c["score"], strict=True) if v is not None]
    ax2.plot([s for s, _ in pts], [v for _, v in pts], lw=0.5, color="tab:gray", label="spike score (MADs)")
    ax2.axhline(result["threshold"], color="tab:red", ls="--", label=f"threshold {result['threshold']:g}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("MADs above median")
    ax2.legend(loc="upper right")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--dataset-len", type=int, default=4800)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--work", default=None, help="keep the run's files here (default: a temporary folder)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="health-noise-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        rc, wall = run(args, work)
        if rc != 0:
            print(f"training exited {rc}; log tail:\n" + "\n".join((work / "run.log").read_text().splitlines()[-30:]))
        events = read_events(str(work / "steps.jsonl"))
    result = {"nproc": args.nproc, "exit_status": rc, "wall_s": wall, "config": vars(args),
              "health": HealthConfig().__dict__, **analyse(events, HealthConfig())}
    (out / "health_noise.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "health_noise.png")
    rows = [("steps committed", result["steps"]), ("world size", args.nproc), ("exit status", rc),
            ("faults", result["faults"]), ("rollbacks", result["rollbacks"]),
            ("fp16 skipped updates", result["update_skipped"]),
            ("loss, first step", f"{result['loss_first']:.4f}"),
            ("loss, mean of first 10", f"{result['loss_start_mean10']:.4f}"),
            ("loss, mean of last 50", f"{result['loss_end_mean50']:.4f} ± {result['loss_end_stdev50']:.4f}"),
            ("max spike score (MADs)", f"{result['score_max']:.2f} at step {result['score_max_step']}"),
            ("p99 spike score (MADs)", f"{result['score_p99']:.2f}"),
            ("spike threshold (MADs)", f"{result['threshold']:g}"),
            ("wall time", f"{wall:.0f} s")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"wrote {out / 'health_noise.json'} and {out / 'health_noise.png'}")
    return 0 if rc == 0 and result["faults"] == 0 and result["rollbacks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
