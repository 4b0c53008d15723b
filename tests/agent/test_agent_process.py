"""`stalwart agent` as a real process: config errors, systemd notifications, death of the agent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.coord.watch import EventType, Watch, wait_for
from stalwart.proto import records_pb2

STALWART = str(Path(sys.executable).with_name("stalwart"))
WORKER = str(Path(__file__).with_name("worker_script.py"))


def _write_config(path: Path, etcd: LocalEtcd, job: str, state: Path, extra: str = "") -> Path:
    path.write_text(f"""
job = "{job}"
node_id = "proc0"
command = ["{sys.executable}", "{WORKER}"]
workers = 2
listen = "127.0.0.1:0"
insecure = true
state_dir = "{state}"
lease_ttl = 2
probe = "fake"
[etcd]
endpoints = {list(etcd.endpoints)!r}
""".replace("'", '"'))
    if extra:  # the extra line replaces a setting of the same name
        name = extra.split("=")[0].strip()
        lines = [line for line in path.read_text().splitlines() if line.split("=")[0].strip() != name]
        path.write_text("\n".join([extra, *lines]) + "\n")
    return path


def test_malformed_config_is_one_clear_line(tmp_path: Path, etcd_server: LocalEtcd) -> None:
    cases = {
        "workers = 0": "workers",
        "lease_ttl = 1": "lease_ttl",
        "probe = \"magic\"": "probe",
        "colour = \"blue\"": "colour",
    }
    for extra, setting in cases.items():
        cfg = _write_config(tmp_path / "agent.toml", etcd_server, "bad", tmp_path / "s", extra)
        out = subprocess.run([STALWART, "agent", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and setting in lines[0], out.stderr
    (tmp_path / "broken.toml").write_text("job = [unclosed")
    out = subprocess.run([STALWART, "agent", "--config", str(tmp_path / "broken.toml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_notify_socket_gets_ready_and_watchdog_then_agent_death_cleans_up(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_client: EtcdClient) -> None:
    job = f"proc-{os.getpid()}-{time.monotonic_ns()}"
    keys = JobKeys(job)
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, job, tmp_path / "state")
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="400000")
    agent = subprocess.Popen([STALWART, "agent", "--config", str(cfg)], env=env, stdout=subprocess.DEVNULL,
                             stderr=open(tmp_path / "agent.err", "wb"))
    try:
        messages = [sock.recv(4096).decode()]
        assert messages[0].startswith("READY=1"), messages
        messages.append(sock.recv(4096).decode())
        assert messages[1] == "WATCHDOG=1"

        node = etcd_client.get(keys.node("proc0"))
        assert node is not None
        address = records_pb2.NodeRecord.FromString(node.value).address
        record = records_pb2.RoundRecord(number=1, world_size=2, master_addr="127.0.0.1", master_port=1)
        record.members.add(node_id="proc0", node_rank=0, first_rank=0, local_world_size=2, address=address)
        etcd_client.put(keys.round, record.SerializeToString())
        deadline = time.monotonic() + 30
        while len(psutil.Process(agent.pid).children()) < 2:
            assert time.monotonic() < deadline, (tmp_path / "agent.err").read_text()
            time.sleep(0.05)
        workers = psutil.Process(agent.pid).children()

        with Watch(etcd_client, keys.node("proc0"), node.mod_revision + 1) as watch:
            assert watch.wait_ready(5)
            agent.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            gone = wait_for(watch, lambda e: e.type is EventType.DELETE, 5)
            assert gone is not None and time.monotonic() - killed <= 2 + 1
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, "workers outlived their agent"
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        sock.close()
