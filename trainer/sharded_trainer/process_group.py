"""This process's place in the job: the process group (nccl with GPUs, gloo on CPU), its rank and device."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sharded_api.contract import PodEnv, WorkerEnv


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world: int
    backend: str
    device: torch.device
    local_world: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend nccl was requested but no CUDA device is visible; use backend auto or gloo")
    return requested


def init_distributed(requested_backend: str, timeout_s: float = 600) -> DistEnv:
    """Join the process group torchrun set up (or a world of one when run directly)."""
    if WorkerEnv.RANK not in os.environ:  # plain `python -m sharded_trainer`: a world of one
        os.environ.update(
            {
                WorkerEnv.RANK: "0", WorkerEnv.LOCAL_RANK: "0", WorkerEnv.WORLD_SIZE: "1",
                PodEnv.MASTER_ADDR: "127.0.0.1", PodEnv.MASTER_PORT: str(_free_port()),
            }
        )  # fmt: skip
    rank, world = int(os.environ[WorkerEnv.RANK]), int(os.environ[WorkerEnv.WORLD_SIZE])
    local_rank = int(os.environ.get(WorkerEnv.LOCAL_RANK, "0"))
    local_world = int(os.environ.get(WorkerEnv.LOCAL_WORLD_SIZE, "1"))
    backend = resolve_backend(requested_backend)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # DeepSpeed picks its accelerator at import time from this variable.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=backend, timeout=datetime.timedelta(seconds=timeout_s), rank=rank, world_size=world, **kwargs
    )
    return DistEnv(
        rank=rank, local_rank=local_rank, world=world, backend=backend, device=device, local_world=local_world
    )


def any_true(flag: bool, device: torch.device, group=None) -> bool:
    """True on every rank if `flag` is true on any rank (one tiny all-reduce), so all ranks act together."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item() == 1


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
