"""GPU health probes behind one interface: NVML on GPU machines, a fake one elsewhere.

A probe turns what the hardware says into :class:`Finding` records, each classified FATAL (the
node must leave the world: its GPU can no longer be trusted) or TRANSIENT (worth reporting, no
reason to exclude the node). The agent polls the probe about every second and publishes the
verdict: the worst state among the current findings.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Severity(IntEnum):
    """Ordered so that ``max()`` of findings is the node's verdict. Values match ``HealthState``."""

    OK = 1
    TRANSIENT = 2
    FATAL = 3


@dataclass(frozen=True)
class Finding:
    source: str  # "nvml", "fake", "worker", "stall"
    device: int
    severity: Severity
    code: str  # "xid-79", "ecc-dbe", "gpu-lost", "retired-pages-pending", ...
    detail: str = ""
    round: int = 0  # worker and stall findings: the round whose workers failed


# Xid codes from NVIDIA's Xid catalogue that mean the GPU's state is lost or its memory can no
# longer be trusted. Others (application faults such as 13, 31, 43) are reported as transient.
FATAL_XIDS = {
    48: "double-bit ECC error",
    64: "row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC rate",
    95: "uncontained ECC error",
}
TRANSIENT_XIDS = {
    63: "row remapping pending (reset to apply)",
    94: "contained ECC error (the affected application was stopped)",
}


def classify_xid(code: int, device: int, source: str) -> Finding:
    if code in FATAL_XIDS:
        return Finding(source, device, Severity.FATAL, f"xid-{code}", FATAL_XIDS[code])
    detail = TRANSIENT_XIDS.get(code, "reported by the driver")
    return Finding(source, device, Severity.TRANSIENT, f"xid-{code}", detail)


def verdict(findings: list[Finding]) -> Severity:
    return max((f.severity for f in findings), default=Severity.OK)


class HealthProbe(Protocol):
    """What the agent needs from a probe. ``poll`` never raises: a broken probe is a finding."""

    name: str

    def poll(self) -> list[Finding]:
        """The findings that hold now (sticky ones stay until cleared)."""
        ...

    def close(self) -> None: ...


class FakeProbe:
    """A probe for machines without GPUs; faults arrive through the agent's fault-injection call."""

    name = "fake"

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self._findings: list[Finding] = []
        self._lock = threading.Lock()
        self._answering = threading.Event()  # cleared: polls block, as in a hung driver call
        self._answering.set()

    def hang(self) -> None:
        """Every poll from now on blocks until :meth:`clear` (or :meth:`close`)."""
        self._answering.clear()

    def inject(self, kind: str, device: int = 0, code: int = 0) -> Finding:
        """``kind``: "xid" (with ``code``), "ecc-dbe" or "gpu-lost"."""
        if not 0 <= device < max(self.devices, 1):
            raise ValueError(f"device {device} out of range 0..{self.devices - 1}")
        if kind == "xid":
            finding = classify_xid(code, device, self.name)
        elif kind == "ecc-dbe":
            finding = Finding(self.name, device, Severity.FATAL, "ecc-dbe", "volatile double-bit ECC errors")
        elif kind == "gpu-lost":
            finding = Finding(self.name, device, Severity.FATAL, "gpu-lost", "GPU is lost")
        else:
            raise ValueError(f"unknown fake fault kind {kind!r}")
        with self._lock:
            self._findings.append(finding)
        return finding

    def clear(self) -> None:
        with self._lock:
            self._findings.clear()
        self._answering.set()

    def poll(self) -> list[Finding]:
        self._answering.wait()
        with self._lock:
            return list(self._findings)

    def close(self) -> None:
        self._answering.set()


class ProbeUnavailable(RuntimeError):
    """The health probe asked for cannot run here (no NVML library, no nvidia-ml-py)."""


class NvmlProbe:
    """Reads NVML (the ``nvidia-ml-py`` package): Xid events, volatile double-bit ECC counts,
    pending page retirement and row remapping failures, and lost GPUs.

    Xid events are sticky: once seen, a fatal Xid stays a finding until the agent restarts
    (the GPU needs a reset). Counters are read on every poll.
    """

    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml  # imported here: only GPU machines need it (the optional stalwart[gpu])
        except ImportError:
            raise ProbeUnavailable("the NVML probe needs the nvidia-ml-py package: "
                                   "pip install 'stalwart[gpu]'") from None

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self.devices = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.devices)]
        self._sticky: list[Finding] = []
        self._events: Any = pynvml.nvmlEventSetCreate()
        for i, handle in enumerate(self._handles):
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
            except pynvml.NVMLError as exc:  # not supported on some boards: counters still work
                log.warning("nvml: GPU %d: Xid events unavailable: %s", i, exc)

    def _index_of(self, handle: Any) -> int:
        for i, h in enumerate(self._handles):
            if self._nvml.nvmlDeviceGetIndex(h) == self._nvml.nvmlDeviceGetIndex(handle):
                return i
        return -1

    def _drain_events(self) -> None:
        nvml = self._nvml
        while True:
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError_Timeout:
                return
            except nvml.NVMLError as exc:
                self._sticky.append(Finding(self.name, -1, Severity.TRANSIENT, "nvml-error", str(exc)))
                return
            device = self._index_of(data.device)
            finding = classify_xid(int(data.eventData), device, self.name)
            log.error("nvml: GPU %d: Xid %d (%s)", device, data.eventData, finding.detail)
            self._sticky.append(finding)

    def _device_findings(self, i: int, handle: Any) -> list[Finding]:
        nvml = self._nvml
        found: list[Finding] = []
        try:
            nvml.nvmlDeviceGetUUID(handle)  # cheapest call that fails with GPU_IS_LOST
        except nvml.NVMLError_GPUIsLost:
            return [Finding(self.name, i, Severity.FATAL, "gpu-lost", "GPU is lost")]
        except nvml.NVMLError as exc:
            return [Finding(self.name, i, Severity.TRANSIENT, "nvml-error", str(exc))]
        try:
            dbe = nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                   nvml.NVML_VOLATILE_ECC)
            if dbe > 0:
                found.append(Finding(self.name, i, Severity.FATAL, "ecc-dbe", f"{dbe} volatile double-bit ECC errors"))
        except nvml.NVMLError_NotSupported:
            pass
        except nvml.NVMLError as exc:
            found.append(Finding(self.name, i, Severity.TRANSIENT, "nvml-error", f"ECC: {exc}"))
        try:
            if nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                found.append(Finding(self.name, i, Severity.TRANSIENT, "retired-pages-pending",
                                     "page retirement pending: reset the GPU when drained"))
        except nvml.NVMLError:
            pass  # not supported on GPUs that remap rows instead
        try:
            _, _, pending, failure = nvml.nvmlDeviceGetRemappedRows(handle)
            if failure:
                found.append(Finding(self.name, i, Severity.FATAL, "row-remap-failure", "row remapping failed"))
            elif pending:
                found.append(Finding(self.name, i, Severity.TRANSIENT, "row-remap-pending",
                                     "row remapping pending: reset the GPU when drained"))
        except nvml.NVMLError:
            pass  # pre-Ampere GPUs
        return found

    def poll(self) -> list[Finding]:
        try:
            self._drain_events()
            findings = list(self._sticky)
            for i, handle in enumerate(self._handles):
                findings.extend(self._device_findings(i, handle))
            return findings
        except Exception as exc:  # a probe must never take the agent down
            log.exception("nvml probe failed")
            return [Finding(self.name, -1, Severity.TRANSIENT, "probe-error", str(exc))]

    def close(self) -> None:
        try:
            self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except Exception:  # shutting down: nothing to do about it
            pass


def make_probe(kind: str, devices: int) -> HealthProbe:
    """``kind``: "nvml", "fake" or "auto" (NVML when it initialises, else fake)."""
    if kind == "fake":
        return FakeProbe(devices)
    if kind in ("nvml", "auto"):
        try:
            return NvmlProbe()
        except Exception as exc:
            if kind == "nvml":
                raise ProbeUnavailable(f"probe = \"nvml\": unavailable: {exc}") from exc
            log.info("no NVML (%s); using the fake health probe", exc)
            return FakeProbe(devices)
    raise ValueError(f"unknown health probe {kind!r}; use nvml, fake or auto")
