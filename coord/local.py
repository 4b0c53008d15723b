"""Local etcd servers on loopback ports: for tests, the demo, chaos runs and benchmarks.

Each member runs the system's ``etcd`` binary in its own process session, with its data in a
directory of the caller's choosing, so a member can be SIGKILLed and restarted on the same
data. Members die with the process that started them (parent-death signal), so a crashed test
run leaves no etcd behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.coord.config import EtcdConfig
from stalwart.coord.errors import CoordError

log = logging.getLogger(__name__)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each socket stays bound until all are picked, since a port
    released at once may be handed out again by the next pick (a cluster once got one peer URL
    twice, and etcd refused to start)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


# Runs between the new process and the real program: asks the kernel to SIGKILL it when its
# parent dies, checks the parent did not die already, then becomes the program (execvp keeps the
# setting). Done this way rather than with ``preexec_fn``, which runs Python code in the forked
# child and can deadlock there when the parent has gRPC threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the process is SIGKILLed when the calling process dies (Linux)."""
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


@dataclass(frozen=True)
class TLSFiles:
    """TLS for a local cluster; ``client_cert_auth`` makes it mutual, and clients built by
    :meth:`LocalEtcd.client_config` then present ``client_cert_file``/``client_key_file``."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_auth: bool = True
    client_cert_file: str | None = None
    client_key_file: str | None = None


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_file: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalEtcd:
    """A cluster of ``size`` etcd members on free ports of ``host`` (loopback unless given) under ``workdir``."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        size: int = 1,
        *,
        tls: TLSFiles | None = None,
        etcd_binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        host: str = "127.0.0.1",
    ) -> None:
        binary = etcd_binary or shutil.which("etcd")
        if not binary:
            raise CoordError("etcd binary not found on PATH (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.workdir = Path(workdir)
        self.tls = tls
        self.extra_args = extra_args
        ports = free_ports(2 * size + 1)
        self.token = f"stalwart-{os.getpid()}-{ports[-1]}"
        self.members = [
            Member(
                name=f"m{i}",
                client_port=ports[2 * i],
                peer_port=ports[2 * i + 1],
                data_dir=self.workdir / f"m{i}.etcd",
                log_file=self.workdir / f"m{i}.log",
                host=host,
            )
            for i in range(size)
        ]

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def client_config(self, **overrides: object) -> EtcdConfig:
        """An :class:`EtcdConfig` for this cluster (TLS files filled in when it uses TLS)."""
        settings: dict[str, object] = {"endpoints": tuple(self.endpoints)}
        if self.tls:
            settings.update(ca_file=self.tls.ca_file)
            if self.tls.client_cert_auth:
                settings.update(cert_file=self.tls.client_cert_file, key_file=self.tls.client_key_file)
        settings.update(overrides)
        return EtcdConfig(**settings)  # type: ignore[arg-type]

    def _args(self, m: Member) -> list[str]:
        cluster = ",".join(f"{x.name}=http://{x.host}:{x.peer_port}" for x in self.members)
        client_url = f"{self.scheme}://{m.host}:{m.client_port}"
        args = [
            self.binary,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", f"http://{m.host}:{m.peer_port}",
            "--initial-advertise-peer-urls", f"http://{m.host}:{m.peer_port}",
            "--initial-cluster", cluster,
            "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-outputs", str(m.log_file),
            "--enable-pprof=false",
        ]
        if self.tls:
            args += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file,
                     "--trusted-ca-file", self.tls.ca_file]
            if self.tls.client_cert_auth:
                args.append("--client-cert-auth")
        return args + list(self.extra_args)

    def start(self, timeout: float = 20.0) -> LocalEtcd:
        """Start every member and wait until the cluster has a leader."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for m in self.members:
            self._spawn(m)
        self.wait_ready(timeout)
        return self

    def _spawn(self, m: Member) -> None:
        with open(m.log_file, "ab") as err:
            m.proc = subprocess.Popen(
                die_with_parent(self._args(m)), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 20.0, members: list[Member] | None = None) -> None:
        """Wait until each running member answers and sees a leader."""
        from stalwart.coord.client import EtcdClient  # here: keeps this module light to import

        deadline = time.monotonic() + timeout
        for m in members or [x for x in self.members if x.running]:
            cfg = self.client_config(endpoints=(m.endpoint,), timeout=1.0, attempt_timeout=0.5)
            with EtcdClient(cfg) as client:
                while True:
                    if m.proc is not None and m.proc.poll() is not None:
                        raise CoordError(f"etcd {m.name} exited with {m.proc.returncode}; see {m.log_file}")
                    try:
                        if client.status()["leader"]:
                            break
                    except CoordError:
                        pass
                    if time.monotonic() > deadline:
                        raise CoordError(
                            f"etcd {m.name} at {m.endpoint} not ready within {timeout} s; see {m.log_file}")
                    time.sleep(0.05)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Kill one member (default SIGKILL, as a crash) and reap it."""
        m = self.members[index]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(sig)
            m.proc.wait(timeout=10)

    def restart(self, index: int, timeout: float = 20.0) -> None:
        """Start a stopped member again on its existing data."""
        m = self.members[index]
        if m.running:
            raise CoordError(f"etcd {m.name} is still running")
        self._spawn(m)
        self.wait_ready(timeout, [m])

    def stop(self, grace: float = 1.0) -> None:
        """Stop every member: SIGTERM, then SIGKILL after ``grace`` seconds. Safe to call twice.

        A member that lost its quorum can spend seconds trying to hand over leadership on
        SIGTERM; local clusters hold nothing worth that wait.
        """
        running = [m.proc for m in self.members if m.proc is not None and m.proc.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
