"""The agent's configuration is strict: exact types, no unknown keys, errors that name the setting.

Loaded from real TOML files, and through the real ``stalwart agent`` process where the exit code
and the one-line message are what an operator sees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.agent.config import AgentConfig, AgentConfigError, TLSConfig, load, security_warnings, tls_credentials

STALWART = str(Path(sys.executable).with_name("stalwart"))

BASE = """job = "j"
command = ["python", "train.py"]
insecure = true
state_dir = "{state}"
[etcd]
endpoints = ["127.0.0.1:2379"]
"""


def _file(tmp_path: Path, line: str = "", base: str = BASE) -> Path:
    """``base`` with ``line`` replacing its top-level setting of the same name (if any)."""
    text = base.format(state=tmp_path / "state")
    if line:
        name = line.split("=")[0].strip()
        kept = [x for x in text.splitlines() if x.split("=")[0].strip() != name]
        text = "\n".join([line, *kept]) + "\n"
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("line", "setting", "shown"), [
    ('insecure = "false"', "insecure", "'false'"),
    ('fault_injection = "false"', "fault_injection", "'false'"),
    ('reform_in_place = "true"', "reform_in_place", "'true'"),
    ('workers = "8"', "workers", "'8'"),
    ("lease_ttl = 5.5", "lease_ttl", "5.5"),
    ("stall_floor = nan", "stall_floor", "nan"),
    ('command = [1, 2]', "command.0", "1"),
    ("metrics_port = true", "metrics_port", "True"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_setting(tmp_path: Path, line: str, setting: str,
                                                                 shown: str) -> None:
    with pytest.raises(AgentConfigError) as info:
        load(_file(tmp_path, line))
    message = str(info.value)
    assert message.startswith(f"agent config: {setting}: ") and shown in message, message
    assert "\n" not in message


def test_security_switches_built_in_code_must_be_booleans() -> None:
    for kw in ({"insecure": "false"}, {"fault_injection": "false"}, {"tls": TLSConfig("a", "b", "c", "false")}):
        with pytest.raises(AgentConfigError, match="must be true or false"):
            AgentConfig(job="j", command=("python",), **kw)  # type: ignore[arg-type]


def test_a_quoted_boolean_says_how_to_write_it(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match="without quotes"):
        load(_file(tmp_path, 'insecure = "false"'))


@pytest.mark.parametrize(("text", "message"), [
    ("workerz = 2", "agent config: workerz: unknown setting (did you mean 'workers'?)"),
    ('colour = "blue"', "agent config: colour: unknown setting (known: "),
    ('[tls]\ncert_flie = "x"', "agent config: tls.cert_flie: unknown setting (did you mean 'cert_file'?)"),
    ('[etcd]\nendpointz = ["h:1"]', "agent config: etcd.endpointz: unknown setting (did you mean 'endpoints'?)"),
])
def test_an_unknown_key_is_refused_with_a_suggestion(tmp_path: Path, text: str, message: str) -> None:
    base = BASE.replace('[etcd]\nendpoints = ["127.0.0.1:2379"]\n', "")
    path = tmp_path / "agent.toml"
    path.write_text(text + "\n" + base.format(state=tmp_path / "state") if not text.startswith("[")
                    else base.format(state=tmp_path / "state") + text + "\n")
    with pytest.raises(AgentConfigError) as info:
        load(path)
    assert str(info.value).startswith(message), info.value


def test_tls_without_client_authentication_must_be_asked_for(tmp_path: Path) -> None:
    tls = '[tls]\ncert_file = "a.crt"\nkey_file = "a.key"\n'
    with pytest.raises(AgentConfigError, match=r"tls\.ca_file: needed to authenticate clients"):
        load(_tls_file(tmp_path, tls))
    config = load(_tls_file(tmp_path, tls + "client_auth = false\n"))
    assert not config.tls.client_auth
    assert [w.split(":")[0] for w in security_warnings(config)] == ["tls.client_auth = false"]
    with pytest.raises(AgentConfigError, match=r"tls\.client_auth: must be true or false"):
        load(_tls_file(tmp_path, tls + 'client_auth = "false"\n'))


def _tls_file(tmp_path: Path, tls: str) -> Path:
    path = tmp_path / "tls.toml"
    path.write_text(f'job = "j"\ncommand = ["python"]\nstate_dir = "{tmp_path}/s"\n{tls}')
    return path


def test_settings_that_weaken_security_are_named(tmp_path: Path) -> None:
    config = load(_file(tmp_path, "fault_injection = true"))
    assert [w.split(":")[0] for w in security_warnings(config)] == ["insecure = true", "fault_injection = true"]


def test_the_etcd_password_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    auth = BASE + 'user = "agent"\n'
    config = load(_file(tmp_path, base=auth), environ={"STALWART_ETCD_PASSWORD": "from-env"})
    assert config.etcd.password == "from-env"
    secret = tmp_path / "etcd.password"
    secret.write_text("from-file\n")
    config = load(_file(tmp_path, base=auth + f'password_file = "{secret}"\n'), environ={})
    assert config.etcd.password == "from-file"
    with pytest.raises(AgentConfigError, match="password or password_file, not both"):
        load(_file(tmp_path, base=auth + f'password_file = "{secret}"\npassword = "x"\n'), environ={})
    with pytest.raises(AgentConfigError) as info:
        load(_file(tmp_path, base=auth + "password = 12345\n"), environ={})
    assert "etcd.password" in str(info.value) and "12345" not in str(info.value)


def test_a_certificate_that_is_not_pem_is_named(tmp_path: Path, tls_dir: Path) -> None:
    bad = tmp_path / "agent.crt"
    bad.write_bytes(b"\x30\x82\x01\x0a binary DER, not PEM")
    tls = (f'[tls]\ncert_file = "{bad}"\nkey_file = "{tls_dir / "server.key"}"\n'
           f'ca_file = "{tls_dir / "ca.crt"}"\n')
    with pytest.raises(AgentConfigError, match=r"tls\.cert_file .*agent\.crt: not a PEM file"):
        tls_credentials(load(_tls_file(tmp_path, tls)).tls)
    other_key = tmp_path / "other.key"
    subprocess.run(["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True)
    tls = (f'[tls]\ncert_file = "{tls_dir / "server.crt"}"\nkey_file = "{other_key}"\n'
           f'ca_file = "{tls_dir / "ca.crt"}"\n')
    with pytest.raises(AgentConfigError, match="cannot be loaded together"):
        tls_credentials(load(_tls_file(tmp_path, tls)).tls)


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STALWART, "agent", *args], capture_output=True, text=True, timeout=60)


def test_the_agent_refuses_a_quoted_boolean_at_start(tmp_path: Path) -> None:
    for line in ('insecure = "false"', 'fault_injection = "false"'):
        out = _agent("--config", str(_file(tmp_path, line)))
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and line.split()[0] in lines[0], out.stderr


def test_check_validates_and_prints_without_starting(tmp_path: Path) -> None:
    path = _file(tmp_path, base=BASE + 'user = "agent"\npassword = "s3cret"\n')
    out = _agent("--config", str(path), "--check")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["job"] == "j" and shown["etcd"]["password"] == "***" and "s3cret" not in out.stdout
    assert "insecure = true" in out.stderr
    assert not (tmp_path / "state").exists(), "--check must not start anything"
    out = _agent("--config", str(_file(tmp_path, "workerz = 2")), "--check")
    assert out.returncode == 2 and "did you mean 'workers'" in out.stderr


def test_agent_log_lines_carry_the_node_id_and_the_round_they_are_about() -> None:
    import json
    import logging

    from stalwart.cli.logs import AgentContext, JsonFormatter

    current = {"round": 4}
    context = AgentContext("n7", lambda: current["round"])

    def line(msg: str, **extra: object) -> dict[str, object]:
        record = logging.LogRecord("stalwart.agent.node", logging.INFO, __file__, 1, msg, (), None)
        record.__dict__.update(extra)
        assert context.filter(record)
        return json.loads(JsonFormatter().format(record))  # type: ignore[no-any-return]

    event = line("agent n7: round 5: keeping 1 worker(s) in place")  # logged before the agent's round moves
    assert (event["node"], event["round"]) == ("n7", 5)
    assert line("agent n7: lease lost; registering again")["round"] == 4  # nothing in the message: the current
    assert line("progress channel to 10.0.0.5:7077 closed")["node"] == "n7"  # never an address
    assert line("rank 1 exited", round=3, node="n7")["round"] == 3  # what the call said wins
