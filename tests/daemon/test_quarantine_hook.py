"""A quarantine is handed to the scheduler: the leader runs ``on_quarantine`` once per quarantined
node (a real daemon process, real etcd; the command is a script that records its arguments)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

from daemon_testlib import DaemonProc, MakeAgent, RoundLog, members, new_job

from stalwart.cli.main import main as cli
from stalwart.coord.client import EtcdClient
from stalwart.coord.local import LocalEtcd
from testkit import wait_for


def _metric(port: int, line_start: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_quarantined_node_is_handed_to_the_scheduler_once(etcd_server: LocalEtcd, etcd_client: EtcdClient,
                                                            tmp_path: Path, make_agent: MakeAgent,
                                                            capsys: object) -> None:
    job = new_job()
    out = tmp_path / "drained.jsonl"
    script = tmp_path / "drain.py"
    script.write_text("import json, os, sys\n"
                      f"with open({str(out)!r}, 'a') as f:\n"
                      "    f.write(json.dumps([sys.argv[1:], os.environ['STALWART_NODE']]) + '\\n')\n")
    rounds = RoundLog(etcd_client, job)
    daemon = DaemonProc(etcd_server.endpoints, job, tmp_path / "d.log", "d1", "--min-nodes", "1",
                        "--max-nodes", "3", "--regrow-cooldown", "0", "--quarantine-faults", "1",
                        "--on-quarantine", f"{sys.executable} {script} nodename={{node}} 'reason={{reason}}'")
    try:
        agents = {n: make_agent(job, n).register() for n in ("a", "b", "c")}
        assert members(rounds.wait_number(1)) == ["a", "b", "c"]
        for step in (1, 5):
            for n in ("a", "b", "c"):
                agents[n].progress(1, step)
        agents["b"].revoke()  # a lost lease: one fault quarantines b
        assert members(rounds.wait_number(2)) == ["a", "c"]
        wait_for(lambda: out.exists() and out.read_text(), 20, "the on_quarantine command", tmp_path)
        (line,) = out.read_text().splitlines()
        (argv, node) = json.loads(line)
        assert node == "b" and argv[0] == "nodename=b"
        assert argv[1].startswith("reason=") and job in argv[1] and "quarantined after 1 faults" in argv[1]
        wait_for(lambda: _metric(daemon.metrics_port, 'stalwart_daemon_hook_runs_total{outcome="ok"}') == 1.0, 20,
                 "the hook's run counted", tmp_path)
        assert _metric(daemon.metrics_port, "stalwart_daemon_quarantines_total") == 1.0
        assert _metric(daemon.metrics_port, 'stalwart_daemon_member_faults_total{kind="lease-lost"}') == 1.0
        # training goes on in round 2: the job's step advances, and the fault's cost becomes known
        def shown_goodput(step: int) -> dict | None:
            assert cli(["status", "--endpoints", ",".join(etcd_server.endpoints), "--job", job, "--json"]) == 0
            goodput = json.loads(capsys.readouterr().out)["status"]["goodput"]  # type: ignore[attr-defined]
            return goodput if goodput is not None and goodput["step"] == step else None

        for n in ("a", "c"):
            agents[n].progress(2, 6)
        wait_for(lambda: shown_goodput(6), 20, "the fault's cost in the status record", tmp_path)
        # the job's last step before it goes quiet is written too, with no later event to carry it
        for n in ("a", "c"):
            agents[n].progress(2, 9)
        wait_for(lambda: _metric(daemon.metrics_port, "stalwart_daemon_job_step") == 9.0, 20, "the job's step",
                 tmp_path)
        goodput = wait_for(lambda: shown_goodput(9), 30, "the goodput in the status record", tmp_path)
        assert [(f["node"], f["kind"]) for f in goodput["faults"]] == [("b", "lease-lost")]
        assert goodput["faults"][0]["cost"] is not None
        # and at a glance, for a person at a terminal
        assert cli(["status", "--endpoints", ",".join(etcd_server.endpoints), "--job", job]) == 0
        text = capsys.readouterr().out  # type: ignore[attr-defined]
        assert "goodput: " in text and "job step 9" in text and "fault: b lease-lost" in text and "cost " in text
        agents["b"].register()  # quarantined: it stays out, and the command does not run again
        assert out.read_text().count("\n") == 1
    finally:
        daemon.stop()
        rounds.close()
