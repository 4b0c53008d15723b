"""A whole stalwart cluster on one machine, for chaos runs and the demo.

etcd members (``LocalEtcd``), rendezvous daemons and one agent per simulated node, each a real
process with its log under the run's directory. Agents run with the fake GPU probe and fault
injection enabled (this cluster exists to be broken), over plain TCP on private addresses only.
By default everything listens on loopback; when the scenario cuts a node's network (and the run
is root), each node's agent and workers live in their own network namespace (``netns.py``) and
etcd listens on the bridge that joins them. When it fills the checkpoint disk (root again), the
checkpoint directory is a small tmpfs. :meth:`LocalCluster.stop` tears everything down, also
after a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from stalwart.chaos.netns import NodeNetwork, unavailable_reason
from stalwart.chaos.scenario import Scenario
from stalwart.coord.client import EtcdClient, KeyValue
from stalwart.coord.errors import CoordError
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd, die_with_parent, free_port
from stalwart.proto import agent_pb2, agent_pb2_grpc, records_pb2
from stalwart.proto.contract import ENV_NODE, ENV_SOCKET

log = logging.getLogger(__name__)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and everything below it (frozen first, so nothing reacts half-way)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.suspend()
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.send_signal(sig)
            if sig != signal.SIGKILL:
                p.resume()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class LocalCluster:
    def __init__(self, scenario: Scenario, workdir: Path, job: str = "chaos") -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.job = job
        self.keys = JobKeys(job)
        self.ckpt_dir = workdir / "checkpoints"
        self.steps_log = workdir / "steps.jsonl"
        # Namespaces only when a fault needs them: they need root, and loopback is simpler to debug.
        self.net = (NodeNetwork(scenario.node_names())
                    if (scenario.uses("network-cut") or scenario.cluster.node_network) and unavailable_reason() is None
                    else None)
        self.ckpt_tmpfs = scenario.uses("fill-disk") and os.geteuid() == 0
        self.etcd = LocalEtcd(workdir / "etcd", scenario.cluster.etcd_members,
                              host=self.net.host_ip if self.net else "127.0.0.1")
        self.daemons: dict[str, Proc] = {}
        self.agents: dict[str, Proc] = {}
        self.client: EtcdClient | None = None
        self._seen: dict[str, KeyValue | None] = {}  # last value read of each key (see _get)
        self.master_port = free_port()
        self._python = sys.executable
        built = Path(__file__).resolve().parent.parent / ".venv" / "torch_extensions"  # scripts/setup.sh
        # PYTHONFAULTHANDLER: a process that dies of a signal leaves its stack in its log (an
        # adopted worker's exit status cannot be read, so the log is all there is).
        self._env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                         PYTHONFAULTHANDLER="1",
                         TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(built)))

    # -- bring-up ------------------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.net is not None:
            self.net.setup()
        if self.ckpt_tmpfs:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            size = f"size={self.scenario.cluster.checkpoint_fs_mb}m"
            subprocess.run(["mount", "-t", "tmpfs", "-o", size, "stalwart-chaos", str(self.ckpt_dir)], check=True,
                           capture_output=True, timeout=30)
        self.etcd.start()
        self.client = EtcdClient(self.etcd.client_config(timeout=10.0))
        for i in range(self.scenario.cluster.daemons):
            self.start_daemon(f"daemon{i}")
        for node in self.scenario.node_names():
            self.start_agent(node)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        path = self.workdir / f"{name}.log"
        with open(path, "ab") as out:
            # Everything dies with the runner, even if it is SIGKILLed: no cluster outlives its run.
            popen = subprocess.Popen(die_with_parent(args), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env or self._env, start_new_session=True)
        return Proc(name, popen, path)

    def start_daemon(self, name: str) -> None:
        c = self.scenario.cluster
        args = [self._python, "-m", "stalwart.cli.main", "--log-level", "info", "daemon",
                "--endpoints", ",".join(self.etcd.endpoints), "--job", self.job, "--daemon-id", name,
                "--lease-ttl", str(c.lease_ttl), "--tick-interval", "0.2", "--status-interval", "1",
                "--metrics-port", "0", "--health-port", "0", "--min-nodes", str(c.min_nodes),
                "--max-nodes", str(c.nodes), "--node-quantum", str(c.node_quantum), "--join-timeout", "3",
                "--regrow-cooldown", "0", "--stall-timeout", "300", "--quarantine-faults", "100",
                "--master-port", str(self.master_port),
                "--exclude-stragglers", "true" if c.exclude_stragglers else "false", "--straggler-steps", "3"]
        self.daemons[name] = self._spawn(name, args)

    def job_command(self) -> list[str]:
        j = self.scenario.job
        script = Path(j.script)
        if not script.is_absolute():
            script = Path(__file__).resolve().parent.parent / script
        return [self._python, str(script), "--ckpt-dir", str(self.ckpt_dir), "--steps", str(j.steps),
                "--global-batch", str(j.global_batch), "--micro-batch", str(j.micro_batch),
                "--dataset-len", str(j.samples), "--zero-stage", str(j.zero_stage),
                "--save-every", str(j.checkpoint_every), "--steps-log", str(self.steps_log),
                "--step-sleep", str(j.step_time), "--dropout", "0", "--max-rollbacks", str(j.max_rollbacks),
                *(("--peer-replicas", str(j.peer_replicas)) if j.peer_replicas != 1 else ()),
                *(("--memory-every", str(j.memory_every)) if j.memory_every else ()),
                *(("--restore-read-mbps", str(j.restore_read_mbps)) if j.restore_read_mbps > 0 else ())]

    def start_agent(self, node: str) -> None:
        c = self.scenario.cluster
        cfg = self.workdir / f"{node}.toml"
        command = ", ".join(f'"{a}"' for a in self.job_command())
        cfg.write_text(
            f'job = "{self.job}"\nnode_id = "{node}"\ncommand = [{command}]\nworkers = {c.workers_per_node}\n'
            f'listen = "{self.net.address(node) if self.net else "127.0.0.1"}:0"\ninsecure = true\n'
            f'state_dir = "{self.workdir / node}"\n'
            f"lease_ttl = {c.lease_ttl}\nprobe = \"fake\"\nfault_injection = true\nstop_grace = 10.0\n"
            f"stall_floor = 4.0\nstall_factor = 10.0\nstall_first_step = 180.0\nprogress_interval = 0.1\n"
            f"busy_window = 5\nreform_in_place = {str(c.reform_in_place).lower()}\nspares = {c.spares}\n"
            f"peer_probe_interval = 2.0\npreload = [{', '.join(repr(m) for m in c.preload)}]\n"
            f"[etcd]\nendpoints = [{', '.join(repr(e) for e in self.etcd.endpoints)}]\n"
            .replace("'", '"'))
        args = [self._python, "-m", "stalwart.cli.main", "--log-level", "info", "agent", "--config", str(cfg)]
        env = self._env
        if self.net is not None:
            args = [*self.net.exec_prefix(node), *args]
            env = dict(env, GLOO_SOCKET_IFNAME="eth0")  # the namespace's only way out
        self.agents[node] = self._spawn(node, args, env)

    # -- views ---------------------------------------------------------------------------------

    def _get(self, key: str) -> KeyValue | None:
        """Read ``key``; while etcd has no quorum (a lose-quorum fault), the last value read: the
        runner's view stands still rather than the run failing."""
        assert self.client is not None
        try:
            kv = self.client.get(key, timeout=1.0)
        except CoordError:
            return self._seen.get(key)
        self._seen[key] = kv
        return kv

    def round(self) -> records_pb2.RoundRecord | None:
        kv = self._get(self.keys.round)
        return records_pb2.RoundRecord.FromString(kv.value) if kv else None

    def leader(self) -> str | None:
        term = self.leader_term()
        return term[0] if term else None

    def leader_term(self) -> tuple[str, float] | None:
        """The leader and when it was elected: a restarted daemon may lead again under its old name."""
        kv = self._get(self.keys.leader)
        if not kv:
            return None
        record = records_pb2.LeaderRecord.FromString(kv.value)
        return record.daemon_id, record.elected_at

    def daemon_status(self) -> records_pb2.DaemonStatus | None:
        kv = self._get(self.keys.status)
        return records_pb2.DaemonStatus.FromString(kv.value) if kv else None

    def agent_address(self, node: str) -> str | None:
        kv = self._get(self.keys.node(node))
        return records_pb2.NodeRecord.FromString(kv.value).address if kv else None

    def agent_call(self, node: str, method: str, request: object, timeout: float = 10.0) -> object:
        address = self.agent_address(node)
        if address is None:
            raise RuntimeError(f"{node} has no agent registered")
        with grpc.insecure_channel(address) as channel:
            return getattr(agent_pb2_grpc.AgentStub(channel), method)(request, timeout=timeout)

    def status(self, node: str) -> agent_pb2.NodeStatus:
        return self.agent_call(node, "GetStatus", agent_pb2.StatusRequest())  # type: ignore[return-value]

    def members(self) -> list[str]:
        rnd = self.round()
        return [] if rnd is None or rnd.closed else [m.node_id for m in rnd.members]

    # -- faults on processes -----------------------------------------------------------------------

    def kill_agent(self, node: str) -> None:
        proc = self.agents[node]
        proc.popen.send_signal(signal.SIGKILL)  # its workers train on (they are not in its process group)
        proc.popen.wait(timeout=10)

    def kill_node(self, node: str) -> int:
        """Lose a whole node: SIGKILL its agent and every process it started (workers, spares),
        found by the node id the agent gives them (``STALWART_NODE``) and the agent's socket
        under this cluster's work folder. Returns how many worker processes were killed."""
        kill_tree(self.agents[node].popen.pid)
        self.agents[node].popen.wait(timeout=10)
        roots = (str(self.workdir), str(self.workdir.resolve()))
        victims = []
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
            except (psutil.Error, OSError):
                continue
            if env.get(ENV_NODE) == node and env.get(ENV_SOCKET, "").startswith(roots):
                victims.append(proc)
        for proc in victims:
            kill_tree(proc.pid)
        return len(victims)

    def restart_agent_handoff(self, node: str) -> None:
        """The first half of ``systemctl restart``: the unit's RestartKillSignal (SIGUSR1), after
        which the agent exits leaving its workers and lease for the next one."""
        proc = self.agents[node]
        proc.popen.send_signal(signal.SIGUSR1)
        proc.popen.wait(timeout=30)

    def kill_daemon(self, name: str) -> None:
        proc = self.daemons[name]
        kill_tree(proc.popen.pid)
        proc.popen.wait(timeout=10)

    def wait_until(self, predicate: object, timeout: float, poll: float = 0.1) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if predicate():  # type: ignore[operator]
                    return True
            except Exception:  # a process between lives: try again
                pass
            time.sleep(poll)
        return False

    # -- teardown ----------------------------------------------------------------------------------

    def stop(self) -> None:
        for proc in [*self.agents.values(), *self.daemons.values()]:
            if proc.alive:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in [*self.agents.values(), *self.daemons.values()]:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc.popen.pid)
                proc.popen.wait(timeout=10)
        if self.client is not None:
            self.client.close()
        self.etcd.stop()
        if self.net is not None:
            self.net.teardown()
        if self.ckpt_tmpfs:
            subprocess.run(["umount", "-l", str(self.ckpt_dir)], capture_output=True, timeout=30)

    # -- faults on the environment -------------------------------------------------------------------

    def fill_disk(self) -> int:
        """Fill the checkpoint file system up to the last byte; returns the bytes taken."""
        if not self.ckpt_tmpfs:
            raise RuntimeError("filling the checkpoint disk needs root (a tmpfs of its own); skipped")
        free = os.statvfs(self.ckpt_dir)
        size = free.f_bavail * free.f_frsize
        with open(self.ckpt_dir / "fill-disk.bin", "wb") as f:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    f.write(chunk)
            except OSError:  # ENOSPC: full, as intended
                pass
        return size

    def free_disk(self) -> None:
        (self.ckpt_dir / "fill-disk.bin").unlink(missing_ok=True)
