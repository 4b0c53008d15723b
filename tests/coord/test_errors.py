"""Unreachable etcd, a silent endpoint, wrong TLS, bad auth: a clear error in time, never a hang."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
from stalwart.coord.errors import EtcdAuthError, EtcdTimeout, EtcdTLSError, EtcdUnavailable
from stalwart.coord.local import LocalEtcd, TLSFiles, free_port

TIMEOUT = 1.5


def _timed(fn: Callable[[], object]) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(Exception) as info:
        fn()
    return info.value, time.monotonic() - start


def test_unreachable_endpoint_names_it_within_the_timeout() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    client = EtcdClient(EtcdConfig(endpoints=(endpoint,), timeout=TIMEOUT))
    exc, took = _timed(lambda: client.get("/k"))
    client.close()
    assert isinstance(exc, EtcdUnavailable)
    assert endpoint in str(exc)
    assert took <= TIMEOUT + 1


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    t.join()
    for s in held:
        s.close()
    server.close()


def test_silent_endpoint_times_out_instead_of_hanging(silent_endpoint: str) -> None:
    client = EtcdClient(EtcdConfig(endpoints=(silent_endpoint,), timeout=TIMEOUT, attempt_timeout=0.5))
    exc, took = _timed(lambda: client.put("/k", b"v"))
    client.close()
    # gRPC reports "timed out before receiving SETTINGS frame" as UNAVAILABLE: either type is clear.
    assert isinstance(exc, (EtcdTimeout, EtcdUnavailable))
    assert silent_endpoint in str(exc)
    assert took <= TIMEOUT + 1


def test_failover_skips_a_dead_endpoint(etcd_server: LocalEtcd) -> None:
    dead = f"127.0.0.1:{free_port()}"
    client = EtcdClient(EtcdConfig(endpoints=(dead, etcd_server.endpoints[0]), timeout=TIMEOUT))
    try:
        client.put("/failover/k", b"v")
        assert client.current_endpoint == etcd_server.endpoints[0]
    finally:
        client.close()


def test_mutual_tls(make_etcd: Callable[..., LocalEtcd], server_tls: TLSFiles, tls_dir: Path) -> None:
    etcd = make_etcd(1, tls=server_tls)
    with EtcdClient(etcd.client_config(timeout=TIMEOUT)) as good:
        good.put("/tls/k", b"v")
        assert good.get("/tls/k").value == b"v"  # type: ignore[union-attr]

    wrong_ca = etcd.client_config(timeout=TIMEOUT, ca_file=str(tls_dir / "other-ca.crt"))
    with EtcdClient(wrong_ca) as bad:
        exc, took = _timed(lambda: bad.get("/tls/k"))
    assert isinstance(exc, EtcdTLSError), exc
    assert etcd.endpoints[0] in str(exc)
    assert took <= TIMEOUT + 1

    no_client_cert = EtcdConfig(endpoints=tuple(etcd.endpoints), ca_file=server_tls.ca_file, timeout=TIMEOUT)
    with EtcdClient(no_client_cert) as bad:
        exc, took = _timed(lambda: bad.get("/tls/k"))
    assert isinstance(exc, EtcdUnavailable), exc
    assert took <= TIMEOUT + 1


def _etcdctl(endpoint: str, *args: str) -> None:
    subprocess.run(["etcdctl", f"--endpoints={endpoint}", *args], check=True, capture_output=True,
                   env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}, timeout=20)


def test_auth(make_etcd: Callable[..., LocalEtcd]) -> None:
    etcd = make_etcd(1)
    endpoint = etcd.endpoints[0]
    _etcdctl(endpoint, "user", "add", "root:s3cret")
    _etcdctl(endpoint, "auth", "enable")

    with EtcdClient(etcd.client_config(timeout=TIMEOUT, user="root", password="s3cret")) as good:
        good.put("/auth/k", b"v")
        assert good.get("/auth/k").value == b"v"  # type: ignore[union-attr]

    with EtcdClient(etcd.client_config(timeout=TIMEOUT, user="root", password="wrong")) as bad:
        exc, took = _timed(lambda: bad.get("/auth/k"))
    assert isinstance(exc, EtcdAuthError), exc
    assert endpoint in str(exc)
    assert took <= TIMEOUT + 1

    with EtcdClient(etcd.client_config(timeout=TIMEOUT)) as anonymous:
        exc, _ = _timed(lambda: anonymous.put("/auth/k", b"x"))
    assert isinstance(exc, EtcdAuthError), exc
