"""Buddy replicas: each rank's part of the last committed checkpoint, also in a peer's host memory.

Why: when a node is lost, its ranks' state is otherwise read back from storage (slow, shared,
and the first thing to fail at scale). After every commit each rank pushes its host copy of what
it saved (:class:`~stalwart.ckpt.CommittedSnapshot`) to ``replicas`` buddy ranks on other nodes;
a re-forming world then rebuilds every rank's new partition from live memory (its own copy, the
copies it holds for others, and what it pulls from the ranks that hold the rest) and reads from
storage only what no live process holds. The same channel and buddies carry the parts of memory
generations (restore points between commits, ``trainer/generations.py``).

The replicas travel over a side channel of plain TCP (one listener per process, for the process's
life: a replica must outlive the world that made it), not over the training process groups:
a push runs beside training and may meet a peer that just died, and neither may block a
collective. Every request carries the world's token (random, from rank 0 when the world forms),
so a process outside the job cannot write or read replicas; the payload carries an XXH3 checksum
checked on arrival. Like gloo's own connections, the channel is not encrypted: it is for the job's
private network.

Placement: the buddies of a rank are the next ranks, in ring order, on nodes other than its own
(a node is ``STALWART_NODE`` from the agent, else the host name), each on a different node: the
loss of any one node leaves a copy of each of its ranks when ``replicas`` >= 1 and the world spans
two nodes or more.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.ckpt import CommittedSnapshot, SaveHandle, Shard
from stalwart.proto.contract import ENV_NODE
from stalwart.trainer.generations import Generation, MemoryStore
from stalwart.trainer.peer_fill import PeerFill, fill_from_parts, useful
from stalwart.trainer.peer_wire import (
    Part,
    PeerError,
    chunks,
    digest,
    drain,
    entries,
    recv_header,
    recv_part,
    send_header,
)

__all__ = ["PeerConfig", "PeerReplicas", "PeerFill", "Part", "buddies", "fill_from_parts"]

log = logging.getLogger(__name__)
PUSHES_KEPT = 256

@dataclass(frozen=True)
class PeerConfig:
    """``replicas``: buddy copies of each rank's part (0: off). ``memory_limit_bytes``: most host
    memory the copies held for others may use in this process (``None``: no bound; a push beyond
    it is refused and logged, and that part is read from storage if it is ever needed).
    ``timeout_s``: how long a push (in the background) waits for the peer at each step.
    ``pull_timeout_s``: the same for a restore's pull, which is on the critical path: a holder that
    stops answering (its node lost, its link cut since it said what it holds) is given up after
    this long without a byte, and its part is read from storage. ``bind_host``: the listener's address (default every
    interface of the process's network namespace; the advertised one is the route to the world's
    master). ``memory_every``: take a memory generation (``trainer/generations.py``) after every
    step divisible by it that is not a save, a restore point that is never written (0: none)."""

    replicas: int = 1
    memory_limit_bytes: int | None = None
    timeout_s: float = 60.0
    pull_timeout_s: float = 3.0
    bind_host: str = "0.0.0.0"
    memory_every: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"peer replicas must be >= 0, got {self.replicas}")
        if self.memory_every < 0:
            raise ValueError(f"peer memory_every must be >= 0 (0: off), got {self.memory_every}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 0:
            raise ValueError(f"peer memory_limit_bytes must be >= 0 or None, got {self.memory_limit_bytes}")
        if self.timeout_s <= 0 or self.pull_timeout_s <= 0:
            raise ValueError(f"peer timeout_s and pull_timeout_s must be positive, got {self.timeout_s}, "
                             f"{self.pull_timeout_s}")


def node_key() -> str:
    """This process's node: the agent's node id, else the host name."""
    return os.environ.get(ENV_NODE) or socket.gethostname()


def buddies(nodes: Sequence[str], rank: int, replicas: int) -> list[int]:
    """The ranks that hold ``rank``'s replicas: the next ones in ring order, each on a node
    other than ``rank``'s and than each other's (fewer when the world has fewer nodes)."""
    chosen: list[int] = []
    used = {nodes[rank]}
    n = len(nodes)
    for step in range(1, n):
        if len(chosen) >= replicas:
            break
        other = (rank + step) % n
        if nodes[other] not in used:
            chosen.append(other)
            used.add(nodes[other])
    return chosen


class PeerReplicas:
    """This process's replica store: its listener, its own part, the copies it holds for others.

    :meth:`attach` when a world forms (collective on ``group``), :meth:`replicate` after each
    commit (returns at once; the push runs on a thread), :meth:`fill` in a restore (collective).
    """

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._own: Part | None = None
        # origin rank -> step -> its part: the newest committed step's, and one newer (sent after
        # its snapshot, before its commit)
        self._held: dict[int, dict[int, Part]] = {}
        self._committed = -1  # the newest step this process saw committed
        self._token = ""
        self._rank = 0
        self._targets: list[tuple[int, str, int]] = []  # buddy rank, host, port
        self._next_push: tuple[SaveHandle, int] | None = None
        self._next_memory: Part | None = None
        self._push_running = False
        self.memory = MemoryStore()
        self._listener = socket.create_server((config.bind_host, 0), reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._serve, name="stalwart-peer-listener", daemon=True).start()
        # the newest pushes that finished, and that failed, for reports (a long run pushes every step)
        self.pushed: deque[dict[str, Any]] = deque(maxlen=PUSHES_KEPT)
        self.failed: deque[dict[str, Any]] = deque(maxlen=PUSHES_KEPT)
        self._peers: list[tuple[str, int]] = []

    # -- world -----------------------------------------------------------------------------------

    def attach(self, group: Any, rank: int, world_size: int, master_addr: str) -> list[int]:
        """Learn the world's peers and token (collective on ``group``); returns this rank's buddies."""
        import torch.distributed as dist

        token = secrets.token_hex(16) if rank == 0 else ""
        mine = {"node": node_key(), "host": _route_to(master_addr), "port": self.port, "token": token}
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        return self.join(everyone, rank)

    def join(self, everyone: Sequence[dict[str, Any]], rank: int) -> list[int]:
        """Take the world of :meth:`attach` (each rank's node, host, port; rank 0's token)."""
        nodes = [str(e["node"]) for e in everyone]
        chosen = buddies(nodes, rank, self.config.replicas)
        with self._lock:
            self._token = str(everyone[0]["token"])
            self._rank = rank
            self._peers = [(str(e["host"]), int(e["port"])) for e in everyone]
            self._targets = [(b, *self._peers[b]) for b in chosen]
        if self.config.replicas and not chosen:
            log.info("rank %d: no rank on another node (world %d on %d node(s)): its checkpoint part has no "
                     "peer replica", rank, len(everyone), len(set(nodes)))
        return chosen

    # -- replication -----------------------------------------------------------------------------

    def keep_own(self, snapshot: CommittedSnapshot, rank: int) -> Part:
        """``snapshot`` is committed: serve it as ``rank``'s part (no copy: it is the checkpointer's
        kept buffer), and drop the copies of steps before it (a restore only takes the newest
        committed step)."""
        part = Part(snapshot.step, rank, dict(snapshot.tensors))
        with self._lock:
            if self._own is None or self._own.step <= part.step:
                self._own = part
                self._committed = max(self._committed, part.step)
                self._prune()
        self.memory.committed(part.step)
        return part

    def keep_generation(self, part: Part) -> None:
        """Keep ``part`` (this rank's part of a memory generation) and push it to the buddies on
        the push thread, after any save waiting there."""
        if self.memory.keep_own(part):
            self._queue(memory=part)

    def replicate(self, handle: SaveHandle, rank: int) -> None:
        """Push this rank's part of the save ``handle`` to the buddies as soon as its snapshot is
        complete (before the commit: a peer then usually holds a step by the time it is committed).
        Returns at once; a push still running takes the newest save when done, older ones are
        skipped."""
        self._queue(save=(handle, rank))

    def _queue(self, save: tuple[SaveHandle, int] | None = None, memory: Part | None = None) -> None:
        with self._lock:
            if not self._targets:
                return
            if save is not None:
                self._next_push = save
            if memory is not None:
                self._next_memory = memory
            start, self._push_running = not self._push_running, True
        if start:
            threading.Thread(target=self._push_loop, name="stalwart-peer-push", daemon=True).start()

    def _push_loop(self) -> None:
        while True:
            with self._lock:
                save, memory = self._next_push, self._next_memory
                if save is not None:
                    self._next_push = None
                elif memory is not None:
                    self._next_memory = None
                else:
                    self._push_running = False
                    return
                targets, token = list(self._targets), self._token
            part = memory
            if save is not None:
                handle, rank = save
                handle.wait_snapshot(self.config.timeout_s)
                snapshot = handle.host_copy()
                part = None if snapshot is None else Part(snapshot.step, rank, dict(snapshot.tensors))
            for buddy, host, port in targets if part is not None else []:
                assert part is not None
                started = time.monotonic()
                try:
                    self._push(part, host, port, token)
                    took = time.monotonic() - started
                    with self._lock:
                        self.pushed.append({"step": part.step, "to": buddy, "bytes": part.nbytes, "s": took,
                                            "memory": bool(part.tag)})
                    log.log(logging.DEBUG if part.tag else logging.INFO,
                            "rank %d: step %d %spart (%d bytes) replicated to rank %d in %.3fs", part.rank,
                            part.step, "memory " if part.tag else "", part.nbytes, buddy, took)
                except (OSError, PeerError) as exc:
                    with self._lock:
                        self.failed.append({"step": part.step, "to": buddy, "error": str(exc),
                                            "memory": bool(part.tag)})
                    log.warning("rank %d: step %d %spart not replicated to rank %d: %s", part.rank, part.step,
                                "memory " if part.tag else "", buddy, exc)

    def _push(self, part: Part, host: str, port: int, token: str) -> None:
        layout, size = entries(part)
        header = {"op": "put", "token": token, "step": part.step, "rank": part.rank, "entries": layout,
                  "size": size, "digest": digest(part), **_generation_header(part)}
        with socket.create_connection((host, port), timeout=self.config.timeout_s) as s:
            send_header(s, header)
            for chunk in chunks(part):
                s.sendall(chunk)
            reply = recv_header(s)
        if not reply.get("ok"):
            raise PeerError(str(reply.get("error", "refused")))

    def wait_pushed(self, step: int, timeout_s: float) -> bool:
        """Wait until this rank's part of ``step`` (or a newer one) reached every buddy, or no push
        is left running; returns whether every buddy has it."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                targets = {b for b, _, _ in self._targets}
                busy = self._push_running
                reached = {e["to"] for e in self.pushed if e["step"] >= step}
            if targets <= reached:
                return True
            if not busy or time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def _prune(self) -> None:
        """Keep, per origin, only steps at or after the newest committed one, at most two."""
        for origin in list(self._held):
            steps = {st: p for st, p in self._held[origin].items() if st >= self._committed}
            for st in sorted(steps)[:-2]:
                del steps[st]
            if steps:
                self._held[origin] = steps
            else:
                del self._held[origin]

    @property
    def held_bytes(self) -> int:
        """Host memory of the copies this process holds for other ranks."""
        with self._lock:
            return sum(p.nbytes for parts in self._held.values() for p in parts.values())

    def holdings(self) -> list[Part]:
        with self._lock:
            parts = [p for by_step in self._held.values() for p in by_step.values()]
            if self._own is not None:
                parts.append(self._own)
            return parts

    # -- restore ---------------------------------------------------------------------------------

    def fill(self, targets: dict[str, torch.Tensor | Shard], step: int, group: Any, rank: int,
             world_size: int) -> tuple[dict[str, torch.Tensor | Shard], PeerFill]:
        """Fill ``targets`` from memory for checkpoint ``step``: this process's parts, then parts
        pulled from the lowest-ranked live holder of each. Collective on ``group`` (the world of
        :meth:`attach`). Returns what is left for storage."""
        import torch.distributed as dist

        mine = [p for p in self.holdings() if p.step == step]
        summaries = [p.summary() for p in mine]
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, summaries, group=group)
        own_rank = self._own.rank if self._own is not None and self._own.step == step else None
        local_origins = {p.rank for p in mine}
        holder: dict[int, tuple[int, dict[str, Any]]] = {}
        for r, parts in enumerate(everyone):
            for s in parts:
                if s["step"] == step and s["rank"] not in local_origins and s["rank"] not in holder:
                    holder[int(s["rank"])] = (r, s)
        wanted = {origin: names for origin, (_, s) in holder.items() if (names := useful(s, targets))}
        pulled: list[Part] = []
        if wanted:
            with self._lock:
                token, peers = self._token, list(self._peers)

            def pull(origin: int) -> Part | None:
                h = holder[origin][0]
                try:
                    return self._pull(peers[h], token, step, origin, wanted[origin])
                except (OSError, PeerError) as exc:
                    log.warning("rank %d: cannot pull rank %d's part of step %d from rank %d: %s (storage instead)",
                                rank, origin, step, h, exc)
                    return None

            with ThreadPoolExecutor(max_workers=min(8, len(wanted)), thread_name_prefix="stalwart-peer-pull") as ex:
                pulled = [p for p in ex.map(pull, sorted(wanted)) if p is not None]
        rest, copied = fill_from_parts(targets, [*mine, *pulled])
        return rest, PeerFill.of(copied, own_rank, local_origins, {o: h for o, (h, _) in holder.items()})

    def pull_generation(self, holder: int, origin: int, gen: Generation, names: list[str] | None) -> Part:
        """``origin``'s part of memory generation ``gen`` from rank ``holder`` of this world
        (``names``: the tensors wanted; ``None``: its metadata alone)."""
        with self._lock:
            token, peer = self._token, self._peers[holder]
        return self._pull(peer, token, gen.step, origin, names or [], tag=gen.tag, tensors=names is not None)

    def _pull(self, peer: tuple[str, int], token: str, step: int, origin: int, names: list[str], *,
              tag: str = "", tensors: bool = True) -> Part:
        with socket.create_connection(peer, timeout=self.config.pull_timeout_s) as s:
            send_header(s, {"op": "get", "token": token, "step": step, "rank": origin, "names": names, "tag": tag,
                            "tensors": tensors})
            header = recv_header(s)
            if not header.get("ok"):
                raise PeerError(str(header.get("error", "refused")))
            return recv_part(s, header, step, origin)

    # -- serving ---------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="stalwart-peer-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.config.timeout_s)
            try:
                header = recv_header(conn)
                with self._lock:
                    token = self._token
                if not token or not secrets.compare_digest(str(header.get("token", "")), token):
                    send_header(conn, {"ok": False, "error": "wrong token (not this job's world)"})
                    return
                if header.get("op") == "put":
                    send_header(conn, self._accept(conn, header))
                elif header.get("op") == "get":
                    self._serve_get(conn, header)
                else:
                    send_header(conn, {"ok": False, "error": f"unknown op {header.get('op')!r}"})
            except (OSError, PeerError, ValueError, KeyError, TypeError) as exc:
                log.debug("peer connection dropped: %s", exc)

    def _accept(self, conn: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        step, origin = int(header["step"]), int(header["rank"])
        size = int(header["size"])
        limit = self.config.memory_limit_bytes
        with self._lock:
            held = sum(p.nbytes for parts in self._held.values() for p in parts.values())
        # a generation's part replaces the oldest one of its origin once it has KEEP of them
        held += self.memory.held_bytes - (self.memory.freed_by(origin) if header.get("tag") else 0)
        if limit is not None and held + size > limit:
            drain(conn, size)
            log.warning("rank %d: refused rank %d's step %d part (%d bytes): the copies would hold %d bytes, over "
                        "the limit of %d", self._rank, origin, step, size, held + size, limit)
            return {"ok": False, "error": f"over this rank's peer memory limit ({limit} bytes)"}
        part = recv_part(conn, header, step, origin)
        if part.tag:
            refused = self.memory.accept(part)
            return {"ok": refused is None, **({"error": refused} if refused else {})}
        with self._lock:
            if step < self._committed:
                return {"ok": False, "error": f"stale: step {self._committed} is committed already"}
            self._held.setdefault(origin, {})[step] = part
            self._prune()
            total = sum(p.nbytes for parts in self._held.values() for p in parts.values())
        log.info("rank %d: holds rank %d's step %d part (%d bytes; %d bytes of copies in all)", self._rank, origin,
                 step, size, total)
        return {"ok": True}

    def _serve_get(self, conn: socket.socket, header: dict[str, Any]) -> None:
        step, origin, names = int(header["step"]), int(header["rank"]), set(header.get("names") or ())
        tag = str(header.get("tag", ""))
        with self._lock:
            if tag:
                part: Part | None = None
            elif self._own is not None and (self._own.rank, self._own.step) == (origin, step):
                part = self._own
            else:
                part = self._held.get(origin, {}).get(step)
        if tag:
            part = self.memory.get(tag, step, origin)
        if part is None:
            send_header(conn, {"ok": False, "error": f"no part of rank {origin} at step {step} here"})
            return
        keep = header.get("tensors", True)
        sub = Part(step, origin, {n: v for n, v in part.tensors.items() if keep and (not names or n in names)},
                   tag=part.tag, world=part.world, meta=part.meta)
        layout, size = entries(sub)
        send_header(conn, {"ok": True, "entries": layout, "size": size, "digest": digest(sub),
                           **_generation_header(sub)})
        for chunk in chunks(sub):
            conn.sendall(chunk)

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone leaves it serving)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass


def _generation_header(part: Part) -> dict[str, Any]:
    """The header fields of a memory generation's part (none for a committed step's)."""
    return {"tag": part.tag, "world": part.world, "meta": part.meta} if part.tag else {}


def _route_to(host: str) -> str:
    """This process's address on the route to ``host`` (the world's master)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"

