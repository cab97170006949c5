"""GPU types `dapo plan --gpu TYPE` knows, read from `gpus.toml`
(each entry cites its datasheet)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from contracts.config import ConfigError

GPU_TABLE = Path(__file__).with_name("gpus.toml")
GPUS_PER_NODE = 8
"""HGX/DGX nodes: learner ranks and replicas within 8 GPUs talk over NVLink,
beyond over the network."""


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gib: float
    bf16_tflops: float
    """Dense bf16 tensor throughput."""
    hbm_tbs: float
    """Device memory bandwidth, TB/s."""
    nvlink_gbs: float
    """GPU-to-GPU bandwidth inside a node, GB/s one way."""
    network_gbs: float
    """Inter-node bandwidth per GPU, GB/s."""
    source: str

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbs * 1e12

    def link_bytes_per_s(self, gpus: int) -> float:
        """Bandwidth between `gpus` GPUs that work together: NVLink within a node,
        else the network."""
        return (self.nvlink_gbs if gpus <= GPUS_PER_NODE else self.network_gbs) * 1e9


@cache
def gpu_table() -> dict[str, GpuType]:
    raw = tomllib.loads(GPU_TABLE.read_text())
    return {name: GpuType(name=name, **fields) for name, fields in raw.items()}


def gpu_type(name: str) -> GpuType:
    """The GPU called `name` (case-insensitive), or a ConfigError listing the known ones."""
    table = gpu_table()
    key = name.lower()
    if key not in table:
        raise ConfigError(
            f"--gpu {name}: unknown GPU type; known: {', '.join(sorted(table))} ({GPU_TABLE.name})"
        )
    return table[key]
