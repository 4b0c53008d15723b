"""Workers forked from a preload process: real processes, real signals, a real agent and etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_agent_node import _config

from stalwart.agent.adopt import AgentState, WorkerEntry, process_start_time, save_state, state_path
from stalwart.agent.config import AgentConfig, AgentConfigError
from stalwart.agent.node import NodeAgent
from stalwart.agent.preload import Preloader, Target, parse_command
from stalwart.agent.priority import can_restore_priority
from stalwart.agent.workers import ExitKind, RoundAssignment, WorkerExit, WorkerGroup
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.proto import agent_pb2, records_pb2
from testkit import wait_for

CHILD = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "session": os.getsid(0) == os.getpid(), "env": os.environ.get("PRELOAD_TEST"),
                  "preloaded": "json" in sys.modules, "ppid": os.getppid(),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0)}), flush=True)
if os.environ.get("SLEEP"):
    import time
    time.sleep(60)
sys.exit(int(os.environ.get("CODE", "0")))
"""


def test_parse_command_takes_only_what_a_fork_can_run() -> None:
    assert parse_command(["python3", "-u", "train.py", "--lr", "1"]) == Target("python3", ("-u",), "train.py", None,
                                                                                ("--lr", "1"))
    assert parse_command(["/venv/bin/python", "-X", "dev", "-m", "pkg.train", "-m", "x"]) == Target(
        "/venv/bin/python", ("-X", "dev"), None, "pkg.train", ("-m", "x"))
    assert parse_command(["python", "-c", "print(1)"]) is None
    assert parse_command(["bash", "run.sh"]) is None
    assert parse_command(["python", "-u"]) is None
    assert parse_command([]) is None


def test_a_preload_needs_a_python_command_and_module_names(tmp_path: Path) -> None:
    base = dict(job="j", insecure=True, state_dir=str(tmp_path))
    with pytest.raises(AgentConfigError, match="preload: needs a command of the form"):
        AgentConfig(command=("bash", "run.sh"), preload=("torch",), **base)  # type: ignore[arg-type]
    with pytest.raises(AgentConfigError, match="'torch; rm' is not a module name"):
        AgentConfig(command=("python", "t.py"), preload=("torch; rm",), **base)  # type: ignore[arg-type]
    assert AgentConfig(command=("python", "t.py"), preload=("torch", "deepspeed"), **base).preload == (  # type: ignore[arg-type]
        "torch", "deepspeed")


@pytest.fixture
def preloader(tmp_path: Path):
    made: list[Preloader] = []

    def make(modules: tuple[str, ...] = ("json",), script: Path | None = None) -> Preloader:
        if script is None:
            script = tmp_path / "child.py"
            script.write_text(CHILD)
        target = parse_command([sys.executable, "-u", str(script), "a", "b"])
        assert target is not None
        p = Preloader(target, modules, tmp_path / f"preload-{len(made)}.log", dict(os.environ))
        p.start()
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _report(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


def test_a_forked_worker_runs_its_script_as_python_would_and_its_exit_status_is_reported(
        preloader, tmp_path: Path) -> None:
    p = preloader()
    assert p.wait_ready(60), p.error
    env = dict(os.environ, PRELOAD_TEST="yes", CODE="3")
    log = tmp_path / "w.log"
    proc = p.spawn(env, log, str(tmp_path))
    assert proc is not None
    assert proc.wait(30) == 3
    seen = _report(log)
    script = str(tmp_path / "child.py")
    assert seen == {"argv": [script, "a", "b"], "path0": str(tmp_path), "cwd": str(tmp_path), "name": "__main__",
                    "session": True, "env": "yes", "preloaded": True, "ppid": p._proc.pid,  # type: ignore[union-attr]
                    "nice": 0}
    # another script of the same interpreter, from the same preload process
    other = tmp_path / "sub" / "other.py"
    other.parent.mkdir()
    other.write_text(CHILD)
    target = parse_command([sys.executable, str(other), "c"])
    assert target is not None
    proc = p.spawn(dict(env, CODE="0"), tmp_path / "o.log", str(tmp_path), target=target)
    assert proc is not None and proc.wait(30) == 0
    seen = _report(tmp_path / "o.log")
    assert (seen["argv"], seen["path0"], seen["preloaded"]) == ([str(other), "c"], str(other.parent), True)


@pytest.mark.skipif(not can_restore_priority(), reason="needs root or RLIMIT_NICE >= 20")
def test_a_preload_process_imports_niced_and_forks_at_the_workers_priority(preloader, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """An agent restarted beside training workers lowers its new preload process's priority while
    it imports; the workers it forks must not keep it (the world would wait on them every step)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(2)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = preloader(("slow_import",))
    p.lower_priority(10)
    zygote = p._proc.pid  # type: ignore[union-attr]
    assert os.getpriority(os.PRIO_PROCESS, zygote) == 10  # still importing
    assert Path(f"/proc/{zygote}/autogroup").read_text().split()[-1] == "10"
    assert p.wait_ready(60), p.error
    assert os.getpriority(os.PRIO_PROCESS, zygote) == 0
    assert Path(f"/proc/{zygote}/autogroup").read_text().split()[-1] == "0"
    log = tmp_path / "w.log"
    proc = p.spawn(dict(os.environ), log, None)
    assert proc is not None and proc.wait(30) == 0
    assert _report(log)["nice"] == 0


@pytest.mark.skipif(not can_restore_priority(), reason="needs root or RLIMIT_NICE >= 20")
def test_an_agent_started_beside_its_predecessors_live_workers_imports_niced_from_the_start(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, monkeypatch) -> None:
    """A restarted agent's preload process imports torch beside the workers it will adopt: it
    yields to them from its first import, not only once adoption is done (a step of the whole
    world slowed while a successor started, seen in the demo)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(2)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    config = _config(etcd_server, tmp_path, "beside", preload=("slow_import",), spare_nice=10)
    fresh = NodeAgent(config, client=etcd_client)
    assert not fresh._left_live_workers()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start_time(worker.pid)
        assert start is not None
        Path(config.state_dir).mkdir(parents=True, exist_ok=True)
        save_state(state_path(config.state_dir), AgentState(
            job="beside", node_id="n0", lease_id=0, round=b"",
            workers=(WorkerEntry(0, 0, worker.pid, start, str(tmp_path / "w.log")),)))
        agent = NodeAgent(config, client=etcd_client)
        assert agent._left_live_workers()
        agent._start_preload(agent._left_live_workers())
        assert agent.preloader is not None
        try:
            zygote = agent.preloader._proc.pid  # type: ignore[union-attr]
            assert os.getpriority(os.PRIO_PROCESS, zygote) == 10  # importing, niced at once
            assert agent.preloader.wait_ready(60), agent.preloader.error
            assert os.getpriority(os.PRIO_PROCESS, zygote) == 0  # ready: its forks are workers
        finally:
            agent.preloader.close()
        worker.kill()
        worker.wait()
        assert not NodeAgent(config, client=etcd_client)._left_live_workers()  # its workers are gone
    finally:
        worker.kill()
        worker.wait()


def test_a_signalled_worker_reports_the_signal_and_one_that_outlives_the_preload_process_is_still_watched(
        preloader, tmp_path: Path) -> None:
    p = preloader()
    assert p.wait_ready(60), p.error
    env = dict(os.environ, SLEEP="1")
    killed = p.spawn(env, tmp_path / "k.log", None)
    assert killed is not None
    wait_for(lambda: (tmp_path / "k.log").exists() and (tmp_path / "k.log").read_text(), 30, "the child's line")
    os.killpg(killed.pid, signal.SIGKILL)  # its own session: the agent signals its process group
    assert killed.wait(30) == -signal.SIGKILL
    orphan = p.spawn(env, tmp_path / "o.log", None)
    assert orphan is not None
    p.close()  # the agent restarts: the preload process goes, its child trains on
    os.kill(orphan.pid, 0)
    assert p.spawn(env, tmp_path / "late.log", None) is None  # gone: the caller spawns cold
    os.kill(orphan.pid, signal.SIGTERM)
    assert orphan.wait(30) is None  # ended; its status went with its parent


def test_a_fork_answered_too_late_is_killed_and_the_preload_process_is_used_no_more(preloader,
                                                                                  tmp_path: Path) -> None:
    """The caller spawned that rank cold meanwhile: the late child would be a second copy of it."""
    p = preloader()
    assert p.wait_ready(60), p.error
    zygote = p._proc.pid  # type: ignore[union-attr]
    p.answer_timeout = 0.5
    os.kill(zygote, signal.SIGSTOP)
    try:
        assert p.spawn(dict(os.environ, SLEEP="1"), tmp_path / "late.log", None) is None
    finally:
        os.kill(zygote, signal.SIGCONT)
    assert not p.ready  # every later worker starts cold
    late = wait_for(lambda: dict(p._early), 30, "the late child's end")
    assert list(late.values()) == [-signal.SIGKILL]


@pytest.mark.parametrize("module, why", [("no_such_module_xyz", "ModuleNotFoundError"),
                                         ("threads_at_import", "the imports started threads")])
def test_a_preload_that_fails_leaves_the_workers_to_start_cold(preloader, tmp_path: Path, monkeypatch,
                                                               module: str, why: str) -> None:
    (tmp_path / "threads_at_import.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = preloader((module,))
    assert not p.wait_ready(60)
    assert p.error is not None and why in p.error
    exits: list[WorkerExit] = []
    assignment = RoundAssignment(round=1, group_rank=0, first_rank=0, local_world_size=1, world_size=1,
                                 master_addr="127.0.0.1", master_port=1)
    group = WorkerGroup([sys.executable, "-u", str(tmp_path / "child.py")], assignment, tmp_path / "logs",
                        exits.append, extra_env={"CODE": "4"}, preloader=p)
    (worker,) = group.workers
    wait_for(lambda: exits, 30, "the cold worker's exit")
    assert exits[0].kind is ExitKind.USER_ERROR and exits[0].returncode == 4
    assert _report(worker.log_path)["ppid"] == os.getpid()  # spawned by this process, not forked


def test_an_agent_with_a_preload_forks_its_workers_and_classifies_their_exits(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, start_agent, key_prefix: str) -> None:
    job = "preload-" + key_prefix.strip("/").split("/")[-1][-30:].replace("[", "-").replace("]", "")
    keys = JobKeys(job)
    agent = start_agent(_config(etcd_server, tmp_path, job, preload=("stalwart.trainer.agent_client",)))
    assert agent.preloader is not None and agent.preloader.ready  # it registered once the imports were done
    record = records_pb2.RoundRecord(number=1, world_size=2, master_addr="127.0.0.1", master_port=29500)
    record.members.add(node_id="n0", node_rank=0, first_rank=0, local_world_size=2, address=agent.address)
    etcd_client.put(keys.round, record.SerializeToString())

    def stepping() -> list[int]:
        return [w.pid for w in agent.status().workers if w.state == agent_pb2.WORKER_RUNNING and w.last_step > 2]

    pids = wait_for(lambda: len(stepping()) == 2 and stepping(), 60, "two forked workers stepping")
    zygote = agent.preloader._proc.pid  # type: ignore[union-attr]
    assert [psutil.Process(pid).ppid() for pid in pids] == [zygote, zygote]
    os.kill(pids[1], signal.SIGKILL)

    def finding() -> str:
        kv = etcd_client.get(keys.health("n0"))
        health = records_pb2.HealthRecord.FromString(kv.value) if kv else records_pb2.HealthRecord()
        return next((f.detail for f in health.findings if f.code == "worker-signal"), "")

    # the exit status came from the preload process: a signal, named, not "exit status unknown"
    assert "killed by SIGKILL" in wait_for(finding, 30, "the killed worker in the health record")
