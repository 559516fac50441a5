"""One process or many: `torchrun --nproc_per_node=N gpt2attn train ...` runs DDP (gloo on CPU,
NCCL on CUDA), or FSDP2 (`fully_shard`) with `--fsdp`. Without torchrun's variables everything is a no-op."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda asked for, but torch sees no CUDA GPU")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def setup(device_name: str) -> tuple[Dist, torch.device]:
    """Join torchrun's process group when its environment is set; returns (dist info, device)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Dist(), pick_device(device_name)
    info = Dist(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world_size)
    device = pick_device(device_name, info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info, device


def wrap(model: nn.Module, info: Dist, device: torch.device, fsdp: bool) -> nn.Module:
    """DDP around model, or FSDP (fully_shard: each block's weights split over the processes,
    in place), when there are several processes; model itself otherwise."""
    if not info.enabled:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (info.world_size,))
        for block in model.base_model.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def no_gradient_sync(wrapped: nn.Module, info: Dist, fsdp: bool):
    """Accumulate this micro-batch's gradients locally, without the all-reduce."""
    if not info.enabled:
        yield
    elif fsdp:
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
    else:
        with wrapped.no_sync():
            yield


def mean_over_processes(value: torch.Tensor, info: Dist) -> torch.Tensor:
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value /= info.world_size
    return value


def raise_together(error: Exception | None, info: Dist) -> None:
    """After a step only the main process ran: if it failed, every process raises (the main
    process its own error, the others a short one), instead of the others waiting forever."""
    if info.enabled:
        message = [None if error is None else str(error)]
        dist.broadcast_object_list(message, src=0)  # also a barrier
        if error is None and message[0] is not None:
            raise ValueError(f"the main process failed: {message[0]}")
    if error is not None:
        raise error


def barrier(info: Dist) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: Dist) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def gather_full_state(wrapped: nn.Module, optimizer: torch.optim.Optimizer, like: nn.Module):
    """FSDP: the whole model (a copy of `like` holding the gathered weights, on the CPU) and
    the whole optimizer state, for checkpoints, in the main process (None elsewhere). Every
    process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(wrapped, optimizer, options=options)
    if not model_state:  # with cpu_offload only the main process receives the state
        return None, None
    full = type(like)(like.config)
    full.load_state_dict(model_state)
    return full, optimizer_state


def load_sharded_optimizer(wrapped: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """FSDP: give each process its shard of a full optimizer state from gather_full_state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(wrapped, optimizer, state, options=StateDictOptions(full_state_dict=True))
