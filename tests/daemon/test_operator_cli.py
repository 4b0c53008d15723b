"""`stalwart cordon`, `uncordon` and `status` are honest: a typo is refused, a lifted hold leaves no
key behind, and a job without a leading daemon says so (and exits 3). Real etcd, a real daemon."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from daemon_testlib import WAIT, DaemonProc, MakeAgent, RoundLog, leader_id, members, new_job

from stalwart.cli.main import main as cli
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys
from stalwart.coord.local import LocalEtcd
from stalwart.proto import records_pb2


def _status_reason(client: EtcdClient, job: str) -> str:
    kv = client.get(JobKeys(job).status)
    return records_pb2.DaemonStatus.FromString(kv.value).reason if kv else ""


def test_cordon_refuses_an_unknown_node_or_job_and_uncordon_removes_its_keys(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, make_agent: MakeAgent,
        capsys: pytest.CaptureFixture[str]) -> None:
    job = new_job()
    keys = JobKeys(job)
    etcd = ["--endpoints", ",".join(etcd_server.endpoints), "--job", job]
    make_agent(job, "gpu-017").register()
    capsys.readouterr()

    assert cli(["cordon", "gpu-071", *etcd]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "node 'gpu-071' is not known" in err[0] and "did you mean 'gpu-017'?" in err[0], err
    assert etcd_client.get(keys.cordon("gpu-071")) is None

    assert cli(["cordon", "gpu-017", "--endpoints", ",".join(etcd_server.endpoints), "--job", job + "x"]) == 3
    assert "has nothing in etcd" in capsys.readouterr().err

    assert cli(["cordon", "gpu-071", "--force", *etcd]) == 0  # e.g. before the node first registers
    assert etcd_client.get(keys.cordon("gpu-071")) is not None
    assert cli(["uncordon", "gpu-071", *etcd]) == 0  # held, so known now
    assert cli(["cordon", "gpu-017", "--drain", *etcd]) == 0
    assert cli(["uncordon", "gpu-017", *etcd]) == 0
    for node in ("gpu-017", "gpu-071"):
        assert etcd_client.get(keys.cordon(node)) is None and etcd_client.get(keys.faults(node)) is None
    assert cli(["uncordon", "gpu-0171", *etcd]) == 3


def test_status_shows_ages_and_the_step_rate_and_says_when_no_daemon_leads(
        etcd_server: LocalEtcd, etcd_client: EtcdClient, tmp_path: Path, make_agent: MakeAgent,
        capsys: pytest.CaptureFixture[str]) -> None:
    job = new_job()
    etcd = ["--endpoints", ",".join(etcd_server.endpoints), "--job", job]
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "2",
                        "--max-nodes", "2")
    try:
        agents = [make_agent(job, n).register() for n in ("a", "b")]
        first = rounds.wait(lambda r: members(r) == ["a", "b"])
        for agent in agents:
            agent.progress(first.number, 7)  # 0.1 s a step
        assert leader_id(etcd_client, job) == "d1"
        capsys.readouterr()
        assert cli(["status", *etcd]) == 0
        out = capsys.readouterr().out
        assert "leader: d1" in out and "elected " in out and " ago" in out
        assert "step rate: 10 steps/s" in out, out

        agents[1].revoke()  # one node left: the daemon closes the round and waits for a second
        rounds.wait(lambda r: r.number == first.number and r.closed)
        deadline = time.monotonic() + WAIT
        while not _status_reason(etcd_client, job):  # the daemon says why no round opens
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        daemon.stop()
        capsys.readouterr()
        assert cli(["status", *etcd]) == 3
        out = capsys.readouterr().out
        assert "leader: none: no daemon leads this job" in out, out
        assert "no daemon leads now" in out and "daemon d1 said" in out, out
        assert cli(["status", "--json", *etcd]) == 3
        assert json.loads(capsys.readouterr().out)["leading"] is False
        assert cli(["status", "--endpoints", ",".join(etcd_server.endpoints), "--job", job + "x"]) == 3
    finally:
        daemon.stop()
        rounds.close()
