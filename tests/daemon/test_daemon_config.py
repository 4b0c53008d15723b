"""The daemon's configuration: TOML file, flags, defaults, and every kind of bad input."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stalwart.cli import daemon_cmd
from stalwart.daemon.config import ConfigError, DaemonSettings, load_config
from stalwart.daemon.errors import PolicyError

REPO = Path(__file__).resolve().parent.parent.parent


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    return path


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    daemon_cmd.register(parser.add_subparsers())
    return parser.parse_args(["daemon", *argv])


def test_the_example_config_is_valid_and_documents_every_setting() -> None:
    example = REPO / "deploy" / "daemon.toml"
    config = load_config(example)
    assert config.daemon.job == "my-job" and config.policy.max_nodes == 10_000
    text = example.read_text()
    for name in [*DaemonSettings.__dataclass_fields__, *config.policy.__dataclass_fields__]:
        assert name in text, f"{name} is not documented in deploy/daemon.toml"


def test_flags_win_over_the_file_and_the_file_over_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, '[daemon]\njob = "a"\nlease_ttl = 7\n[policy]\nmin_nodes = 2\nmax_nodes = 8\n'
                            '[etcd]\nendpoints = ["h1:2379", "h2:2379"]\n')
    args = _flags("--config", str(path), "--job", "b", "--max-nodes", "16", "--etcd-timeout", "9")
    config = load_config(args.config, daemon_cmd.overrides_from(args, environ={}))
    assert (config.daemon.job, config.daemon.lease_ttl) == ("b", 7)
    assert (config.policy.min_nodes, config.policy.max_nodes, config.policy.node_quantum) == (2, 16, 1)
    assert config.etcd.endpoints == ("h1:2379", "h2:2379") and config.etcd.timeout == 9.0
    assert config.daemon.tick_interval == 1.0 and config.daemon.metrics_port == 9464


def test_password_may_come_from_the_environment(tmp_path: Path) -> None:
    args = _flags("--job", "a", "--etcd-user", "u")
    config = load_config(None, daemon_cmd.overrides_from(args, environ={daemon_cmd.PASSWORD_ENV: "s3cret"}))
    assert config.etcd.user == "u" and config.etcd.password == "s3cret"


def test_password_may_come_from_a_file_and_a_flag_or_the_environment_wins(tmp_path: Path) -> None:
    secret = tmp_path / "etcd.password"
    secret.write_text("from-file\n")
    path = _write(tmp_path, f'[daemon]\njob = "a"\n[etcd]\nuser = "u"\npassword_file = "{secret}"\n')
    assert load_config(path, daemon_cmd.overrides_from(_flags(), environ={})).etcd.password == "from-file"
    env = daemon_cmd.overrides_from(_flags(), environ={daemon_cmd.PASSWORD_ENV: "from-env"})
    assert load_config(path, env).etcd.password == "from-env"


def test_a_misspelt_key_gets_a_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lease_tll: unknown setting \(did you mean 'lease_ttl'\?\)"):
        load_config(_write(tmp_path, '[daemon]\njob = "a"\nlease_tll = 3\n'))
    with pytest.raises(ConfigError, match=r"exclude_stragglers: must be true or false without quotes"):
        load_config(_write(tmp_path, '[daemon]\njob = "a"\n[policy]\nexclude_stragglers = "false"\n'))


@pytest.mark.parametrize("text", [
    '[daemon]\njob = "a"\n[policy]\nmin_nodes = 5\nmax_nodes = 3\n',  # min_nodes > max_nodes
    '[daemon]\njob = "a"\n[policy]\nmax_nodez = 3\n',  # typo in a policy key
    '[daemon]\njob = "a"\nlease_tll = 3\n',  # typo in a daemon key
    '[daemon]\njob = "a"\n[etcd]\nendpointz = ["h:1"]\n',  # typo in an etcd key
    '[daemon]\njob = "a"\n[polcy]\n',  # unknown table
    '[daemon]\njob = "a"\nlease_ttl = 1\n',  # below etcd's minimum
    '[daemon]\njob = "a"\ntick_interval = 5\n',  # longer than half the lease
    '[daemon]\njob = "a/b"\n',  # would escape its key prefix
    '[daemon]\nlease_ttl = 5\n',  # no job
    '[daemon]\njob = "a"\nmetrics_port = "9464"\n',  # wrong type
    '[daemon]\njob = "a"\n[etcd]\nendpoints = ["nohost"]\n',
    'daemon = 3\n',
    "this is not toml",
])
def test_bad_configs_raise_config_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, text))


def test_policy_errors_are_chained(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, '[daemon]\njob = "a"\n[policy]\nmin_nodes = 5\nmax_nodes = 3\n'))
    assert isinstance(info.value.__cause__, PolicyError)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_config(tmp_path / "nope.toml")


def test_check_prints_the_merged_config_without_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stalwart.cli.main import main

    assert main(["daemon", "--job", "a", "--etcd-user", "u", "--etcd-password", "pw", "--check"]) == 0
    out = capsys.readouterr().out
    assert '"job": "a"' in out and "pw" not in out
    assert main(["daemon", "--job", "a", "--min-nodes", "9", "--max-nodes", "3"]) == daemon_cmd.EXIT_CONFIG
