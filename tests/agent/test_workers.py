"""Worker supervision with real processes and signals."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from stalwart.agent.workers import ExitKind, RoundAssignment, WorkerExit, WorkerGroup, classify
from stalwart.proto.contract import EXIT_STUCK
from testkit import process_gone, python_child, wait_for

ASSIGN = RoundAssignment(round=7, group_rank=1, first_rank=2, local_world_size=2, world_size=6,
                         master_addr="127.0.0.1", master_port=29999, restore_step=40, restart_count=3)

PRINT_ENV = [sys.executable, "-c", "import os, json, time; print(json.dumps({k: v for k, v in os.environ.items() "
             "if k.isupper()})); time.sleep(float(os.environ.get('SLEEP', '0')))"]


def _group(tmp_path: Path, command: list[str], **kw: object) -> tuple[WorkerGroup, queue.Queue[WorkerExit]]:
    exits: queue.Queue[WorkerExit] = queue.Queue()
    return WorkerGroup(command, ASSIGN, tmp_path, exits.put, **kw), exits  # type: ignore[arg-type]


def test_workers_get_torchruns_environment_and_a_log_per_round(tmp_path: Path) -> None:
    import json

    group, exits = _group(tmp_path, PRINT_ENV)
    got = sorted([exits.get(timeout=30) for _ in range(2)], key=lambda e: e.rank)
    assert [e.kind for e in got] == [ExitKind.SUCCESS, ExitKind.SUCCESS]
    for local_rank, worker in enumerate(group.workers):
        env = json.loads(worker.log_path.read_text().splitlines()[0])
        assert worker.log_path.parent.name == "round-000007"
        assert env["RANK"] == str(2 + local_rank) and env["LOCAL_RANK"] == str(local_rank)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("6", "2", "1")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29999")
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["STALWART_ROUND"], env["STALWART_RESTORE_STEP"]) == \
            ("3", "7", "40")


def test_sigkilled_worker_is_reported_within_half_a_second(tmp_path: Path) -> None:
    group, exits = _group(tmp_path, PRINT_ENV, extra_env={"SLEEP": "60"})
    try:
        time.sleep(0.5)
        killed = time.time()
        os.kill(group.workers[1].pid, signal.SIGKILL)
        exit_ = exits.get(timeout=5)
        assert exit_.rank == 3 and exit_.kind is ExitKind.SIGNAL and "SIGKILL" in exit_.reason
        assert exit_.at - killed < 0.5
    finally:
        group.stop(grace=1)


@pytest.mark.parametrize("code,kind", [(0, ExitKind.SUCCESS), (4, ExitKind.USER_ERROR), (3, ExitKind.GAVE_UP)])
def test_exit_codes_are_classified(tmp_path: Path, code: int, kind: ExitKind) -> None:
    group, exits = _group(tmp_path, [sys.executable, "-c", f"raise SystemExit({code})"])
    assert {exits.get(timeout=30).kind for _ in range(2)} == {kind}


def test_a_worker_stuck_past_its_worlds_abort_is_named_and_not_a_fault_of_the_node() -> None:
    kind, reason = classify(EXIT_STUCK, stopping=False, oom_before=0)
    assert kind is ExitKind.USER_ERROR and "hung peer" in reason and str(EXIT_STUCK) in reason


def test_stop_reaches_the_whole_tree_and_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = [sys.executable, "-c",
                "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); "
                "time.sleep(60)"]
    group, _ = _group(tmp_path, stubborn)
    deadline = time.monotonic() + 20
    while not all(w.log_path.exists() and "up" in w.log_path.read_text() for w in group.workers):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tree = [p for w in group.workers for p in [psutil.Process(w.pid), *psutil.Process(w.pid).children(True)]]
    assert len(tree) == 4
    start = time.monotonic()
    exits = group.stop(grace=0.5)
    assert time.monotonic() - start < 5
    assert {e.kind for e in exits} == {ExitKind.STOPPED}
    gone, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive


def test_workers_and_spares_outlive_the_agent(tmp_path: Path) -> None:
    """The agent SIGKILLed: its workers, a spare that was given a rank and a warm spare live on for
    its successor to adopt (a spare gone with its agent would leave the node's next round to a cold
    start; an agent gone for good orphans them, and they stop after ``STALWART_ORPHAN_TIMEOUT``)."""
    flag = tmp_path / "ranked"
    ranked = ("import time; from stalwart.trainer.agent_client import _outlive_agent; _outlive_agent(); "
              f"open({str(flag)!r}, 'w').close(); time.sleep(120)")
    agent = python_child(f"""
import sys, time
from pathlib import Path
from stalwart.agent.workers import RoundAssignment, WorkerGroup, start_spare
a = RoundAssignment(round=1, group_rank=0, first_rank=0, local_world_size=2, world_size=2,
                    master_addr="127.0.0.1", master_port=1)
g = WorkerGroup([sys.executable, "-c", "import time; time.sleep(120)"], a, Path({str(tmp_path)!r}), print)
spare = start_spare([sys.executable, "-c", "import time; time.sleep(120)"], Path({str(tmp_path)!r}), print)
# a spare that was given a rank clears its parent-death signal (AgentClient does it on assignment)
ranked = start_spare([sys.executable, "-c", {ranked!r}], Path({str(tmp_path)!r}), print)
print(" ".join(str(w.pid) for w in [*g.workers, ranked, spare]), flush=True)
time.sleep(120)
""")
    workers: list[int] = []
    try:
        assert agent.stdout is not None
        *workers, spare = [int(p) for p in agent.stdout.readline().split()]
        assert len(workers) == 3 and all(psutil.pid_exists(p) for p in [*workers, spare])
        wait_for(flag.exists, 60, "the ranked spare cleared its parent-death signal")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        time.sleep(1.0)  # a parent-death signal would have ended them by now
        assert not any(process_gone(p) for p in [*workers, spare]), "workers or the spare died with the agent"
    finally:
        for pid in [*workers, *([spare] if "spare" in locals() else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()


@pytest.mark.skipif(not __import__("stalwart.agent.priority", fromlist=["x"]).can_restore_priority(),
                    reason="giving a priority back needs root or RLIMIT_NICE >= 20")
def test_a_spare_warms_niced_and_taking_it_gives_every_thread_and_child_the_workers_priority_back(
        tmp_path: Path) -> None:
    """A spare niced while it warms (it starts with the round's workers, taking only the CPU they
    leave) must not stay niced as a rank: the world would wait on it every step. Its threads and
    children (a compiler DeepSpeed runs, say) are niced and given it back too."""
    from stalwart.agent.spares import SparePool
    from stalwart.agent.workers import start_spare

    ready = tmp_path / "ready"
    code = ("import subprocess, sys, threading, time; "
            "threading.Thread(target=time.sleep, args=(120,), daemon=True).start(); "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(ready)!r}, 'w').write(str(child.pid)); time.sleep(120)")
    pool = SparePool(1, lambda: start_spare([sys.executable, "-c", code], tmp_path, print, nice=10))
    (spare,) = pool.maintain()
    try:
        wait_for(lambda: ready.exists() and ready.read_text() != "", 60, "the spare's thread and child")
        proc = psutil.Process(spare.pid)
        family = [proc, psutil.Process(int(ready.read_text()))]
        tids = lambda: [(p.pid, t.id) for p in family for t in p.threads()]  # noqa: E731
        assert len(tids()) >= 3
        assert {os.getpriority(os.PRIO_PROCESS, tid) for _, tid in tids()} == {10}
        autogroup = Path(f"/proc/{spare.pid}/autogroup")  # its session's share (see _set_autogroup_nice)
        assert not autogroup.exists() or autogroup.read_text().split()[-1] == "10", autogroup.read_text()
        pool.ready(spare.pid)
        pool.warm(spare.pid)
        taken = pool.take()
        assert taken is spare
        assert {os.getpriority(os.PRIO_PROCESS, tid) for _, tid in tids()} == {0}
        assert not autogroup.exists() or autogroup.read_text().split()[-1] == "0", autogroup.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(spare.pid, signal.SIGKILL)
