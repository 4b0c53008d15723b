"""Property: a manifest changed by random structural edits (its digest recomputed, as a forger or
a buggy writer would) is either refused with a checkpoint error or loads exactly the saved values.
Nothing else may come out of ``read_manifest``, ``load`` or ``verify``: no other exception type,
no wrong tensor."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from ckpt_testlib import SPECS, check_targets, rank_state, rank_targets, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.ckpt import (
    Checkpointer,
    CheckpointError,
    CodecPolicy,
    SaveConfig,
    SingleCoordinator,
    load,
    read_manifest,
    verify,
)
from stalwart.ckpt.format import MANIFEST_NAME, canonical_json, step_dir_name

SCHEMES = {"w32": "cols", "h16": "rows", "ids": "flat", "bf": "flat"}
Path = tuple[Any, ...]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """Step 1 saved by a world of two, mixed layouts, raw and zstd chunks; its manifest document."""
    root = str(tmp_path_factory.mktemp("fuzz"))
    config = SaveConfig(chunk_bytes=4096, compression=CodecPolicy(mode="zstd"), retention=None)

    def rank(r, coord):  # type: ignore[no-untyped-def]
        with Checkpointer(root, config, coordinator=coord) as ckpt:
            ckpt.save(1, rank_state(SPECS, SCHEMES, 1, 2, r), {"rank": r, "blob": b"\x00\x01"}).result()

    run_ranks(2, rank)
    with open(os.path.join(root, step_dir_name(1), MANIFEST_NAME), "rb") as f:
        return root, json.loads(f.read())


def _nodes(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _nodes(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _nodes(item, (*path, index))


def _get(root: Any, path: Path) -> Any:
    for key in path:
        root = root[key]
    return root


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from(["rank-00000.bin", "rank-00001.bin", "raw", "zstd", "float32", "flat"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
EDITS = ["delete", "replace", "tweak", "duplicate", "swap", "wrap", "rename", "transplant", "shift"]


def _edit(content: dict[str, Any], data: st.DataObject) -> str:
    """Apply one random structural edit in place; returns a description for the failure report."""
    nodes = list(_nodes(content))[1:]  # not the root itself
    kind = data.draw(st.sampled_from(EDITS))
    if kind == "shift":  # move a part to other elements of its tensor, keeping its size
        regions = [v for _, v in nodes if isinstance(v, dict) and ("flat" in v or "offsets" in v)]
        if not regions:
            return "shift without regions (no-op)"
        region = data.draw(st.sampled_from(regions))
        delta = data.draw(st.sampled_from([-10, -1, 1, 3, 10]))
        bounds = region.get("flat") or region.get("offsets")
        if not isinstance(bounds, list) or not all(isinstance(b, int) for b in bounds) or not bounds:
            return "shift of a damaged region (no-op)"
        if "flat" in region:
            region["flat"] = [b + delta for b in bounds]
        else:
            dim = data.draw(st.integers(0, len(bounds) - 1))
            region["offsets"] = [b + delta if d == dim else b for d, b in enumerate(bounds)]
        return f"shift of {region} by {delta}"
    path, value = nodes[data.draw(st.integers(0, len(nodes) - 1))]
    parent = _get(content, path[:-1])
    key = path[-1]
    if kind == "delete":
        del parent[key]
    elif kind == "replace":
        parent[key] = data.draw(JSON_VALUES)
    elif kind == "tweak":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"tweak of a non-integer at {path} (no-op)"
        parent[key] = data.draw(st.sampled_from([value + 1, value - 1, value + 4, value - 4, value * 2, 0, -1,
                                                  value + 4096, 2**63]))
    elif kind == "duplicate" and isinstance(value, list) and value:
        value.insert(data.draw(st.integers(0, len(value))), copy.deepcopy(data.draw(st.sampled_from(value))))
    elif kind == "swap" and isinstance(value, list) and len(value) > 1:
        i, j = data.draw(st.integers(0, len(value) - 1)), data.draw(st.integers(0, len(value) - 1))
        value[i], value[j] = value[j], value[i]
    elif kind == "wrap":
        parent[key] = [value]
    elif kind == "rename" and isinstance(parent, dict):
        new = data.draw(st.sampled_from([*parent.keys(), "x", "w32", "rank-00001.bin", "flat", "offsets"]))
        parent[new] = parent.pop(key)
    elif kind == "transplant":  # a value of the same type from elsewhere in the manifest
        same = [v for p, v in nodes if type(v) is type(value) and p != path]
        if same:
            parent[key] = copy.deepcopy(data.draw(st.sampled_from(same)))
    else:
        return f"{kind} at {path} (no-op)"
    return f"{kind} at {path}"


def _write(root: str, doc: dict[str, Any]) -> None:
    version = doc["format_version"]
    doc = dict(doc, digest=xxhash.xxh3_128_hexdigest(canonical_json({"format_version": version,
                                                                        "content": doc["content"]})))
    with open(os.path.join(root, step_dir_name(1), MANIFEST_NAME), "wb") as f:
        f.write(canonical_json(doc))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(data=st.data())
def test_edited_manifests_are_refused_or_load_exactly(saved: tuple[str, dict[str, Any]], data: st.DataObject) -> None:
    root, original = saved
    doc = copy.deepcopy(original)
    edits = [_edit(doc["content"], data) for _ in range(data.draw(st.integers(1, 3)))]
    _write(root, doc)
    try:
        try:
            read_manifest(root, 1)
        except CheckpointError:
            pass
        targets = rank_targets(SPECS, SCHEMES, 1, 0)
        try:
            load(root, targets, step=1, coordinator=SingleCoordinator())
        except CheckpointError:
            pass
        else:
            assert check_targets(SPECS, targets, 1) == [], f"wrong values after {edits}"
        report = verify(root, 1, mark=False)
        assert all(isinstance(p, CheckpointError) for p in report.problems)
    finally:
        _write(root, original)


def test_the_unedited_manifest_loads(saved: tuple[str, dict[str, Any]]) -> None:
    root, original = saved
    _write(root, original)
    targets = rank_targets(SPECS, SCHEMES, 1, 0)
    assert load(root, targets, step=1, coordinator=SingleCoordinator()).step == 1
    assert check_targets(SPECS, targets, 1) == []
    assert verify(root, 1, mark=False).ok
