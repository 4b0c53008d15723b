"""A stalwart job through the real ``sbatch`` (deploy/slurm/): one agent per node via srun, two
daemons started by the job, a worker killed mid-run, training still reaching its last step, and
the node stalwart quarantined for it drained in Slurm with the reason."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.errors import CoordError
from stalwart.coord.local import LocalEtcd, free_port
from stalwart.daemon.status import read_status
from testkit import wait_for

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "deploy" / "slurm" / "stalwart-launch.sh"
WORKER = Path(__file__).resolve().parent / "train_worker.py"
STALWART = str(Path(sys.executable).with_name("stalwart"))
LAST = 80


def _job_state(slurm: Any, job_id: str) -> str:
    out = slurm.run("scontrol", "show", "job", job_id, check=False).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def _committed(client: EtcdClient, job: str) -> int:
    ck = read_status(client, job).checkpoint
    return int(ck["step"]) if ck else -1  # type: ignore[call-overload]


def _submit(slurm: Any, endpoints: str, tmp_path: Path, job: str, *, min_nodes: int,
            form_timeout: int = 120, etcd_port: int = 0) -> tuple[str, Path, Path]:
    """``sbatch -N 3`` of the launcher with the small worker; (Slurm job id, its output, pid dir).
    Empty ``endpoints``: the job starts its own etcd on ``etcd_port``."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**slurm.env,
           "STALWART": STALWART, "STALWART_JOB": job, "STALWART_ETCD": endpoints, "STALWART_ETCD_PORT": str(etcd_port),
           "STALWART_COMMAND": f"exec {sys.executable} {WORKER}", "STALWART_LAST_STEP": str(LAST),
           "STALWART_MIN_NODES": str(min_nodes), "STALWART_FORM_TIMEOUT": str(form_timeout),
           "STALWART_LISTEN": "127.0.0.1:0", "STALWART_STATE_DIR": str(tmp_path / "state"),
           "STALWART_AGENT_EXTRA": 'probe = "fake"\nlease_ttl = 2\nstop_grace = 2.0\nreform_in_place = false',
           "STALWART_POLICY_EXTRA": f"quarantine_faults = 1\njoin_timeout = 30.0\nmaster_port = {free_port()}",
           "LAST": str(LAST), "PIDS": str(pids), "WORK": "0.05", "CKPT_EVERY": "5"}
    out = tmp_path / "job.out"
    submitted = subprocess.run(["sbatch", "--parsable", "-N", "3", "--ntasks-per-node=1", f"--output={out}",
                                "--chdir", str(tmp_path), str(LAUNCH)], env=env, capture_output=True, text=True,
                               timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0], out, pids


def _ended(slurm: Any, job_id: str, tmp_path: Path) -> str:
    wait_for(lambda: _job_state(slurm, job_id) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
             240, "the Slurm job to end", tmp_path / "state")
    return _job_state(slurm, job_id)


def test_a_job_survives_a_worker_kill_and_its_quarantined_node_is_drained(
        slurm: Any, etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path) -> None:
    job = f"slurm-test-{os.getpid()}"
    job_id, out, pids = _submit(slurm, ",".join(etcd_server.endpoints), tmp_path, job, min_nodes=2)
    try:
        # training runs on all three nodes; then n3's worker is killed
        wait_for(lambda: _committed(etcd_client, job) >= 15, 120, "training to step 15", tmp_path / "state")
        victim = int((pids / "n3.pid").read_text())
        os.kill(victim, signal.SIGKILL)

        # the job ends by itself, successfully, once the last step's checkpoint commits
        state = _ended(slurm, job_id, tmp_path)
        text = out.read_text()
        assert state == "COMPLETED", text
        assert f"training reached step {LAST}" in text
        assert _committed(etcd_client, job) == LAST

        # the worker's node was quarantined by stalwart, and drained in Slurm with the reason
        node = slurm.node("n3")
        assert "DRAIN" in node, node
        reason = next(line.strip() for line in node.splitlines() if line.strip().startswith("Reason="))
        assert f"stalwart job {job}: quarantined" in reason, node
        for other in ("n1", "n2"):
            assert "DRAIN" not in slurm.node(other)
        print(f"n3: {reason}")
    finally:
        slurm.run("scancel", job_id, check=False)
        slurm.run("scontrol", "update", "nodename=n3", "state=resume", check=False)
        deadline = time.monotonic() + 30
        while _job_state(slurm, job_id) in ("RUNNING", "COMPLETING") and time.monotonic() < deadline:
            time.sleep(0.5)


def test_a_job_whose_world_can_no_longer_form_ends_with_the_reason(slurm: Any, tmp_path: Path) -> None:
    job = f"slurm-short-{os.getpid()}"
    port = free_port()  # the job starts its own etcd (STALWART_ETCD empty)
    job_id, out, pids = _submit(slurm, "", tmp_path, job, min_nodes=3, form_timeout=5, etcd_port=port)
    etcd_client = EtcdClient(EtcdConfig(endpoints=f"{socket.gethostname()}:{port}"))
    try:
        wait_for(lambda: _committed(etcd_client, job) >= 5, 120, "training to step 5", tmp_path / "state",
                 retry_on=(CoordError,))  # the job's etcd is not up at once
        os.kill(int((pids / "n2.pid").read_text()), signal.SIGKILL)  # n2 is quarantined: 2 nodes < min_nodes
        state = _ended(slurm, job_id, tmp_path)
        text = out.read_text()
        assert state == "FAILED", text
        assert "cannot-form: no world for" in text and "the world can no longer be formed" in text, text
        assert "DRAIN" in slurm.node("n2")
    finally:
        slurm.run("scancel", job_id, check=False)
        slurm.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
        etcd_client.close()
