"""In-place re-form with real processes, real gloo and real DeepSpeed (ZeRO-1, CPU).

The test starts the workers itself (``reform_child.py``, no torchrun) and plays the agent: when a
worker dies it hands each survivor (and a spare) its place in the next round as a ReformSpec
file, which the worker passes to ``Trainer.request_reform`` (the agent client's Reform handler).
The re-formed run must equal, bitwise, a run freshly started at the new world size from the same
checkpoint: the restored state (gathered fp32 weights and Adam moments) and every later loss.
Timings (kill -> first resumed step) are printed, not asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_testlib import start_rank, tail

from stalwart.agent.preload import ForkedProcess
from stalwart.ckpt import read_manifest
from stalwart.ckpt.storage import step_dir_name
from testkit import kill_tree

CHILD = str(Path(__file__).with_name("reform_child.py"))
STEPS, SAVE_EVERY, KILL_AT = 12, 3, 7  # checkpoints 3, 6, 9, 12; the victim dies after step 7
RESTORED = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Harness:
    """Starts workers of one job (one checkpoint dir) and hands out Reforms, like an agent."""

    def __init__(self, root: Path, env: dict[str, str], name: str = "job") -> None:
        self.root = root / name
        self.ckpt, self.out, self.specs = self.root / "ckpt", self.root / "out", self.root / "specs"
        for d in (self.ckpt, self.out, self.specs):
            d.mkdir(parents=True, exist_ok=True)
        self.steps_log = self.root / "steps.jsonl"
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes] | ForkedProcess] = {}

    def start(self, name: str, *, rank: int | None, world: int, port: int, round: int = 0, spare: bool = False,
              extra: tuple[str, ...] = ()) -> None:
        env = {**self.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "STALWART_ROUND": str(round),
               "WORLD_SIZE": str(world), "RANK": str(rank if rank is not None else 0), "LOCAL_RANK": "0"}
        if spare:
            env["STALWART_SPARE"] = "1"
        cmd = [sys.executable, CHILD, "--name", name, "--ckpt-dir", str(self.ckpt), "--out", str(self.out),
               "--spec-dir", str(self.specs), "--steps-log", str(self.steps_log), "--steps", str(STEPS),
               "--save-every", str(SAVE_EVERY), *extra]
        self.procs[name] = start_rank(cmd, env, self.root / f"{name}.log")

    def reform(self, name: str, *, rank: int, world: int, port: int, round: int) -> None:
        spec = {"rank": rank, "world_size": world, "master_addr": "127.0.0.1", "master_port": port, "round": round}
        tmp = self.specs / f".{name}.tmp"
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.specs / f"{name}.json")

    def wait_marker(self, name: str, marker: str, timeout: float = 90) -> dict[str, Any]:
        path = self.out / f"{name}.{marker}"
        deadline = time.monotonic() + timeout
        while not path.exists():
            proc = self.procs[name]
            if proc.poll() is not None and marker != "killed":
                raise AssertionError(f"{name} exited {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker} marker from {name}:\n{self.logs()}")
            time.sleep(0.01)
        time.sleep(0.01)
        return json.loads(path.read_text())

    def wait(self, names: list[str], timeout: float = 120) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not finish:\n{self.logs()}") from None
        return {n: json.loads((self.out / f"{n}.json").read_text()) for n in names}

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{tail(self.root / f'{n}.log', 30)}" for n in self.procs)

    def losses(self) -> dict[int, float]:
        lines = [json.loads(x) for x in self.steps_log.read_text().splitlines()]
        return {e["step"]: e["loss"] for e in lines if e["event"] == "step"}

    def state(self, name: str, step: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"state-{name}-step{step}.pt")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()


@pytest.fixture
def jobs() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    try:
        yield made
    finally:
        for h in made:
            h.close()


def restart_reference(jobs: list[Harness], src: Harness, env: dict[str, str], tmp_path: Path,
                      extra: tuple[str, ...] = (), *, step: int = RESTORED, nodes: bool = False) -> Harness:
    """A run freshly started at world 2 from ``src``'s checkpoint of ``step`` (``nodes``: its
    ranks on nodes n0 and n1, as a job's survivors of a lost n2)."""
    ref = Harness(tmp_path, env, "reference")
    jobs.append(ref)
    name = step_dir_name(step)
    shutil.copytree(src.ckpt / name, ref.ckpt / name)
    port = free_port()
    for r in range(2):
        ref.start(f"r{r}", rank=r, world=2, port=port, extra=(*extra, *(("--node", f"n{r}") if nodes else ())))
    ref.wait([f"r{r}" for r in range(2)])
    return ref


def assert_same_as_restart(job: Harness, dumper: str, ref: Harness, step: int = RESTORED) -> None:
    """``job`` resumed at ``step`` equals ``ref`` started there: the state restored, every later
    loss, and the shapes of the last checkpoint's tensors."""
    got, want = job.state(dumper, step), ref.state("r0", step)
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"state after the re-form differs from a restart's: {differ[:5]}"
    losses, expected = job.losses(), ref.losses()
    later = {s: v for s, v in expected.items() if s > step}
    assert sorted(later) == list(range(step + 1, STEPS + 1))
    assert {s: losses[s] for s in later} == later
    # The checkpoints saved after the re-form hold the whole state, as a restart's do (a collected
    # old engine once unlinked the parameters from the new one: those saves held no tensor).
    mine, theirs = read_manifest(str(job.ckpt), STEPS), read_manifest(str(ref.ckpt), STEPS)
    assert mine.tensors and {n: t.shape for n, t in mine.tensors.items()} == {
        n: t.shape for n, t in theirs.tensors.items()}


def lose_rank_2(job: Harness, kill_at: int, extra: tuple[str, ...] = (),
                nodes: tuple[str, ...] = ("n0", "n1", "n2")) -> tuple[float, dict[str, dict[str, Any]]]:
    """Three ranks on ``nodes`` with ``extra``; rank 2 is SIGKILLed after step ``kill_at`` and the
    survivors re-form 3 -> 2. Returns the kill's time and the survivors' results."""
    port = free_port()
    for r in range(3):
        job.start(f"w{r}", rank=r, world=3, port=port,
                  extra=(*extra, "--node", nodes[r], *(("--kill-at-step", str(kill_at)) if r == 2 else ())))
    killed = job.wait_marker("w2", "killed")
    job.procs["w2"].wait(timeout=30)
    new_port = free_port()
    for r in range(2):
        job.reform(f"w{r}", rank=r, world=2, port=new_port, round=1)
    return killed["time"], job.wait(["w0", "w1"])


def start_three(jobs: list[Harness], env: dict[str, str], tmp_path: Path, collective_timeout: float, odd_rank: int,
                odd_args: tuple[str, ...]) -> tuple[Harness, int]:
    """A world of 3 with this collective timeout, ``odd_rank`` also given ``odd_args``; the job and
    a free port for the next world."""
    job = Harness(tmp_path, env)
    jobs.append(job)
    port, new_port = free_port(), free_port()
    extra = ("--collective-timeout", str(collective_timeout))
    for r in range(3):
        job.start(f"w{r}", rank=r, world=3, port=port, extra=(*extra, *odd_args) if r == odd_rank else extra)
    return job, new_port


def print_timings(what: str, kill_time: float, results: dict[str, dict[str, Any]]) -> None:
    def since(t: dict[str, Any], key: str) -> float:  # nan for a moment not reached (a failed run)
        return t[key] - kill_time if t.get(key) is not None else float("nan")

    for name, res in sorted(results.items()):
        for t in res.get("reforms", []):
            print(f"[{what}] {name} round {t['round']} rank {t['rank']}/{t['world_size']}: "
                  f"error seen +{since(t, 'error_seen_at'):.3f}s, "
                  f"re-form began +{since(t, 'started_at'):.3f}s, "
                  f"old world left +{since(t, 'left_at'):.3f}s, "
                  f"group up +{since(t, 'group_up_at'):.3f}s, "
                  f"engine rebuilt +{since(t, 'engine_built_at'):.3f}s, "
                  f"state restored +{since(t, 'restored_at'):.3f}s, "
                  f"first step +{since(t, 'first_step_at'):.3f}s; "
                  f"state from host memory {t['host_bytes']} B, from disk {t['disk_bytes']} B")


def test_survivors_reform_from_3_to_2_in_place_and_match_a_restart_bitwise(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    port = free_port()
    for r in range(3):
        job.start(f"w{r}", rank=r, world=3, port=port, extra=("--kill-at-step", str(KILL_AT)) if r == 2 else ())
    killed = job.wait_marker("w2", "killed")
    job.procs["w2"].wait(timeout=30)
    new_port = free_port()  # the daemon's next round: a new master port (rank 0 hosts it)
    job.reform("w0", rank=0, world=2, port=new_port, round=1)
    job.reform("w1", rank=1, world=2, port=new_port, round=1)
    results = job.wait(["w0", "w1"])
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        assert res["step"] == STEPS and len(res["reforms"]) == 1
        assert res["reforms"][0]["restored_step"] == RESTORED
        assert res["reforms"][0]["host_bytes"] > 0  # its own part of step 6 came from host memory
    print_timings("3->2 kill", killed["time"], results)
    ref = restart_reference(jobs, job, ds_env, tmp_path)
    assert_same_as_restart(job, "w0", ref)


@pytest.mark.parametrize("stage", [1, 3], ids=["z1", "z3"])
def test_a_warm_spare_takes_the_dead_rank_2_to_2_and_matches_a_restart_bitwise(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness], stage: int) -> None:
    """ZeRO-3 too: the spare warms up on a world of one and the survivor re-forms in place, each
    building its next engine on a module rebuilt from the model's structure."""
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    port = free_port()
    zero = ("--zero-stage", str(stage))
    job.start("spare", rank=None, world=2, port=port, spare=True, extra=zero)  # imports, builds its model, waits
    for r in range(2):
        job.start(f"w{r}", rank=r, world=2, port=port,
                  extra=(*zero, "--kill-at-step", str(KILL_AT)) if r == 1 else zero)
    killed = job.wait_marker("w1", "killed")
    job.procs["w1"].wait(timeout=30)
    # The same master port again: w0, rank 0 before and after, reuses the store it hosts there
    # (the round's key prefix keeps round 0's keys apart).
    job.reform("w0", rank=0, world=2, port=port, round=1)
    job.reform("spare", rank=1, world=2, port=port, round=1)
    results = job.wait(["w0", "spare"])
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        assert res["step"] == STEPS
    assert results["w0"]["reforms"][0]["restored_step"] == RESTORED and results["spare"]["rank"] == 1
    print_timings(f"2->2 spare, ZeRO-{stage}", killed["time"], results)
    ref = restart_reference(jobs, job, ds_env, tmp_path, extra=zero)
    assert_same_as_restart(job, "w0", ref)


def test_survivors_of_a_sigstopped_peer_abort_their_stuck_step_when_the_reform_comes(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    """A SIGSTOPed peer keeps its connections open, as one behind a cut link does, so gloo would
    hold the survivors in step 7's collectives until the collective timeout (60 s here). The
    Reform finds them stuck in that step (past the 1 s floor) and they cut their old world's
    connections: the collective fails at once and they re-form."""
    timeout = 60.0
    job, new_port = start_three(jobs, ds_env, tmp_path, timeout, 2, ("--stop-at-step", str(KILL_AT)))
    stopped = job.wait_marker("w2", "stopped")
    job.reform("w0", rank=0, world=2, port=new_port, round=1)
    job.reform("w1", rank=1, world=2, port=new_port, round=1)
    results = job.wait(["w0", "w1"])
    kill_tree(job.procs["w2"].pid)
    print_timings("3->2 SIGSTOP", stopped["time"], results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["cause"] == "collective_error"
        assert t["error_seen_at"] - stopped["time"] < timeout / 4, (name, t)  # not the collective timeout
        assert res["step"] == STEPS
    for name in ("w0", "w1"):
        assert "aborting the old world" in (job.root / f"{name}.log").read_text(), name


def test_ranks_whose_reforms_come_at_different_steps_leave_the_old_world_at_the_same_step(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    """A world change with every rank alive (a regrow, a drain): w0 gets its Reform during step 5,
    w1 only a second later. Had w0 left at its own step boundary, w1 would sit in step 6's
    collectives until the collective timeout and re-form only after a collective error."""
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    port, new_port = free_port(), free_port()
    spec = {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": new_port, "round": 1}
    job.start("w0", rank=0, world=2, port=port, extra=("--reform-at-step", "5", "--reform-spec", json.dumps(spec)))
    job.start("w1", rank=1, world=2, port=port)
    requested = job.wait_marker("w0", "reform-requested")
    time.sleep(1.0)
    job.reform("w1", rank=1, world=2, port=new_port, round=1)
    results = job.wait(["w0", "w1"])
    print_timings("planned re-form", requested["time"], results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["cause"] == "reform", (name, t)  # not "collective_error": nobody was left behind
        assert res["step"] == STEPS
    # both left after step 5, the step whose closing all-reduce carried w0's Reform
    assert {n: r["reforms"][0]["left_step"] for n, r in results.items()} == {"w0": 5, "w1": 5}


def test_a_rank_that_leaves_a_broken_world_cuts_its_connections_so_its_peers_are_out_at_once(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    """w1 sees a collective error in step 5 that its peers do not (a broken link to a fourth
    party, say) and leaves, while w0 and w2 wait on it in step 5's collectives. gloo cannot abort
    them; w1 cutting its old world's connections makes their receives fail at once instead of at
    the collective timeout (60 s here)."""
    timeout = 60.0
    job, new_port = start_three(jobs, ds_env, tmp_path, timeout, 1, ("--fail-at-step", "5"))
    failed = job.wait_marker("w1", "failed")
    for r in range(3):
        job.reform(f"w{r}", rank=r, world=3, port=new_port, round=1)
    results = job.wait([f"w{r}" for r in range(3)])
    print_timings("w1 left a broken world", failed["time"], results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        (t,) = res["reforms"]
        assert t["cause"] == "collective_error", (name, t)
        assert t["error_seen_at"] - failed["time"] < timeout / 4, (name, t)  # not the collective timeout
        assert res["step"] == STEPS


def _arrive_as(port: int, round: int, rank: int, world: int, after: int, timeout: float = 90) -> None:
    """Play a rank that arrives in ``round``'s roster once ``after`` others have, then never
    joins gloo's rendezvous (it dies, hangs or loses its link in between)."""
    import datetime

    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:
        try:
            store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10),
                                  wait_for_workers=False)
            break
        except RuntimeError:
            assert time.monotonic() < deadline, f"nobody hosts round {round}'s store on port {port}"
            time.sleep(0.05)
    roster = dist.PrefixStore(f"round-{round}/", store)  # as join_world names the round's keys
    while roster.add("count", 0) < after:
        assert time.monotonic() < deadline, f"round {round}: {roster.add('count', 0)} of {after} arrived"
        time.sleep(0.05)
    roster.compare_set(f"arrived/{rank}", "", b"test")
    if roster.add("count", 1) >= world:
        roster.set("full", b"1")


@pytest.mark.parametrize("same_port", [True, False], ids=["same-port", "new-port"])
def test_a_join_stuck_in_gloo_rendezvous_is_broken_when_a_newer_round_supersedes_it(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness], same_port: bool) -> None:
    """Round 1's roster fills (w0, w1 and a third rank played by the test), so w0 and w1 enter
    ``init_process_group``, which cannot be interrupted; the third never gets there. Round 2
    (w0 and w1 alone) supersedes it: the join is broken at once, not at the 60 s collective
    timeout, and rank 0's store lives on for round 2 when that is on the same port."""
    timeout = 60.0
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    port, port1 = free_port(), free_port()
    port2 = port1 if same_port else free_port()
    extra = ("--collective-timeout", str(timeout), "--dist-timeout", str(timeout), "--reform-at-step", "4")
    for r in range(2):
        spec = {"rank": r, "world_size": 3, "master_addr": "127.0.0.1", "master_port": port1, "round": 1}
        job.start(f"w{r}", rank=r, world=2, port=port, extra=(*extra, "--reform-spec", json.dumps(spec)))
    _arrive_as(port1, round=1, rank=2, world=3, after=2)
    time.sleep(0.5)  # both are inside gloo's rendezvous now (they left the roster wait when it filled)
    superseded_at = time.time()
    for r in range(2):
        job.reform(f"w{r}", rank=r, world=2, port=port2, round=2)
    results = job.wait(["w0", "w1"])
    print_timings("join superseded", superseded_at, results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        assert res["step"] == STEPS
        last = res["reforms"][-1]
        assert (last["round"], last["world_size"]) == (2, 2), (name, res["reforms"])
        assert last["first_step_at"] - superseded_at < timeout / 4, (name, last)  # not the collective timeout
        assert "its join has not finished: breaking it" in (job.root / f"{name}.log").read_text(), name


def test_a_world_superseded_while_it_builds_its_engine_is_left_for_the_newer_round(
        ds_env: dict[str, str], tmp_path: Path, jobs: list[Harness]) -> None:
    """Round 1's join finishes (w0, w1 and a third rank), then the third hangs before DeepSpeed
    makes its groups, so w0 and w1 wait in ``new_group`` while they build the engine, past the
    join and its breaker. Round 2 (w0 and w1 alone) supersedes round 1: the engine build is broken
    at once and both train in round 2, not after the 60 s collective timeout (the agent would
    have killed them first, for not beginning their re-form into round 2)."""
    timeout = 60.0
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    port, port1, port2 = free_port(), free_port(), free_port()
    extra = ("--collective-timeout", str(timeout), "--dist-timeout", str(timeout), "--reform-at-step", "4")
    for r in range(2):
        spec = {"rank": r, "world_size": 3, "master_addr": "127.0.0.1", "master_port": port1, "round": 1}
        job.start(f"w{r}", rank=r, world=2, port=port, extra=(*extra, "--reform-spec", json.dumps(spec)))
    child = str(Path(__file__).with_name("joined_then_hung_child.py"))
    third = subprocess.Popen([sys.executable, child, "--rank", "2", "--world", "3", "--port", str(port1),
                              "--round", "1"], env=ds_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert third.stdout is not None
        lines = []
        for line in third.stdout:  # ends with the process: a join that failed says why
            lines.append(line)
            if line.strip() == "joined":
                break
        assert lines and lines[-1].strip() == "joined", "".join(lines)[-3000:]
        time.sleep(1.0)  # w0 and w1 are building round 1's engine now, held in new_group by the third
        superseded_at = time.time()
        for r in range(2):
            job.reform(f"w{r}", rank=r, world=2, port=port2, round=2)
        results = job.wait(["w0", "w1"])
    finally:
        third.kill()
        third.wait()
    print_timings("engine build superseded", superseded_at, results)
    for name, res in results.items():
        assert "error" not in res, (name, res["error"], job.logs())
        assert res["step"] == STEPS
        last = res["reforms"][-1]
        assert (last["round"], last["world_size"]) == (2, 2), (name, res["reforms"])
        assert last["first_step_at"] - superseded_at < timeout / 4, (name, last)  # not the collective timeout
        assert "superseded while it formed" in (job.root / f"{name}.log").read_text(), name


def test_a_process_whose_join_failed_forms_the_next_world_with_a_fresh_peer(ds_env: dict[str, str]) -> None:
    """``init_process_group`` counts its group before it can fail: after a broken join the process
    would name its next world's default group "1" and a fresh peer "0", and their rendezvous keys
    would never meet (both wait out the collective timeout)."""
    child = str(Path(__file__).with_name("failed_init_child.py"))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, child, "--rank", str(r), "--port", str(port)]
                              + (["--fail-first"] if r == 0 else []),
                              env=ds_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert "first init failed" in outs[0], outs[0][-2000:]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and "joined 2" in out, (r, out[-3000:])


def test_a_rank_that_cannot_reform_raises_reform_failed(ds_env: dict[str, str], tmp_path: Path,
                                                        jobs: list[Harness]) -> None:
    job = Harness(tmp_path, ds_env)
    jobs.append(job)
    port = free_port()
    job.start("w0", rank=0, world=3, port=port, extra=("--reform-wait", "2"))
    job.start("w1", rank=1, world=3, port=port, extra=("--dist-timeout", "2"))
    job.start("w2", rank=2, world=3, port=port, extra=("--kill-at-step", "4"))
    job.wait_marker("w2", "killed")
    # w0 gets no Reform at all; w1 is told to join a world whose host never comes.
    job.reform("w1", rank=1, world=2, port=free_port(), round=1)
    results = job.wait(["w0", "w1"], timeout=60)
    assert job.procs["w0"].returncode == 1 and job.procs["w1"].returncode == 1
    assert results["w0"]["error"]["type"] == "ReformFailed"
    assert "no Reform arrived within 2s" in results["w0"]["error"]["message"]
    assert results["w1"]["error"]["type"] == "ReformFailed"
    assert "cannot re-form into round 1" in results["w1"]["error"]["message"]


def test_the_committed_snapshot_survives_the_next_save_until_that_one_commits(tmp_path: Path) -> None:
    """The host copy a re-form restores from is the last *committed* save, never a newer one
    being written (two host buffers alternate)."""
    from stalwart.ckpt import Checkpointer, SaveConfig, Shard, SingleCoordinator

    ck = Checkpointer(str(tmp_path), SaveConfig(keep_committed=True, retention=None), coordinator=SingleCoordinator())
    x = torch.arange(10, dtype=torch.float32)
    assert ck.committed_snapshot() is None
    ck.save(1, {"x": Shard.flat(x[:6], (6,), 0)})
    ck.wait()
    snap = ck.committed_snapshot()
    assert snap is not None and snap.step == 1
    region, data = snap.tensors["x"]
    assert region.flat == (0, 6) and torch.equal(data, x[:6])
    ck.save(2, {"x": Shard.flat(x[:6] + 100, (6,), 0)})  # written into the other buffer
    assert torch.equal(snap.tensors["x"][1], x[:6])
    ck.wait()
    assert ck.committed_snapshot().step == 2 and torch.equal(ck.committed_snapshot().tensors["x"][1], x[:6] + 100)
    ck.save(3, {"x": Shard.flat(x[:6] + 200, (6,), 0)})  # reuses step 1's buffer, not step 2's
    ck.wait()
    assert torch.equal(ck.committed_snapshot().tensors["x"][1], x[:6] + 200)
    ck.close()
