"""bench/gpu_check.py: its pure helpers, its NVML part against a stand-in NVML library, and its CPU
path end to end (tiny sizes, one subprocess). The GPU run itself is the last test, which needs CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses and the like look their module up
    spec.loader.exec_module(module)
    return module


gc_mod = _load()


# --- pure helpers ------------------------------------------------------------------------------

def test_sizes_are_parsed_as_decimal_gb() -> None:
    assert gc_mod.parse_sizes_gb("1,4,16") == [1.0, 4.0, 16.0]
    assert gc_mod.parse_sizes_gb(" 0.5G, 2GB ,") == [0.5, 2.0]
    for bad in ("", ",", "0", "-1", "abc"):
        with pytest.raises(ValueError):
            gc_mod.parse_sizes_gb(bad)


def test_rates_and_slowdown() -> None:
    assert gc_mod.gbps(2 * 10**9, 0.5) == 4.0
    assert gc_mod.gbps(10**9, 0.0) == 0.0
    assert gc_mod.slowdown_pct(1.0, 1.08) == pytest.approx(8.0)
    assert gc_mod.slowdown_pct(2.0, 1.9) == pytest.approx(-5.0)
    assert gc_mod.slowdown_pct(0.0, 1.0) == 0.0


def test_pcie_limit_per_generation_and_width() -> None:
    assert gc_mod.pcie_limit_gbps(5, 16) == pytest.approx(63.02, abs=0.01)
    assert gc_mod.pcie_limit_gbps(4, 16) == pytest.approx(31.51, abs=0.01)
    assert gc_mod.pcie_limit_gbps(3, 8) == pytest.approx(7.88, abs=0.01)
    assert gc_mod.pcie_limit_gbps(1, 1) == pytest.approx(0.25)
    assert gc_mod.pcie_limit_gbps(None, 16) is None
    assert gc_mod.pcie_limit_gbps(9, 16) is None
    assert gc_mod.pcie_limit_gbps(5, 0) is None


def test_throttle_reasons_name_each_bit() -> None:
    names = {1: "GpuIdle", 4: "SwPowerCap", 8: "HwSlowdown"}
    assert gc_mod.throttle_reasons(0, names) == []
    assert gc_mod.throttle_reasons(1 | 8, names) == ["GpuIdle", "HwSlowdown"]
    assert gc_mod.throttle_reasons(4 | 0x100, names) == ["SwPowerCap", "0x100"]


def test_table_aligns_numbers_right_and_text_left() -> None:
    text = gc_mod.format_table(["method", "ms", "ok"], [["torch_save", 1234.5678, True], ["dcp", 2.0, None]])
    lines = text.splitlines()
    assert lines[0].split() == ["method", "ms", "ok"]
    assert lines[2].startswith("torch_save") and "1235" in lines[2] and "True" in lines[2]
    assert lines[3].startswith("dcp ") and lines[3].rstrip().endswith("-")
    # the number column is right-aligned: its cells end where its header ends
    end = lines[0].index("ms") + 2
    assert lines[2][:end].endswith("1235") and lines[3][:end].endswith("2")


def test_budget_fails_fast_with_the_part_named() -> None:
    now = [0.0]
    budget = gc_mod.Budget("snapshot", 10.0, clock=lambda: now[0])
    budget.check("1 GB")
    now[0] = 10.5
    with pytest.raises(gc_mod.PartTimeout, match=r"'snapshot' exceeded its budget of 10 s \(at 4 GB\)"):
        budget.check("4 GB")

    def slow(b: Any) -> dict[str, Any]:
        b.check("16 GB")
        return {"results": {}}

    out = gc_mod.run_part("snapshot", slow, budget)
    assert out["error"].startswith("PartTimeout: part 'snapshot' exceeded") and "seconds" in out
    assert gc_mod.run_part("x", lambda b: {"skipped": "no CUDA device"}, budget)["skipped"] == "no CUDA device"


def test_slowdown_cause_names_the_half_that_costs() -> None:
    base = {"launch_alone_s": 0.01}
    assert gc_mod.slowdown_cause({**base, "after_save_pct": 0.5}, cuda=True).startswith("none")
    copy = gc_mod.slowdown_cause({**base, "after_save_pct": 8.0, "copy_only_pct": 7.5, "persist_only_pct": 0.3},
                                 cuda=True)
    assert "device-to-host copy" in copy and "persist" not in copy
    gil = gc_mod.slowdown_cause({**base, "after_save_pct": 8.0, "copy_only_pct": 0.1, "persist_only_pct": 7.0,
                                 "launch_persist_only_s": 0.5}, cuda=True)
    assert "GIL" in gil
    host = gc_mod.slowdown_cause({**base, "after_save_pct": 8.0, "copy_only_pct": 0.1, "persist_only_pct": 7.0,
                                  "launch_persist_only_s": 0.012}, cuda=True)
    assert "persist thread" in host and "GIL" not in host
    wait = gc_mod.slowdown_cause({**base, "after_save_pct": 8.0, "copy_only_pct": 0.1, "persist_only_pct": 0.1},
                                 cuda=True)
    assert "waiting on the save's copy" in wait
    assert gc_mod.slowdown_cause({"after_save_pct": 50.0, "persist_only_pct": 40.0}, cuda=False).startswith("CPU")


def test_digests_are_bitwise() -> None:
    from stalwart.ckpt import Shard

    a = {"w": torch.tensor([0.0, 1.0]), "s": Shard.flat(torch.arange(4, dtype=torch.bfloat16), [8], 4)}
    same = {"w": torch.tensor([0.0, 1.0]), "s": Shard.flat(torch.arange(4, dtype=torch.bfloat16), [8], 4)}
    assert gc_mod.compare_digests(gc_mod.state_digests(a), gc_mod.state_digests(same)) == []
    signed = {**same, "w": torch.tensor([-0.0, 1.0])}  # equal as numbers, not as bits
    assert gc_mod.compare_digests(gc_mod.state_digests(a), gc_mod.state_digests(signed)) == ["w"]
    other_dtype = {**same, "w": torch.tensor([0.0, 1.0], dtype=torch.float64)}
    assert gc_mod.compare_digests(gc_mod.state_digests(a), gc_mod.state_digests(other_dtype)) == ["w"]
    missing = {"w": same["w"], "extra": torch.zeros(1)}
    assert gc_mod.compare_digests(gc_mod.state_digests(a), gc_mod.state_digests(missing)) == ["extra", "s"]


# --- the NVML part against a stand-in library ---------------------------------------------------

def _fake_nvml(xid: int | None = 79) -> types.ModuleType:
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's names
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801
        pass

    class NVMLError_GPUIsLost(NVMLError):  # noqa: N801
        pass

    events = [types.SimpleNamespace(device="h0", eventData=xid)] if xid is not None else []

    def wait(_set: object, _ms: int) -> Any:
        if events:
            return events.pop()
        raise NVMLError_Timeout()

    def unsupported(*_: object) -> Any:
        raise NVMLError_NotSupported()

    m.__dict__.update(
        NVMLError=NVMLError, NVMLError_NotSupported=NVMLError_NotSupported, NVMLError_Timeout=NVMLError_Timeout,
        NVMLError_GPUIsLost=NVMLError_GPUIsLost, nvmlEventTypeXidCriticalError=8,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0, NVML_TEMPERATURE_GPU=0,
        nvmlClocksEventReasonGpuIdle=1, nvmlClocksEventReasonSwPowerCap=4, nvmlClocksEventReasonAll=0xFF,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}", nvmlEventSetCreate=lambda: "set",
        nvmlEventSetFree=lambda s: None, nvmlDeviceRegisterEvents=lambda h, kind, s: None, nvmlEventSetWait=wait,
        nvmlDeviceGetIndex=lambda h: int(h[1:]), nvmlDeviceGetUUID=lambda h: "GPU-0",
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 0, nvmlDeviceGetRetiredPagesPendingStatus=unsupported,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, 0, 0), nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 5, nvmlDeviceGetCurrPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 5, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetPcieReplayCounter=unsupported, nvmlDeviceGetEccMode=lambda h: (1, 1),
        nvmlDeviceGetTemperature=lambda h, sensor: 41, nvmlDeviceGetPowerUsage=lambda h: 123_000,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=141 * 10**9),
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 1 | 4,
    )  # fmt: skip
    return m


def _ctx(cuda: bool = False, gpus: int = 1) -> Any:
    return types.SimpleNamespace(cuda=cuda, gpus=gpus, pcie_gbps=None)


def test_nvml_part_reports_what_the_agent_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(xid=79))
    ctx = _ctx()
    out = gc_mod.part_nvml(ctx, gc_mod.Budget("nvml", 30))
    r = out["results"]
    assert r["probe"] == "nvml" and r["devices"] == 1
    assert r["verdict"] == "FATAL"  # Xid 79 (fallen off the bus) is sticky and fatal
    assert [f["code"] for f in r["findings"]] == ["xid-79"]
    fields = r["fields"][0]
    assert fields["name"] == "NVIDIA H200" and fields["pcie_gen"] == 5 and fields["pcie_width"] == 16
    assert fields["pcie_replay_counter"] == "unsupported"
    assert fields["throttle_reasons"] == ["GpuIdle", "SwPowerCap"]  # the "All" mask is not a reason
    assert fields["power_w"] == 123.0 and fields["ecc_dbe_volatile"] == 0
    assert ctx.pcie_gbps == pytest.approx(63.02, abs=0.01) and r["pcie_limit_GBps"] == ctx.pcie_gbps
    gc_mod.print_nvml(out)


def test_nvml_part_on_a_healthy_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(xid=None))
    r = gc_mod.part_nvml(_ctx(), gc_mod.Budget("nvml", 30))["results"]
    assert r["verdict"] == "OK" and r["findings"] == []


def test_nvml_part_without_nvml_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: no nvidia-ml-py
    out = gc_mod.part_nvml(_ctx(cuda=False, gpus=0), gc_mod.Budget("nvml", 30))
    assert out["skipped"].startswith("no CUDA device; no NVML") and "nvidia-ml-py" in out["skipped"]
    assert out["fallback"] == {"probe": "fake", "verdict": "OK", "findings": []}


def test_abort_part_on_one_gpu_says_it_needs_two() -> None:
    assert gc_mod.part_abort(_ctx(cuda=True, gpus=1), gc_mod.Budget("abort", 30)) == {
        "skipped": "one GPU: NCCL abort needs two"}


def test_bad_arguments_are_refused_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert gc_mod.main(["--device", "cpu", "--skip", "snapshot,bogus"]) == 2
    assert "unknown parts ['bogus']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert gc_mod.main(["--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


# --- end to end --------------------------------------------------------------------------------

def _run(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dir", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    assert out.exists(), f"no report; rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def test_cpu_path_end_to_end(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, "--device", "cpu", "--sizes", "0.002,0.004")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    parts = report["parts"]
    assert set(parts) == {"nvml", "snapshot", "replica", "trainer", "abort"}
    for name, part in parts.items():
        assert ("results" in part) != ("skipped" in part), (name, part)
        assert "error" not in part, (name, part["error"])
        if "skipped" in part:
            assert part["skipped"].strip(), name
    if "skipped" in parts["nvml"]:
        assert "NVML" in parts["nvml"]["skipped"]
    sizes = parts["snapshot"]["results"]["sizes"]
    assert [s["bytes"] for s in sizes] == [2_000_000, 4_000_000]
    for s in sizes:
        for key in ("torch_save", "dcp_async_save", "stalwart_blocking", "stalwart_overlap"):
            assert s[key]["stall_s"] > 0 and s[key]["durable_s"] >= s[key]["stall_s"]
        d = s["step_slowdown"]
        assert d["step_alone_s"] > 0 and "after_save_pct" in d and "persist_only_pct" in d and d["cause"]
        assert "copy_only_pct" not in d  # there is no device-to-host copy on the CPU
    gil = parts["snapshot"]["results"]["gil_left_to_training"]
    assert set(gil) == {"encode_random", "encode_zeros", "python_loop"} and all(v > 0 for v in gil.values())
    for s in parts["replica"]["results"]["sizes"]:
        assert s["second_hop"] == "host -> host (no CUDA device)" and s["host_copy_GBps"] > 0
    trainer = parts["trainer"]["results"]
    assert trainer["bitwise_equal"] is True and trainer["restored_step"] == trainer["steps"] == 6
    assert trainer["tensors"] > 0 and trainer["differ"] == [] and trainer["restore_disk_bytes"] > 0
    abort = parts["abort"]["results"]
    assert abort["backend"] == "gloo" and abort["error"] and "needs two GPUs" in abort["note"]
    assert [row[0] for row in report["summary"]] == ["nvml", "snapshot", "replica", "trainer", "abort"]
    assert "== summary" in proc.stdout and "bitwise equal: True" in proc.stdout


def test_a_part_past_its_budget_fails_fast_and_the_run_says_so(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, "--device", "cpu", "--sizes", "0.001", "--skip", "trainer,abort",
                        "--budget-scale", "0.00001")
    assert proc.returncode == 1
    for name in ("snapshot", "replica"):
        assert "exceeded its budget" in report["parts"][name]["error"], report["parts"][name]
    assert "FAILED" in proc.stdout and report["parts"]["trainer"]["skipped"] == "skipped by --skip"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU run needs one")
def test_gpu_run_small(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, "--device", "cuda", "--sizes", "0.1", timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    parts = report["parts"]
    assert "results" in parts["nvml"], parts["nvml"]
    assert parts["trainer"]["results"]["bitwise_equal"] is True
    assert "copy_only_pct" in parts["snapshot"]["results"]["sizes"][0]["step_slowdown"]
    if torch.cuda.device_count() < 2:
        assert parts["abort"] == {"skipped": "one GPU: NCCL abort needs two", "seconds": parts["abort"]["seconds"]}
