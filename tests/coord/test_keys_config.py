"""The key layout and the client settings: pure checks, no etcd."""

from __future__ import annotations

import pytest

from stalwart.coord.config import EtcdConfig, parse_endpoint
from stalwart.coord.errors import EtcdConfigError
from stalwart.coord.keys import JobKeys, Kind


def test_every_key_is_under_the_job_prefix_and_parses_back() -> None:
    k = JobKeys("job-1")
    cases = {
        k.node("n0"): (Kind.NODE, "n0"),
        k.health("n0"): (Kind.HEALTH, "n0"),
        k.progress("n0"): (Kind.PROGRESS, "n0"),
        k.ckpt(42): (Kind.CKPT, f"{42:020d}"),
        k.leader: (Kind.LEADER, None),
        k.round: (Kind.ROUND, None),
        k.torchrun_state: (Kind.TORCHRUN, "state"),
        k.torchrun_store_prefix + "torch.rendezvous.j.3/MASTER_ADDR":
            (Kind.TORCHRUN, "store/torch.rendezvous.j.3/MASTER_ADDR"),
    }
    for key, (kind, name) in cases.items():
        assert key.startswith(k.prefix)
        parsed = k.parse(key)
        assert parsed is not None and (parsed.kind, parsed.name) == (kind, name)
    assert k.parse(k.ckpt(42)).step == 42  # type: ignore[union-attr]


def test_checkpoint_keys_sort_by_step() -> None:
    k = JobKeys("j")
    steps = [0, 9, 10, 100, 99999, 10**12]
    assert sorted(k.ckpt(s) for s in steps) == [k.ckpt(s) for s in sorted(steps)]


@pytest.mark.parametrize("key", ["/stalwart/j/nodes/", "/stalwart/j/nodes/a/b", "/stalwart/j/unknown/x",
                                 "/stalwart/other/round", "/stalwart/j/ckpt/abc", "/stalwart/j/round/x"])
def test_keys_outside_the_layout_are_not_classified(key: str) -> None:
    assert JobKeys("j").parse(key) is None


@pytest.mark.parametrize("name", ["", "a/b", "..", "-x", "a b", "x" * 129])
def test_names_that_could_split_a_key_are_refused(name: str) -> None:
    with pytest.raises(EtcdConfigError):
        JobKeys("j").node(name)
    with pytest.raises(EtcdConfigError):
        JobKeys(name)


def test_endpoint_parsing() -> None:
    assert str(parse_endpoint("10.0.0.1:2379")[0]) == "10.0.0.1:2379"
    assert parse_endpoint("https://h:1")[1] is True
    assert parse_endpoint("http://h:1/")[1] is False
    assert str(parse_endpoint("[::1]:2379")[0]) == "[::1]:2379"
    for bad in ["nohost", "h:", "h:x", "h:70000"]:
        with pytest.raises(EtcdConfigError):
            parse_endpoint(bad)


def test_config_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert EtcdConfig(endpoints="a:1,b:2").endpoints == ("a:1", "b:2")  # type: ignore[arg-type]
    with pytest.raises(EtcdConfigError):
        EtcdConfig(endpoints=())
    with pytest.raises(EtcdConfigError):
        EtcdConfig(timeout=0)
    with pytest.raises(EtcdConfigError):
        EtcdConfig(user="u")
    with pytest.raises(EtcdConfigError):
        EtcdConfig(cert_file="x")
    with pytest.raises(EtcdConfigError):
        EtcdConfig(endpoints=("https://a:1",))
    with pytest.raises(EtcdConfigError):
        EtcdConfig.from_mapping({"endpoint": ["a:1"]})
    missing = tmp_path / "missing.pem"
    with pytest.raises(EtcdConfigError, match="missing.pem"):
        EtcdConfig(ca_file=str(missing))
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a certificate")
    with pytest.raises(EtcdConfigError):
        EtcdConfig(ca_file=str(garbage))
