"""A network of its own for each simulated node, so a chaos run can cut one node's link.

On one machine every process shares the loopback interface, so "node 1 lost its network" cannot
be simulated by killing anything. With root, :class:`NodeNetwork` gives each simulated node a
Linux network namespace joined by a veth pair to a bridge on the host::

    host: bridge stw<id>br 10.213.N.1/24  <-- etcd members listen here
      +-- veth stw<id>h0 ---- eth0 10.213.N.10 in netns stw<id>-node0  (agent + its workers)
      +-- veth stw<id>h1 ---- eth0 10.213.N.11 in netns stw<id>-node1
      ...

:meth:`cut` takes the host end of a node's veth down: the node can reach neither etcd nor its
peers, and nobody can reach it, exactly like a pulled cable. :meth:`restore` brings it back.
Without root (or without the ``ip`` tool) :func:`unavailable_reason` says why, and the runner
skips the fault with that reason instead of pretending.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class NetworkSetupError(RuntimeError):
    """Creating or changing the namespaces failed; the message has the failing command."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "cutting a node's network needs root (network namespaces and veth pairs); skipped"
    if shutil.which("ip") is None:
        return "cutting a node's network needs the 'ip' tool (Debian: iproute2); skipped"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetworkSetupError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass
class NodeNetwork:
    """Namespaces for ``nodes``, named after ``tag`` (a few characters unique to this run)."""

    nodes: list[str]
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000:04d}")
    subnet: int = field(default_factory=lambda: os.getpid() % 250 + 1)
    up: bool = False

    @property
    def bridge(self) -> str:
        return f"stw{self.tag}br"

    @property
    def host_ip(self) -> str:
        return f"10.213.{self.subnet}.1"

    def namespace(self, node: str) -> str:
        return f"stw{self.tag}-{node}"

    def host_end(self, node: str) -> str:
        return f"stw{self.tag}h{self.nodes.index(node)}"  # interface names have at most 15 characters

    def address(self, node: str) -> str:
        return f"10.213.{self.subnet}.{10 + self.nodes.index(node)}"

    def exec_prefix(self, node: str) -> list[str]:
        """Prefix a command with this to run it inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def setup(self) -> None:
        if len(self.nodes) > 200:
            raise NetworkSetupError(f"{len(self.nodes)} nodes do not fit one /24 subnet")
        self.teardown()  # leftovers of a run with the same tag that was SIGKILLed
        self.up = True
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in self.nodes:
            ns, host_end, peer = self.namespace(node), self.host_end(node), f"stw{self.tag}p"
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", ns)
            _ip("-n", ns, "link", "set", peer, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
        log.info("network namespaces up: %s on bridge %s (%s)", [self.namespace(n) for n in self.nodes],
                 self.bridge, self.host_ip)

    def cut(self, node: str) -> None:
        _ip("link", "set", self.host_end(node), "down")

    def restore(self, node: str) -> None:
        _ip("link", "set", self.host_end(node), "up")

    def teardown(self) -> None:
        """Remove the namespaces (their veth ends go with them) and the bridge; quiet if absent."""
        for node in self.nodes:
            _ip("link", "del", self.host_end(node), check=False)
            _ip("netns", "del", self.namespace(node), check=False)
        _ip("link", "del", self.bridge, check=False)
        self.up = False
