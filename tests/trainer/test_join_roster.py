"""The arrival roster every rank passes before ``init_process_group`` (trainer/reform.py): a
superseded round is left without stranding a peer inside gloo's uninterruptible rendezvous."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from stalwart.trainer.reform import JoinSuperseded, ReformSpec, _arrive


def _spec(rank: int, world: int, round_: int = 5) -> ReformSpec:
    return ReformSpec(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=29500, round=round_)


def _run(store: dist.Store, spec: ReformSpec, superseded: threading.Event, out: dict[int, object]) -> None:
    try:
        _arrive(store, spec, 30.0, superseded.is_set, None)
        out[spec.rank] = "joined"
    except JoinSuperseded as exc:
        out[spec.rank] = exc


def test_every_rank_passes_once_all_arrived() -> None:
    store, never, out = dist.HashStore(), threading.Event(), {}
    threads = [threading.Thread(target=_run, args=(store, _spec(r, 3), never, out)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: "joined", 1: "joined", 2: "joined"}


def test_a_superseded_rank_takes_itself_off_so_a_late_peer_does_not_enter_the_group_alone() -> None:
    store, out = dist.HashStore(), {}
    gone = threading.Event()
    gone.set()  # a newer round came while rank 0 waited for rank 1
    _run(store, _spec(0, 2), gone, out)
    assert isinstance(out[0], JoinSuperseded)
    # Rank 1 arrives late: the roster holds only itself, so it keeps waiting (until superseded
    # too) instead of entering init_process_group for a world rank 0 will never join.
    late_superseded = threading.Event()
    t = threading.Thread(target=_run, args=(store, _spec(1, 2), late_superseded, out))
    t.start()
    t.join(0.5)
    assert t.is_alive() and 1 not in out
    late_superseded.set()
    t.join(30)
    assert isinstance(out[1], JoinSuperseded)
    assert store.add("count", 0) == 0 and not store.check(["full"])


def test_a_rank_superseded_after_the_roster_filled_joins_anyway() -> None:
    store, out = dist.HashStore(), {}
    never = threading.Event()
    first = threading.Thread(target=_run, args=(store, _spec(1, 2), never, out))
    first.start()
    while store.add("count", 0) != 1:
        pass
    gone = threading.Event()
    gone.set()
    _run(store, _spec(0, 2), gone, out)  # it fills the roster itself, then sees the newer round
    first.join(30)
    assert out == {0: "joined", 1: "joined"}


def test_a_replacement_of_a_rank_that_died_after_arriving_is_not_counted_twice() -> None:
    store, never, out = dist.HashStore(), threading.Event(), {}
    store.set("arrived/1", b"4242")  # rank 1's first process (pid 4242) arrived, then died
    store.add("count", 1)
    replacement = threading.Thread(target=_run, args=(store, _spec(1, 3), never, out))
    replacement.start()
    replacement.join(0.5)
    assert replacement.is_alive(), "ranks 0 and 2 have not arrived"
    others = [threading.Thread(target=_run, args=(store, _spec(r, 3), never, out)) for r in (0, 2)]
    for t in others:
        t.start()
    for t in [replacement, *others]:
        t.join(30)
    assert out == {0: "joined", 1: "joined", 2: "joined"}


def test_a_world_of_one_does_not_wait() -> None:
    out: dict[int, object] = {}
    _run(dist.HashStore(), _spec(0, 1), threading.Event(), out)
    assert out == {0: "joined"}


def test_the_peers_a_gloo_error_names_are_found() -> None:
    from stalwart.trainer.reform import peer_hosts

    err = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                       "[10.213.227.12]:27463; [pair.cc:538] Read error [10.213.227.12]:27463: reset; "
                       "[fdff::5555:226b]:3266")
    assert peer_hosts(err) == ["10.213.227.12", "fdff::5555:226b"]
    assert peer_hosts(RuntimeError("Timed out waiting 30000ms for recv operation")) == []


def test_rank_0_waits_for_its_port_held_by_the_process_it_replaces() -> None:
    """The previous holder of rank 0 is stopped off its agent's main loop and may still hold the
    round's port for a moment: the new rank 0 retries instead of failing the round."""
    import socket

    from stalwart.coord.local import free_port
    from stalwart.trainer.reform import _host_store

    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    threading.Timer(0.5, holder.close).start()
    store = _host_store(ReformSpec(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, round=3),
                        30.0, lambda: False)
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_a_store_client_whose_host_resets_it_gives_up_when_the_round_is_superseded() -> None:
    """A host that accepts and resets (a dying rank 0): TCPStore's own connect would retry for the
    join's whole timeout (minutes here); the join's client tries in short steps, so a newer round
    ends the wait."""
    import socket
    import struct
    import time

    from stalwart.trainer.reform import _connect_store

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def reset_every_connection() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # an RST, as from a process that died

    resetter = threading.Thread(target=reset_every_connection, daemon=True)
    resetter.start()
    spec = ReformSpec(rank=1, world_size=2, master_addr="127.0.0.1", master_port=server.getsockname()[1], round=3)
    superseded = threading.Event()
    threading.Timer(0.5, superseded.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(JoinSuperseded):
            _connect_store(spec, 600.0, superseded.is_set)
    finally:
        stop.set()
        resetter.join(5)
        server.close()
    assert time.monotonic() - started < 60  # not the join's 600 s
