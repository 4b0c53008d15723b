"""`stalwart agent` as a real process: config errors, systemd notifications, an agent that crashes
or restarts (its workers train on and its successor adopts them)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil

from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from testkit import wait_for

STALWART = str(Path(sys.executable).with_name("stalwart"))
WORKER = str(Path(__file__).with_name("worker_script.py"))
SPARE_WORKER = str(Path(__file__).with_name("reform_worker.py"))


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


def _node(client: EtcdClient, keys: JobKeys) -> records_pb2.NodeRecord | None:
    kv = client.get(keys.node("proc0"))
    return records_pb2.NodeRecord.FromString(kv.value) if kv is not None else None


def _status(address: str) -> agent_pb2.NodeStatus:
    with grpc.insecure_channel(address) as channel:
        return agent_pb2_grpc.AgentStub(channel).GetStatus(agent_pb2.StatusRequest(), timeout=5)


def _adopted(client: EtcdClient, keys: JobKeys, pids: set[int], above: int) -> bool:
    """The agent registered now serves ``pids`` as its running workers, each past step ``above``."""
    node = _node(client, keys)
    if node is None:
        return False
    try:
        status = _status(node.address)
    except grpc.RpcError:
        return False
    running = {w.pid: w.last_step for w in status.workers if w.state == agent_pb2.WORKER_RUNNING}
    return bool(running) and set(running) == pids and min(running.values()) > above  # none yet: not yet


def _await_ready(sock: socket.socket) -> None:
    """Read notifications (watchdog pings of the agent before may still be queued) until READY=1."""
    while not sock.recv(4096).decode().startswith("READY=1"):
        pass


def test_ready_and_watchdog_then_a_crashed_or_restarted_agents_workers_train_on_and_are_adopted(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_client: EtcdClient) -> None:
    job = f"proc-{os.getpid()}-{time.monotonic_ns()}"
    keys = JobKeys(job)
    # A lease long enough for a successor to start within it even on a loaded machine.
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, job, tmp_path / "state", extra="lease_ttl = 60")
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    sock.settimeout(30)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="400000")
    err = open(tmp_path / "agent.err", "ab")
    start = lambda: subprocess.Popen([STALWART, "agent", "--config", str(cfg)], env=env,  # noqa: E731
                                     stdout=subprocess.DEVNULL, stderr=err)
    agent = start()
    workers: list[psutil.Process] = []
    try:
        messages = [sock.recv(4096).decode()]
        assert messages[0].startswith("READY=1"), messages
        messages.append(sock.recv(4096).decode())
        assert messages[1] == "WATCHDOG=1"

        node = _node(etcd_client, keys)
        assert node is not None
        record = records_pb2.RoundRecord(number=1, world_size=2, master_addr="127.0.0.1", master_port=1)
        record.members.add(node_id="proc0", node_rank=0, first_rank=0, local_world_size=2, address=node.address)
        etcd_client.put(keys.round, record.SerializeToString())
        deadline = time.monotonic() + 30
        while len(psutil.Process(agent.pid).children()) < 2:
            assert time.monotonic() < deadline, (tmp_path / "agent.err").read_text()
            time.sleep(0.05)
        workers = psutil.Process(agent.pid).children()
        pids = {w.pid for w in workers}
        wait_for(lambda: _adopted(etcd_client, keys, pids, 2), 30, "both workers stepping")

        # A crash: the workers train on; the next agent adopts them (same processes, same round).
        step = max(w.last_step for w in _status(node.address).workers)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        time.sleep(0.5)
        assert all(w.is_running() for w in workers), "workers died with their agent"
        agent = start()
        _await_ready(sock)
        wait_for(lambda: _adopted(etcd_client, keys, pids, step), 30, "the successor serving the workers",
                 tmp_path)
        lease = etcd_client.get(keys.node("proc0"))
        assert lease is not None
        kept_address = records_pb2.NodeRecord.FromString(lease.value).address

        # A restart the systemd way (RestartKillSignal=SIGUSR1): the lease stays, and so do the workers.
        step = max(w.last_step for w in _status(kept_address).workers)
        agent.send_signal(signal.SIGUSR1)
        assert agent.wait(timeout=30) == 0
        assert all(w.is_running() for w in workers)
        kept = etcd_client.get(keys.node("proc0"))
        assert kept is not None and kept.lease == lease.lease, "the hand-off gave up the node's lease"
        agent = start()
        _await_ready(sock)
        wait_for(lambda: _adopted(etcd_client, keys, pids, step), 30, "the successor serving the workers",
                 tmp_path)
        again = etcd_client.get(keys.node("proc0"))
        assert again is not None and again.lease == lease.lease, "the successor did not carry on the lease"

        # A stop (SIGTERM) is a leave: the agent stops its workers.
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, "a stopped agent left its workers running"
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        for w in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()
        sock.close()
        err.close()


def test_a_loop_stuck_in_a_hung_gpu_call_stops_the_watchdog_and_the_restarted_agent_adopts_the_workers(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_client: EtcdClient) -> None:
    """The GPU probe's polls hang (a hung driver call) in the monitor loop. The rest of the agent
    goes on (it answers GetStatus: the probe is never read under the agent's lock), but the
    watchdog pings stop, so the supervisor (systemd; this test stands in for it: no ping within
    WatchdogSec means kill and start again) restarts the agent, and the successor adopts the
    workers, which trained on."""
    job = f"watchdog-{os.getpid()}-{time.monotonic_ns()}"
    keys = JobKeys(job)
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, job, tmp_path / "state", extra="lease_ttl = 60")
    cfg.write_text("fault_injection = true\n" + cfg.read_text())
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    watchdog_sec = 1.0
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC=str(int(watchdog_sec * 1e6)))
    err = open(tmp_path / "agent.err", "ab")
    start = lambda: subprocess.Popen([STALWART, "agent", "--config", str(cfg)], env=env,  # noqa: E731
                                     stdout=subprocess.DEVNULL, stderr=err)
    agent = start()
    workers: list[psutil.Process] = []
    try:
        sock.settimeout(30)
        _await_ready(sock)
        node = _node(etcd_client, keys)
        assert node is not None
        record = records_pb2.RoundRecord(number=1, world_size=2, master_addr="127.0.0.1", master_port=1)
        record.members.add(node_id="proc0", node_rank=0, first_rank=0, local_world_size=2, address=node.address)
        etcd_client.put(keys.round, record.SerializeToString())
        wait_for(lambda: len(psutil.Process(agent.pid).children()) >= 2, 30, "two workers started", tmp_path)
        workers = psutil.Process(agent.pid).children()
        pids = {w.pid for w in workers}
        wait_for(lambda: _adopted(etcd_client, keys, pids, 2), 30, "both workers stepping")
        assert sock.recv(4096).decode() == "WATCHDOG=1"  # pinging while healthy

        with grpc.insecure_channel(node.address) as channel:
            reply = agent_pb2_grpc.AgentStub(channel).InjectFault(
                agent_pb2.FaultRequest(kind=agent_pb2.FAULT_GPU_HANG), timeout=5)
        assert reply.applied, reply.detail
        assert _status(node.address).workers  # the agent's other work goes on

        # The stand-in supervisor: pings already queued drain; then none comes within WatchdogSec.
        deadline = time.monotonic() + 30
        sock.settimeout(watchdog_sec)
        while True:
            assert time.monotonic() < deadline, "the watchdog kept pinging with a loop stuck in the probe"
            try:
                sock.recv(4096)
            except TimeoutError:
                break
        step = max(w.last_step for w in _status(node.address).workers)
        agent.send_signal(signal.SIGKILL)  # what systemd does once WatchdogSec passes without a ping
        agent.wait()
        assert all(w.is_running() for w in workers), "workers died with their agent"
        agent = start()
        sock.settimeout(30)
        _await_ready(sock)
        wait_for(lambda: _adopted(etcd_client, keys, pids, step), 30, "the successor serving the workers",
                 tmp_path)
        assert sock.recv(4096).decode() == "WATCHDOG=1"  # a healthy successor pings
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        for w in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.kill()
        sock.close()
        err.close()


def test_a_warm_spare_outlives_a_crashed_agent_and_the_successor_adopts_it(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_client: EtcdClient) -> None:
    """A spare lost with its agent would make the node's next round wait for a cold start (the
    demo saw 4 s of the world waiting): it trains on like a worker and the next agent takes it."""
    job = f"spare-{os.getpid()}-{time.monotonic_ns()}"
    keys = JobKeys(job)
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, job, tmp_path / "state", extra="lease_ttl = 60")
    text = cfg.read_text().replace(WORKER, SPARE_WORKER).replace("workers = 2", "workers = 1\nspares = 1")
    cfg.write_text(text)
    err = open(tmp_path / "agent.err", "ab")
    env = dict(os.environ, EVENTS=str(tmp_path / "events"))
    start = lambda: subprocess.Popen([STALWART, "--log-level", "info", "agent", "--config", str(cfg)],  # noqa: E731
                                     env=env, stdout=subprocess.DEVNULL, stderr=err)
    agent = start()
    spare: psutil.Process | None = None
    try:
        wait_for(lambda: _node(etcd_client, keys) is not None, 30, "the agent registered", tmp_path)
        address = _node(etcd_client, keys).address  # type: ignore[union-attr]
        record = records_pb2.RoundRecord(number=1, world_size=1, master_addr="127.0.0.1", master_port=1)
        record.members.add(node_id="proc0", node_rank=0, first_rank=0, local_world_size=1, address=address)
        etcd_client.put(keys.round, record.SerializeToString())  # spares start once the worker steps
        wait_for(lambda: any(s.ready for s in _status(address).spares), 60, "a warm spare", tmp_path)
        (pid,) = [s.pid for s in _status(address).spares]
        spare = psutil.Process(pid)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        time.sleep(0.5)
        assert spare.is_running(), "the spare died with its agent"
        agent = start()

        def adopted() -> bool:
            node = _node(etcd_client, keys)
            try:
                return node is not None and [(s.pid, s.ready) for s in _status(node.address).spares] == [(pid, True)]
            except grpc.RpcError:
                return False

        wait_for(adopted, 30, "the successor holding the same spare, connected again", tmp_path)
        assert "adopted 1 of 1 spare(s)" in (tmp_path / "agent.err").read_text()
        agent.send_signal(signal.SIGTERM)  # a stop: the spare goes with it
        assert agent.wait(timeout=30) == 0
        _, alive = psutil.wait_procs([spare], timeout=15)
        assert not alive, "a stopped agent left its spare running"
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        if spare is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                spare.kill()
        err.close()


def test_a_round_that_came_while_the_agent_was_away_keeps_the_adopted_worker(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_client: EtcdClient) -> None:
    """The agent crashes and the job moves to round 2 (same members) before its successor is up.
    The successor reads round 2 right after it registers, while the adopted worker is still
    reconnecting: it waits for it and re-forms it in place, rather than stopping a worker that
    trained on all along as "not connected to the agent" (the demo's node then left the world)."""
    job = f"away-{os.getpid()}-{time.monotonic_ns()}"
    keys = JobKeys(job)
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, job, tmp_path / "state", extra="lease_ttl = 60")
    cfg.write_text(cfg.read_text().replace(WORKER, SPARE_WORKER).replace("workers = 2", "workers = 1"))
    err = open(tmp_path / "agent.err", "ab")
    events = tmp_path / "events"
    env = dict(os.environ, EVENTS=str(events))
    start = lambda: subprocess.Popen([STALWART, "--log-level", "info", "agent", "--config", str(cfg)],  # noqa: E731
                                     env=env, stdout=subprocess.DEVNULL, stderr=err)
    agent = start()
    worker: psutil.Process | None = None
    try:
        wait_for(lambda: _node(etcd_client, keys) is not None, 30, "the agent registered", tmp_path)
        address = _node(etcd_client, keys).address  # type: ignore[union-attr]

        def round_(number: int) -> bytes:
            record = records_pb2.RoundRecord(number=number, world_size=1, master_addr="127.0.0.1", master_port=1)
            record.members.add(node_id="proc0", node_rank=0, first_rank=0, local_world_size=1, address=address)
            return record.SerializeToString()

        etcd_client.put(keys.round, round_(1))
        wait_for(lambda: _adopted(etcd_client, keys, {w.pid for w in psutil.Process(agent.pid).children()}, 2), 60,
                 "the worker stepping", tmp_path)
        (worker,) = psutil.Process(agent.pid).children()
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        etcd_client.put(keys.round, round_(2))
        time.sleep(2.0)  # the worker's reconnect attempts back off meanwhile
        assert worker.is_running(), "the worker died with its agent"
        agent = start()
        wait_for(lambda: f"reform {worker.pid} 0 1 2 0" in events.read_text(), 60,
                 "the adopted worker re-formed into round 2", tmp_path)
        assert worker.is_running()
        log = (tmp_path / "agent.err").read_text()
        assert "not connected to the agent" not in log, log[-3000:]
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        if worker is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        err.close()


def _start_failure(cfg: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([STALWART, "agent", "--config", str(cfg), *flags], capture_output=True, text=True,
                         timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def _errors(out: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr without the start-up warnings (insecure = true): the error lines."""
    return [line for line in out.stderr.strip().splitlines() if " W stalwart." not in line]


def _listening(reuse_port: bool = False) -> socket.socket:
    sock = socket.socket()
    if reuse_port:  # as a gRPC server holds its port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_in_use_is_one_line_with_exit_2(tmp_path: Path, etcd_server: LocalEtcd) -> None:
    with _listening(reuse_port=True) as held:
        port = held.getsockname()[1]
        cfg = _write_config(tmp_path / "agent.toml", etcd_server, "ports", tmp_path / "s",
                            f'listen = "127.0.0.1:{port}"')
        out = _start_failure(cfg)
        assert out.returncode == 2, out.stderr
        assert _errors(out) == [f"stalwart agent: listen: cannot bind 127.0.0.1:{port}: Address already in use"]
        cfg = _write_config(tmp_path / "agent.toml", etcd_server, "ports", tmp_path / "s", f"metrics_port = {port}")
        out = _start_failure(cfg)
        assert out.returncode == 2, out.stderr
        assert _errors(out) == [f"stalwart agent: metrics_port: cannot bind 127.0.0.1:{port}: Address already in use"]


def test_a_certificate_that_is_not_pem_is_reported_as_such(tmp_path: Path, etcd_server: LocalEtcd,
                                                          tls_dir: Path) -> None:
    der = tmp_path / "agent.der"
    subprocess.run(["openssl", "x509", "-in", str(tls_dir / "server.crt"), "-outform", "DER", "-out", str(der)],
                   check=True, capture_output=True)
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, "pem", tmp_path / "s", "insecure = false")
    cfg.write_text(cfg.read_text() + f'[tls]\ncert_file = "{der}"\nkey_file = "{tls_dir / "server.key"}"\n'
                                     f'ca_file = "{tls_dir / "ca.crt"}"\n')
    out = _start_failure(cfg)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"tls.cert_file {der}: not a PEM file" in lines[0], out.stderr


def test_the_socket_directory_is_created_private_and_an_existing_one_never_changed(
        tmp_path: Path, etcd_server: LocalEtcd) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    cfg = _write_config(tmp_path / "agent.toml", etcd_server, "sock", tmp_path / "s",
                        f'progress_socket = "{shared / "agent.sock"}"')
    out = _start_failure(cfg)
    assert out.returncode == 2, out.stderr
    assert "progress_socket: directory" in out.stderr and "open to other users" in out.stderr, out.stderr
    assert shared.stat().st_mode & 0o777 == 0o755, "the agent changed the mode of an existing directory"

    from stalwart.agent.service import private_socket_dir

    fresh = tmp_path / "fresh" / "run"
    private_socket_dir(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    private_socket_dir(fresh)  # ours, private: accepted as it is


def test_an_unreachable_etcd_is_waited_for_and_ready_comes_after(tmp_path: Path) -> None:
    late = LocalEtcd(tmp_path / "late-etcd", 1)  # its ports are chosen; it is not running yet
    cfg = _write_config(tmp_path / "agent.toml", late, "late", tmp_path / "s")
    notify_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    err = tmp_path / "agent.err"
    agent = subprocess.Popen([STALWART, "agent", "--config", str(cfg)], env=dict(os.environ, NOTIFY_SOCKET=notify_path),
                             stdout=subprocess.DEVNULL, stderr=open(err, "wb"))
    try:
        deadline = time.monotonic() + 60
        while "etcd does not answer" not in err.read_text():
            assert agent.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        sock.setblocking(False)
        try:
            early = sock.recv(4096)
        except BlockingIOError:
            early = b""
        assert not early, f"systemd was told {early!r} before etcd answered"
        late.start()
        sock.setblocking(True)
        sock.settimeout(60)
        _await_ready(sock)
        warnings = [line for line in err.read_text().splitlines() if "etcd does not answer" in line]
        assert warnings and all("retrying" in line for line in warnings)
        assert "Traceback" not in err.read_text()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()
        sock.close()
        late.stop()
