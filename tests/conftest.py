"""Shared fixtures. etcd fixtures start real etcd servers on free loopback ports in a temp dir."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.coord.client import EtcdClient
from stalwart.coord.local import LocalEtcd, TLSFiles

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One single-member etcd shared by tests that only read and write (use unique key prefixes)."""
    cluster = LocalEtcd(tmp_path_factory.mktemp("etcd-shared"), 1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def etcd_client(etcd_server: LocalEtcd) -> Iterator[EtcdClient]:
    client = EtcdClient(etcd_server.client_config())
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def key_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to the test, so tests sharing one etcd never see each other's keys."""
    return f"/test/{request.node.name.replace('/', '_')}/"


@pytest.fixture
def make_etcd(tmp_path: Path) -> Iterator[Callable[..., LocalEtcd]]:
    """Factory for private clusters (restart, kill, TLS). Every one is stopped at teardown."""
    started: list[LocalEtcd] = []

    def make(size: int = 1, **kwargs: object) -> LocalEtcd:
        cluster = LocalEtcd(tmp_path / f"etcd{len(started)}", size, **kwargs)  # type: ignore[arg-type]
        started.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)


def _make_cert(d: Path, name: str, ca: str, server: bool) -> None:
    ext = d / f"{name}.ext"
    # etcd's own gateway connects to itself with the server certificate: it needs both usages.
    usage = "serverAuth,clientAuth" if server else "clientAuth"
    san = "subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else ""
    ext.write_text(f"{san}extendedKeyUsage={usage}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", ext.name, "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="session")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with a server and a client certificate, and a second, unrelated CA."""
    d = tmp_path_factory.mktemp("tls")
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_cert(d, "server", "ca", server=True)
    _make_cert(d, "client", "ca", server=False)
    for key in d.glob("*.key"):
        os.chmod(key, 0o600)
    return d


@pytest.fixture(scope="session")
def server_tls(tls_dir: Path) -> TLSFiles:
    return TLSFiles(ca_file=str(tls_dir / "ca.crt"), cert_file=str(tls_dir / "server.crt"),
                    key_file=str(tls_dir / "server.key"), client_cert_auth=True,
                    client_cert_file=str(tls_dir / "client.crt"), client_key_file=str(tls_dir / "client.key"))
