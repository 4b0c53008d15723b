"""``--rdzv-conf`` is checked: a misspelt option fails torchrun naming it, instead of being ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.agent.torchrun_plugin import RdzvConfError, check_conf
from stalwart.coord.local import LocalEtcd
from testkit import torchrun, wait_exit

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "elastic_gloo.py")


def test_a_misspelt_option_fails_torchrun_with_its_name(tmp_path: Path, etcd_server: LocalEtcd) -> None:
    out = tmp_path / "node.out"
    proc = torchrun(SCRIPT, "--steps", "1", nnodes="1", endpoint=etcd_server.endpoints[0], job="typo", node="n0",
                    conf="join_timout=5", log_file=str(out))
    rc = wait_exit(proc, 120)
    text = out.read_text(errors="replace")
    assert rc != 0
    assert "--rdzv-conf join_timout: unknown option (did you mean 'join_timeout'?)" in text, text[-3000:]


def test_known_options_pass_and_the_password_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    conf: dict[str, object] = {"join_timeout": "600", "timeout": 30, "node_id": "n0", "user": "u"}
    check_conf(conf, environ={"STALWART_ETCD_PASSWORD": "from-env"})
    assert conf["password"] == "from-env"
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    conf = {"user": "u", "password_file": str(secret)}
    check_conf(conf, environ={})
    assert conf == {"user": "u", "password": "from-file"}
    with pytest.raises(RdzvConfError, match="heartbeat_tmeout: unknown option"):
        check_conf({"heartbeat_tmeout": "5"}, environ={})
