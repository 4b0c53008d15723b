"""The wire format of peer replicas (``trainer/peer.py``): what one message looks like.

A message is a 4-byte length, a JSON header, then for a part its payload: each tensor's bytes at
an offset aligned to ``ALIGN`` (so any dtype can view the received buffer in place), with an
XXH3 digest of the whole payload in the header, checked on arrival.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from stalwart.ckpt import Region

__all__ = ["ALIGN", "Part", "PeerError", "chunks", "digest", "drain", "entries", "recv_header", "recv_part",
           "send_header"]

_HEADER = struct.Struct("!I")  # length of the JSON header that starts every message
_MAX_HEADER = 64 << 20
ALIGN = 64  # each tensor starts at a multiple of this in the payload (any dtype can view it)
_DTYPES: dict[str, torch.dtype] = {str(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}  # fmt: skip


@dataclass
class Part:
    """One rank's part of one step: ``tensors`` maps a name to the region of the global tensor
    and a 1-D view of its elements, as in :class:`~stalwart.ckpt.CommittedSnapshot`.

    A part of a committed checkpoint has no ``tag``. A memory generation's part (see
    ``trainer/generations.py``) has its lineage as ``tag``, the size of the world that took it,
    and the step's metadata as a checkpoint would hold it (encoded: JSON values only)."""

    step: int
    rank: int  # its rank in the world that saved it
    tensors: dict[str, tuple[Region, torch.Tensor]]
    tag: str = ""
    world: int = 0
    meta: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors.values())

    def summary(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "nbytes": self.nbytes, "tag": self.tag, "world": self.world,
                "tensors": {n: r.to_json() | {"shape": list(r.shape)} for n, (r, _) in self.tensors.items()}}


class PeerError(Exception):
    """A push or pull of a replica failed (the peer is gone, refused it, or the data is corrupt)."""


def _raw(data: torch.Tensor) -> torch.Tensor:
    flat = data.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def entries(part: Part) -> tuple[list[dict[str, Any]], int]:
    """The payload's layout (each tensor at an offset aligned to ``ALIGN``) and its size."""
    entries, off = [], 0
    for name, (region, data) in part.tensors.items():
        nbytes = data.numel() * data.element_size()
        entries.append({"name": name, "region": region.to_json(), "shape": list(region.shape), "dtype": str(data.dtype),
                        "numel": int(data.numel()), "offset": off, "nbytes": nbytes})
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, off


def chunks(part: Part) -> Iterator[memoryview]:
    """The payload laid out as :func:`_entries` says: each tensor's bytes, then zeros to the next offset."""
    pad = bytes(ALIGN)
    for _, data in part.tensors.values():
        raw = _raw(data)
        yield memoryview(raw.numpy())
        extra = -raw.numel() % ALIGN
        if extra:
            yield memoryview(pad)[:extra]


def digest(part: Part) -> str:
    h = xxhash.xxh3_64()
    for chunk in chunks(part):
        h.update(chunk)
    return h.hexdigest()


def recv_part(conn: socket.socket, header: dict[str, Any], step: int, origin: int) -> Part:
    size = int(header["size"])
    buf = torch.empty(size, dtype=torch.uint8)
    _recv_into(conn, memoryview(buf.numpy()))
    if xxhash.xxh3_64_hexdigest(memoryview(buf.numpy())) != str(header["digest"]):
        raise PeerError(f"rank {origin}'s step {step} part arrived corrupt (its checksum differs)")
    tensors: dict[str, tuple[Region, torch.Tensor]] = {}
    for e in header["entries"]:
        dtype = _DTYPES.get(str(e["dtype"]))
        if dtype is None:
            raise PeerError(f"unknown dtype {e['dtype']!r}")
        off, n = int(e["offset"]), int(e["nbytes"])
        if off % ALIGN or off + n > size:
            raise PeerError(f"tensor {e['name']!r}: bytes {off}..{off + n} outside the payload of {size}")
        data = buf[off : off + n].view(dtype) if n else torch.empty(0, dtype=dtype)
        if data.numel() != int(e["numel"]):
            raise PeerError(f"tensor {e['name']!r}: {data.numel()} elements, header says {e['numel']}")
        tensors[str(e["name"])] = (Region.from_json(e["shape"], e["region"]), data)
    meta = header.get("meta")
    return Part(step, origin, tensors, tag=str(header.get("tag", "")), world=int(header.get("world", 0)),
                meta=meta if isinstance(meta, dict) else None)


def send_header(conn: socket.socket, header: dict[str, Any]) -> None:
    raw = json.dumps(header).encode()
    conn.sendall(_HEADER.pack(len(raw)) + raw)


def recv_header(conn: socket.socket) -> dict[str, Any]:
    head = bytearray(_HEADER.size)
    _recv_into(conn, memoryview(head))
    (n,) = _HEADER.unpack(head)
    if n > _MAX_HEADER:
        raise PeerError(f"header of {n} bytes: not a stalwart peer")
    raw = bytearray(n)
    _recv_into(conn, memoryview(raw))
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise PeerError("header is not an object")
    return obj


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise PeerError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def drain(conn: socket.socket, size: int) -> None:
    scratch = bytearray(1 << 20)
    left = size
    while left > 0:
        n = conn.recv_into(memoryview(scratch)[: min(left, len(scratch))])
        if n == 0:
            return
        left -= n
