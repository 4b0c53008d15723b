"""fp16 under DeepSpeed's CPU accelerator on any x86 CPU, for tests of fp16 behaviour.

DeepSpeed refuses ``fp16.enabled`` on the CPU unless oneDNN reports native fp16 support (AVX512-FP16
or AMX-FP16, e.g. Sapphire Rapids); an AMD EPYC has neither. PyTorch still computes in fp16 there
(more slowly), and what the tests exercise is DeepSpeed's own fp16 machinery (the loss scaler,
overflow checks, fp16 <-> fp32 master weights), so the tests lift only that capability check.

    python cpu_fp16.py SCRIPT ARGS...    run SCRIPT as ``__main__`` with fp16 allowed
"""

from __future__ import annotations

import runpy
import sys

import torch


def allow_fp16_on_cpu() -> bool:
    """Make DeepSpeed's CPU accelerator accept fp16; returns whether that changed anything."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return False
    cls = type(acc)
    cls.is_fp16_supported = lambda self: True  # type: ignore[method-assign]
    cls.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]  # type: ignore[method-assign]
    return True


if __name__ == "__main__":
    allow_fp16_on_cpu()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
