"""Network namespaces per simulated node: a cut link really cuts, and teardown leaves nothing."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from stalwart.chaos.netns import NodeNetwork, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"


def _connect_from(net: NodeNetwork, node: str, host: str, port: int) -> bool:
    cmd = [*net.exec_prefix(node), sys.executable, "-c", CONNECT, host, str(port)]
    return subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0


def test_a_cut_link_isolates_the_node_and_restore_brings_it_back() -> None:
    net = NodeNetwork(["node0", "node1"], tag=f"t{threading.get_ident() % 1000:03d}")
    net.setup()
    server = socket.create_server((net.host_ip, 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        assert _connect_from(net, "node0", net.host_ip, port)
        assert _connect_from(net, "node1", net.host_ip, port)
        net.cut("node1")
        assert not _connect_from(net, "node1", net.host_ip, port)
        assert _connect_from(net, "node0", net.host_ip, port)  # only node1 lost its link
        net.restore("node1")
        deadline = time.monotonic() + 10  # the link takes a moment to carry traffic again
        while not _connect_from(net, "node1", net.host_ip, port):
            assert time.monotonic() < deadline, "node1 still cut off 10 s after its link came back"
    finally:
        stop.set()
        thread.join()
        server.close()
        net.teardown()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.namespace("node0") not in left and net.namespace("node1") not in left
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert net.bridge not in links
