"""The committed generated modules match the .proto files, and our names stay out of etcd's way."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_is_current() -> None:
    assert _gen_proto().stale_files() == []


def test_editing_a_proto_without_regenerating_is_detected(tmp_path: Path) -> None:
    copy = tmp_path / "proto"
    shutil.copytree(REPO / "proto", copy, ignore=shutil.ignore_patterns("__pycache__"))
    src = copy / "records.proto"
    src.write_text(src.read_text().replace("string hostname = 4;", "string hostname = 4;\n  string rack = 99;"))
    stale = _gen_proto().stale_files(copy)
    assert "records_pb2.py" in stale


def test_our_files_and_etcds_share_one_descriptor_pool() -> None:
    from google.protobuf import descriptor_pool
    from pyetcd import etcdrpc  # noqa: F401  (etcd's rpc.proto, kv.proto, auth.proto)

    from stalwart.proto import agent_pb2, records_pb2

    pool = descriptor_pool.Default()
    assert pool.FindFileByName("stalwart/proto/agent.proto") is agent_pb2.DESCRIPTOR
    assert pool.FindFileByName("stalwart/proto/records.proto") is records_pb2.DESCRIPTOR
    assert pool.FindFileByName("rpc.proto").package == "etcdserverpb"
    assert records_pb2.RoundRecord.DESCRIPTOR.full_name == "stalwart.v1.RoundRecord"
    assert "stalwart.v1.Agent" in agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name
