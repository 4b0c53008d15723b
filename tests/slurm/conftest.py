"""A real single-host Slurm for the tests: one slurmctld and several slurmd, one per node name
(``NodeName=... NodeHostname=...`` with ``slurmd -N``), authentication ``auth/none`` (no munge
key needed on one host). Skipped, with the reason, where Slurm is not installed or cannot run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stalwart.coord.local import free_port

NODES = ("n1", "n2", "n3")
PLUGINS = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")


@dataclass
class Slurm:
    conf: Path
    env: dict[str, str]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def node(self, name: str) -> str:
        return self.run("scontrol", "show", "node", name).stdout


def _why_not() -> str | None:
    for tool in ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user"
    if not any(PLUGINS.glob("auth_none.so")) and not Path("/usr/lib64/slurm/auth_none.so").exists():
        return "this Slurm build has no auth/none plugin"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    why = _why_not()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    ctld, slurmd = free_port(), free_port()
    cpus = os.cpu_count() or 1
    lines = ["ClusterName=stalwart-test", "SlurmctldHost=localhost", f"SlurmctldPort={ctld}",
             f"SlurmdPort={slurmd}", "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root",
             "SlurmdUser=root", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
             f"SlurmctldPidFile={d}/ctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
             f"SlurmctldLogFile={d}/log/ctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
             "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SchedulerType=sched/builtin",
             "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
             "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
             "SlurmdTimeout=300", "InactiveLimit=0", "KillWait=5"]
    for name in NODES:
        lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                     f"CPUs={cpus} RealMemory=1000")
    lines.append(f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
                 "OverSubscribe=FORCE")
    conf = d / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    s = Slurm(conf, env)
    started = subprocess.run(["slurmctld", "-c", "-f", str(conf)], env=env, capture_output=True, text=True,
                             timeout=60)
    if started.returncode != 0:
        pytest.skip(f"slurmctld does not start here: {started.stderr.strip()}")
    try:
        for name in NODES:
            out = subprocess.run(["slurmd", "-f", str(conf), "-N", name], env=env, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, f"slurmd -N {name}: {out.stderr}"
        deadline = time.monotonic() + 60
        while s.run("sinfo", "-h", "-t", "idle", "-o", "%D", check=False).stdout.strip() != str(len(NODES)):
            assert time.monotonic() < deadline, "the slurmd never registered: " + (d / "log" / "ctld.log").read_text()
            time.sleep(0.5)
        yield s
    finally:
        s.run("scancel", "--full", "--user=root", check=False)
        for pidfile in [*(d / f"slurmd-{n}.pid" for n in NODES), d / "ctld.pid"]:
            try:
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
