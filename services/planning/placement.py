"""Which GPUs each process of `dapo run` gets, decided before anything starts.

On a machine with N GPUs the learner's ranks take the first `learner.nproc` GPUs and each rollout
replica the next `rollout.tensor_parallel_size`, so no two processes share a device (NCCL
refuses two ranks on one GPU, and a vLLM replica sizes its KV cache as a share of the whole
device). A config that needs more GPUs than the machine has is refused, naming the numbers.
One exception, for a single-GPU machine: one learner rank and one replica (tensor-parallel 1)
may share GPU 0 when the weight broadcast uses gloo (`learner.weights_backend: gloo`) and the
replica leaves room for the learner (`rollout.gpu_memory_utilization` below 0.5).
Reward workers, the gatekeeper and the API get no GPU. Without GPUs everything runs on the CPU.

Each process sees only its devices through CUDA_VISIBLE_DEVICES, so the code inside always
uses cuda:0 (and cuda:0..tp-1 for a tensor-parallel replica).
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.config import ConfigError, DapoConfig


class PlacementError(ConfigError):
    """The config does not fit the machine; the message says which numbers don't add up."""


@dataclass(frozen=True)
class Placement:
    gpus: int
    learner: tuple[int, ...]
    """GPU indices of the learner's ranks (empty: CPU)."""
    replicas: tuple[tuple[int, ...], ...]
    """GPU indices of each rollout replica (empty tuples: CPU)."""
    shared: bool = False
    """The single-GPU case: learner and replica on GPU 0."""

    def visible_devices(self, service: str) -> str:
        """CUDA_VISIBLE_DEVICES for a service `dapo run` starts (`learner`, `rollout-3`, ...)."""
        if service == "learner":
            return _ids(self.learner)
        if service.startswith("rollout-"):
            return _ids(self.replicas[int(service.split("-")[1])])
        return ""

    def describe(self) -> str:
        if not self.gpus:
            return "no GPU: every process runs on the CPU"
        lines = [
            f"{self.gpus} GPUs" + (" (learner and replica share GPU 0)" if self.shared else "")
        ]
        lines.append(f"  learner ({len(self.learner)} ranks): GPUs {_ids(self.learner)}")
        lines += [f"  rollout-{i}: GPUs {_ids(gpus)}" for i, gpus in enumerate(self.replicas)]
        idle = self.gpus - len(set(self.learner).union(*map(set, self.replicas)))
        if idle:
            lines.append(f"  {idle} GPU(s) unused")
        return "\n".join(lines)


def _ids(gpus: tuple[int, ...]) -> str:
    return ",".join(str(g) for g in gpus)


def plan(cfg: DapoConfig, gpus: int) -> Placement:
    """Disjoint GPUs for the learner ranks and the replicas, or PlacementError."""
    nproc, replicas, tp = cfg.learner.nproc, cfg.rollout.replicas, cfg.rollout.tensor_parallel_size
    if gpus == 0:
        if tp > 1:
            raise PlacementError(
                f"rollout.tensor_parallel_size={tp} needs GPUs; this machine has none"
            )
        return Placement(0, (), tuple(() for _ in range(replicas)))
    needed = nproc + replicas * tp
    if needed <= gpus:
        learner = tuple(range(nproc))
        return Placement(
            gpus,
            learner,
            tuple(tuple(range(nproc + i * tp, nproc + (i + 1) * tp)) for i in range(replicas)),
        )
    if gpus == 1 and nproc == 1 and replicas == 1 and tp == 1:
        return _shared(cfg)
    raise PlacementError(
        f"learner.nproc={nproc} + rollout.replicas={replicas} x rollout.tensor_parallel_size={tp} "
        f"= {needed} GPUs, but this machine has {gpus}: lower one of them (each process needs its "
        "own GPUs)"
    )


def _shared(cfg: DapoConfig) -> Placement:
    problems = []
    if cfg.learner.weights_backend != "gloo":
        problems.append(
            f"learner.weights_backend={cfg.learner.weights_backend} (NCCL refuses two ranks on one "
            "GPU; use gloo)"
        )
    if cfg.rollout.gpu_memory_utilization >= 0.5:
        problems.append(
            f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} (leave the "
            "learner room: < 0.5)"
        )
    if problems:
        raise PlacementError(
            "one GPU shared by the learner and a replica needs " + "; ".join(problems)
        )
    return Placement(1, (0,), ((0,),), shared=True)


def gpu_memory_of_this_machine() -> float | None:
    """GiB of GPU 0, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory) / 2**30


def count_gpus() -> int:
    """GPUs this machine has (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
