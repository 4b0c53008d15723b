"""torch's rendezvous-backend contract, written as this project's own test, and the etcd store
checked against torch's in-memory ``HashStore`` on random operation sequences."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous import RendezvousStateError

from stalwart.agent.torchrun_backend import EtcdRendezvousBackend, EtcdStore, frame_state
from stalwart.coord.client import EtcdClient
from stalwart.coord.keys import JobKeys


@pytest.fixture
def backend(etcd_client: EtcdClient) -> EtcdRendezvousBackend:
    return EtcdRendezvousBackend(etcd_client, JobKeys(f"contract-{uuid.uuid4().hex[:12]}"))


def _key(backend: EtcdRendezvousBackend) -> str:
    return backend._key  # noqa: SLF001 - the one key the backend owns


# --- the contract: get_state / set_state -------------------------------------------------------


def test_no_state_reads_as_none(backend: EtcdRendezvousBackend) -> None:
    assert backend.get_state() is None


def test_a_first_set_without_token_creates_the_state(backend: EtcdRendezvousBackend) -> None:
    result = backend.set_state(b"first")
    assert result is not None
    state, token, written = result
    assert (state, written) == (b"first", True) and token is not None
    assert backend.get_state() == (b"first", token)


def test_a_set_with_the_current_token_replaces_the_state(backend: EtcdRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    state, new_token, written = backend.set_state(b"two", token)  # type: ignore[misc]
    assert (state, written) == (b"two", True) and new_token != token
    assert backend.get_state() == (b"two", new_token)


def test_a_set_with_an_old_token_returns_the_current_state(backend: EtcdRendezvousBackend) -> None:
    _, old, _ = backend.set_state(b"one")  # type: ignore[misc]
    _, current, _ = backend.set_state(b"two", old)  # type: ignore[misc]
    assert backend.set_state(b"three", old) == (b"two", current, False)
    assert backend.get_state() == (b"two", current)


def test_a_set_without_token_over_an_existing_state_returns_it(backend: EtcdRendezvousBackend) -> None:
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    assert backend.set_state(b"two") == (b"one", token, False)


@pytest.mark.parametrize("bogus", ["not-a-token", object(), -5, 10**15])
def test_a_set_with_a_foreign_token_returns_the_current_state(backend: EtcdRendezvousBackend, bogus: object) -> None:
    _, token, _ = backend.set_state(b"one")  # type: ignore[misc]
    assert backend.set_state(b"two", bogus) == (b"one", token, False)  # type: ignore[arg-type]


def test_state_bytes_round_trip_exactly(backend: EtcdRendezvousBackend) -> None:
    payload = bytes(range(256)) * 40 + b""
    _, token, _ = backend.set_state(payload)  # type: ignore[misc]
    assert backend.get_state() == (payload, token)
    _, token, _ = backend.set_state(b"", token)  # type: ignore[misc]
    assert backend.get_state() == (b"", token)


def _corruptions() -> list[tuple[str, Callable[[bytes], bytes]]]:
    def flip(index: int) -> Callable[[bytes], bytes]:
        return lambda v: v[:index] + bytes([v[index] ^ 1]) + v[index + 1 :]

    return [
        ("garbage", lambda v: b"\x80\x04garbage that is no rendezvous state"),
        ("empty", lambda v: b""),
        ("truncated", lambda v: v[:-3]),
        ("extended", lambda v: v + b"x"),
        ("header-only", lambda v: v[:32]),
        ("magic", flip(0)),
        ("length", flip(9)),
        ("checksum", flip(20)),
        ("payload", flip(-1)),
        ("unframed", lambda v: v[32:]),
    ]


@pytest.mark.parametrize("how", [name for name, _ in _corruptions()])
def test_a_corrupt_state_raises_rendezvous_state_error(backend: EtcdRendezvousBackend,
                                                       etcd_client: EtcdClient, how: str) -> None:
    change = dict(_corruptions())[how]
    _, token, _ = backend.set_state(b"a perfectly good state")  # type: ignore[misc]
    etcd_client.put(_key(backend), change(frame_state(b"a perfectly good state")))
    with pytest.raises(RendezvousStateError):
        backend.get_state()
    with pytest.raises(RendezvousStateError):  # a lost swap would hand the corrupt state back
        backend.set_state(b"next", token)


def test_a_good_set_over_a_corrupt_state_with_its_token_repairs_it(backend: EtcdRendezvousBackend,
                                                                    etcd_client: EtcdClient) -> None:
    etcd_client.put(_key(backend), b"junk")
    kv = etcd_client.get(_key(backend))
    assert kv is not None
    state, token, written = backend.set_state(b"fresh", kv.mod_revision)  # type: ignore[misc]
    assert written and backend.get_state() == (b"fresh", token)


# --- the store: compare_set on an empty value, and a differential test against HashStore ------


def test_compare_set_swaps_an_empty_value(etcd_client: EtcdClient, key_prefix: str) -> None:
    store = EtcdStore(etcd_client, key_prefix, timeout=timedelta(seconds=2))
    store.set("k", b"")
    assert store.compare_set("k", b"", b"new") == b"new"
    assert store.get("k") == b"new"
    store.set("e", b"")
    store.append("e", b"tail")  # torch's append is a compare_set loop: it must not spin
    assert store.get("e") == b"tail"


KEYS = ["a", "b", "c"]
VALUES = [b"", b"x", b"7", b"-3", b"\x00\xff"]
_key_st = st.sampled_from(KEYS)
_value_st = st.sampled_from(VALUES)
OPS = st.one_of(
    st.tuples(st.just("set"), _key_st, _value_st),
    st.tuples(st.just("get"), _key_st),
    st.tuples(st.just("add"), _key_st, st.integers(-5, 5)),
    st.tuples(st.just("compare_set"), _key_st, _value_st, _value_st),
    st.tuples(st.just("check"), st.lists(_key_st, min_size=1, max_size=3)),
    st.tuples(st.just("delete_key"), _key_st),
    st.tuples(st.just("num_keys"),),
    st.tuples(st.just("append"), _key_st, _value_st),
    st.tuples(st.just("multi_set"),
              st.lists(st.tuples(_key_st, _value_st), min_size=1, max_size=3, unique_by=lambda t: t[0])),
    st.tuples(st.just("multi_get"), st.lists(_key_st, min_size=1, max_size=3)),
)


def _apply(store: dist.Store, op: tuple) -> object:  # type: ignore[type-arg]
    """One operation; the outcome is its result or the fact that it raised (types differ by store)."""
    name, *args = op
    try:
        if name == "get":
            if not store.check([args[0]]):
                return "missing"  # a get would wait for the key: both stores agree it is absent
            return store.get(args[0])
        if name == "multi_get":
            if not store.check(args[0]):
                return "missing"
            return store.multi_get(args[0])
        if name == "multi_set":
            return store.multi_set([k for k, _ in args[0]], [v for _, v in args[0]])
        return getattr(store, name)(*args)
    except (ValueError, RuntimeError, dist.DistError):
        return "raised"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=25))
def test_etcd_store_behaves_like_hash_store(etcd_client: EtcdClient, ops: list[tuple]) -> None:  # type: ignore[type-arg]
    etcd = EtcdStore(etcd_client, f"/test/store-diff/{uuid.uuid4().hex}/", timeout=timedelta(seconds=2))
    reference = dist.HashStore()
    reference.set_timeout(timedelta(seconds=2))
    for op in ops:
        assert _apply(etcd, op) == _apply(reference, op), op
    final = [k for k in KEYS if reference.check([k])]
    assert [k for k in KEYS if etcd.check([k])] == final
    assert [etcd.get(k) for k in final] == [reference.get(k) for k in final]
