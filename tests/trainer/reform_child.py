"""A worker of test_reform.py: the tiny GPT of examples/train_gpt.py under ``Trainer.train``.

Started by the test (no torchrun) with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/STALWART_ROUND, or
as a spare with ``STALWART_SPARE=1``. The test plays the agent: it writes ``SPEC_DIR/<name>.json``
(a :class:`ReformSpec`), which this worker passes to ``trainer.request_reform`` (the handler the
agent client calls) or, as a spare, returns from its ``assignment`` callable.

At the first step after any restore (a start from a checkpoint, a re-form, a spare joining) the
world's rank 0 writes the ZeRO-gathered fp32 weights and Adam state to
``OUT/state-<name>-step<s>.pt``. At the end every worker writes ``OUT/<name>.json`` (its re-form
timings, or the error that stopped it).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_gpt import TinyGPT, run_step, synthetic_corpus  # noqa: E402

from stalwart.trainer import PeerConfig, ReformSpec, Trainer, TrainerConfig  # noqa: E402


def read_spec(path: Path) -> ReformSpec | None:
    try:
        return ReformSpec(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def wait_spec(path: Path) -> ReformSpec:
    while (spec := read_spec(path)) is None:
        time.sleep(0.01)
    path.unlink()
    return spec


def dump_state(trainer: Trainer, out: Path, name: str) -> None:
    """Gathered fp32 weights and Adam moments (a collective), written by rank 0."""
    state: dict[str, torch.Tensor] = {}
    for pname, p in trainer.engine.module.named_parameters():
        state[f"fp32/{pname}"] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{key}/{pname}"] = safe_get_full_optimizer_state(p, key).clone()
    state["meta/optimizer_step"] = torch.tensor(trainer.state.optimizer_step_count())
    state["meta/lr"] = torch.tensor(trainer.state.base.param_groups[0]["lr"], dtype=torch.float64)
    if dist.get_rank() == 0:
        torch.save(state, out / f"state-{name}-step{trainer.step}.pt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--spec-dir", required=True)
    ap.add_argument("--steps-log", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL this process after this step")
    ap.add_argument("--stop-at-step", type=int, default=None, help="SIGSTOP this process after this step")
    ap.add_argument("--reform-at-step", type=int, default=None,
                    help="hand this rank its own Reform (--reform-spec, JSON) during this step")
    ap.add_argument("--reform-spec", default=None)
    ap.add_argument("--fail-at-step", type=int, default=None,
                    help="raise a collective error (as if a peer's connection broke) in this step, once")
    ap.add_argument("--collective-timeout", type=float, default=30.0)
    ap.add_argument("--reform-wait", type=float, default=60.0)
    ap.add_argument("--dist-timeout", type=float, default=60.0)
    ap.add_argument("--zero-stage", type=int, default=1)
    ap.add_argument("--node", default=None, help="this process's node (STALWART_NODE: peer replica placement)")
    ap.add_argument("--no-peers", action="store_true", help="no peer replicas (PeerConfig(replicas=0))")
    ap.add_argument("--memory-every", type=int, default=0, help="PeerConfig.memory_every (memory generations)")
    args = ap.parse_args()
    if args.node:
        os.environ["STALWART_NODE"] = args.node
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(name)s %(levelname)s %(message)s")
    out, spec_path = Path(args.out), Path(args.spec_dir) / f"{args.name}.json"
    result: dict[str, object] = {"name": args.name, "pid": os.getpid()}

    torch.manual_seed(0)
    context, vocab = 16, 64
    model = TinyGPT(vocab=vocab, context=context, dropout=0.0)
    corpus = synthetic_corpus(240 + context + 1, vocab)
    ds_config = {"zero_optimization": {"stage": args.zero_stage}, "gradient_clipping": 1.0, "steps_per_print": 10**9,
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                               "warmup_num_steps": 10}}}
    config = TrainerConfig(checkpoint_dir=args.ckpt_dir, global_batch=12, micro_batch=2, dataset_len=240,
                           total_steps=args.steps, save_every_steps=args.save_every, keep_last=20,
                           record_path=args.steps_log, collective_timeout_s=args.collective_timeout,
                           reform_wait_s=args.reform_wait, dist_timeout_s=args.dist_timeout, commit_timeout_s=20.0,
                           peer=PeerConfig(replicas=0 if args.no_peers else 1,
                                           memory_every=args.memory_every))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    try:
        trainer = Trainer.initialize(model, ds_config, config, optimizer=optimizer,
                                     assignment=lambda: wait_spec(spec_path))
    except Exception as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        (out / f"{args.name}.json").write_text(json.dumps(result))
        raise

    trainer.expects_reform = True  # this harness plays the agent

    def watch() -> None:  # plays the agent client's Reform delivery
        while True:
            spec = read_spec(spec_path)
            if spec is not None:
                spec_path.unlink()
                trainer.request_reform(spec)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    dumped: set[tuple[int, int]] = set()

    def step(engine: object, batch: object) -> float:
        s = trainer.step
        restore = (len(trainer.reforms), trainer.restored.step)
        if s == trainer.restored.step and trainer.restored.saved_world_size and restore not in dumped:
            dumped.add(restore)
            dump_state(trainer, out, args.name)
        if s > trainer.restored.step and s in (args.kill_at_step, args.stop_at_step):
            trainer.checkpointer.wait()  # the committed checkpoint the others will resume from
            if trainer.peers is not None:  # its replica, pushed after the snapshot, has arrived
                trainer.peers.wait_pushed(trainer.checkpointer.committed_snapshot().step, 30.0)
                if args.memory_every:  # and the memory generation of the step just closed
                    trainer.peers.wait_pushed(s, 30.0)
            marker = "killed" if s == args.kill_at_step else "stopped"
            (out / f"{args.name}.{marker}").write_text(json.dumps({"time": time.time(), "step": s}))
            os.kill(os.getpid(), signal.SIGKILL if marker == "killed" else signal.SIGSTOP)
        if args.reform_at_step is not None and s + 1 == args.reform_at_step and not trainer.reforms:
            # The checkpoint the new world resumes from: a Reform abandons a save still in flight.
            trainer.checkpointer.wait()
            trainer.request_reform(ReformSpec(**json.loads(args.reform_spec)))
            (out / f"{args.name}.reform-requested").write_text(json.dumps({"time": time.time(), "step": s + 1}))
        if args.fail_at_step is not None and s + 1 == args.fail_at_step and not trainer.reforms:
            # the save before this step commits first: the re-form then has a checkpoint to
            # restore however slowly a loaded machine persists it (the peers' saves run on)
            trainer.checkpointer.wait(120.0)
            (out / f"{args.name}.failed").write_text(json.dumps({"time": time.time(), "step": s + 1}))
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer (injected by the test)")
        if trainer.reforms:
            gc.collect()  # the collector may reach the old engine any time; here it surely does
        return run_step(engine, batch, corpus, context)  # type: ignore[arg-type]

    try:
        trainer.train(step)
    except Exception as exc:
        traceback.print_exc()
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    result["rank"] = trainer.rank
    result["step"] = trainer.step
    result["reforms"] = [t.to_json() for t in trainer.reforms]
    (out / f"{args.name}.json").write_text(json.dumps(result))
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
