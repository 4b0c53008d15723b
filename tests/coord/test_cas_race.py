"""8 processes race a compare-and-swap on one key: exactly one wins each round."""

from __future__ import annotations

import os
import signal

from stalwart.coord.client import EtcdClient
from stalwart.coord.local import LocalEtcd
from testkit import python_child

PROCS = 8
ROUNDS = 50

RACER = """
import sys, time
from stalwart.coord.client import EtcdClient
from stalwart.coord.config import EtcdConfig
endpoint, prefix, me, procs, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
client = EtcdClient(EtcdConfig(endpoints=endpoint, timeout=30))
key = prefix + "counter"
for r in range(rounds):
    while True:  # wait until round r-1 has its winner
        kv = client.get(key)
        if kv is not None and int(kv.value.split(b":")[0]) == r:
            break
        time.sleep(0.002)
    # barrier: everyone has read the same revision before anyone swaps
    client.put(f"{prefix}ready/{r:03d}/{me}", b"1")
    while len(client.get_prefix(f"{prefix}ready/{r:03d}/")[0]) < procs:
        time.sleep(0.002)
    if client.compare_and_swap(key, f"{r + 1}:{me}".encode(), kv.mod_revision):
        print(f"WIN {r} {me}", flush=True)
print("DONE", flush=True)
"""


def test_exactly_one_winner_per_round(etcd_server: LocalEtcd, etcd_client: EtcdClient, key_prefix: str) -> None:
    etcd_client.put(key_prefix + "counter", b"0:init")
    children = [python_child(RACER, etcd_server.endpoints[0], key_prefix, f"p{i}", str(PROCS), str(ROUNDS))
                for i in range(PROCS)]
    outputs = []
    try:
        for child in children:
            out, err = child.communicate(timeout=240)
            assert child.returncode == 0, err
            outputs.append(out)
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    wins: dict[int, list[str]] = {}
    for out in outputs:
        lines = out.split("\n")
        assert "DONE" in lines
        for line in lines:
            if line.startswith("WIN "):
                _, r, who = line.split()
                wins.setdefault(int(r), []).append(who)
    assert sorted(wins) == list(range(ROUNDS))
    assert all(len(w) == 1 for w in wins.values()), {r: w for r, w in wins.items() if len(w) != 1}
    final = etcd_client.get(key_prefix + "counter")
    assert final is not None and final.value == f"{ROUNDS}:{wins[ROUNDS - 1][0]}".encode()
