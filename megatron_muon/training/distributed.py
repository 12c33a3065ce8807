"""Process-group and parallel_state setup for one training run: torchrun/srun env or a lone process, GPU or CPU.

The same code runs on GPUs (NCCL) and on CPU (gloo + CPU mode); a single process started without a launcher
makes its own 1-rank group on a free local port, so `megatron-muon pretrain` works without torchrun.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch


def free_port() -> int:
    """A TCP port that is free on localhost right now (for MASTER_PORT / torchrun --master-port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launched_world_size() -> int:
    """World size the launcher announced (torchrun's WORLD_SIZE, srun's SLURM_NTASKS), 1 when run directly."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "MASTER_ADDR" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return 1


def launched_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


@dataclass(frozen=True)
class RunContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_name: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _export_launcher_env() -> None:
    """Fill torch's env:// variables from srun, or for a lone process, so init_process_group sees one scheme."""
    if "WORLD_SIZE" not in os.environ and launched_world_size() > 1:  # srun without torchrun
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("MASTER_PORT", "29500")
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="localhost")
        os.environ["MASTER_PORT"] = str(free_port())


def init_distributed(tp: int, pp: int, seed: int, torch_compile: bool) -> RunContext:
    """Start the process group and megatron's parallel_state for this (tp, pp) layout; returns who we are."""
    _export_launcher_env()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device, device_name, backend = torch.device("cuda", local_rank), torch.cuda.get_device_name(local_rank), "nccl"
    else:
        from megatron_muon._cpu import enable_cpu_mode

        enable_cpu_mode()
        if not torch_compile:  # megatron's jit_fuser would otherwise compile on CPU for tens of seconds
            from torch import _dynamo

            _dynamo.config.disable = True
        device, device_name, backend = torch.device("cpu"), "cpu", "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, init_method="env://")

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return RunContext(
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        local_rank=local_rank,
        device=device,
        device_name=device_name,
    )


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
