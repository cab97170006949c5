"""The learner's compute dtype (`learner.mixed_precision`): bf16 where it is asked for, or where
the device computes it natively and the setting lets it; fp32 otherwise.

bf16 is FSDP2's mixed precision: each forward and backward runs on bf16 copies of the fp32
shards, and gradients are reduced in fp32 into the fp32 shards AdamW steps, so the master
weights, the optimizer state, checkpoints and published weights never leave fp32.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

log = logging.getLogger(__name__)

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
"""`torch.cpu.get_capabilities()` flags of native bf16 arithmetic: x86's AVX512-BF16 and AMX, Arm's
BF16 and SVE-BF16 extensions. Without one, bf16 matmuls are emulated and slower than fp32."""


def native_bf16(device: torch.device) -> str | None:
    """The feature that makes bf16 native on `device` (for the log), or None where it is not."""
    if device.type == "cuda":
        return "CUDA bf16" if torch.cuda.is_bf16_supported() else None
    capabilities = torch.cpu.get_capabilities()
    return next((flag for flag in CPU_BF16_FLAGS if capabilities.get(flag) is True), None)


def mixed_precision(setting: str, device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction, or fp32 throughout (`learner.mixed_precision`);
    the choice is logged."""
    native = native_bf16(device)
    if setting == "bf16":
        bf16 = True
    elif setting == "native" or (setting == "auto" and device.type == "cuda"):
        bf16 = native is not None  # auto keeps CPUs in fp32; `native` opts them in
    else:
        bf16 = False
    if setting == "bf16" and native is None:
        log.warning(
            "learner.mixed_precision=bf16 on a %s without native bf16: emulated, slower than "
            "fp32 (learner.mixed_precision=native would pick fp32 here)",
            device.type,
        )
    log.info(
        "learner compute dtype: %s (learner.mixed_precision=%s; native bf16: %s)",
        "bf16, fp32 master weights" if bf16 else "fp32",
        setting,
        native or "none",
    )
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
