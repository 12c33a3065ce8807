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


def _rendezvous() -> tuple[str, dict]:
    """How this process joins its group, read from the launcher's environment (never written): torchrun's env://
    (its agent may already host the store), srun's task variables with MASTER_ADDR, or a lone process on a free
    local port."""
    if "WORLD_SIZE" in os.environ:  # torchrun (or a caller that set the env:// variables itself)
        return "env://", {}
    if launched_world_size() > 1:  # srun without torchrun
        port = os.environ.get("MASTER_PORT", "29500")
        return f"tcp://{os.environ['MASTER_ADDR']}:{port}", {"rank": int(os.environ["SLURM_PROCID"]),
                                                             "world_size": int(os.environ["SLURM_NTASKS"])}
    return f"tcp://localhost:{free_port()}", {"rank": 0, "world_size": 1}


def launched_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def _prepare_cpu(torch_compile: bool) -> None:
    from megatron_muon._cpu import cpu_mode_enabled, enable_cpu_mode

    if not cpu_mode_enabled():
        enable_cpu_mode()
    if "OMP_NUM_THREADS" not in os.environ:
        # One intra-op thread per rank: CPU runs are tiny, and spinning OpenMP threads on shared cores made
        # steps many times slower (docs/design/distributed.md).
        torch.set_num_threads(1)
    if not torch_compile:  # megatron's jit_fuser would otherwise compile on CPU for tens of seconds
        from torch import _dynamo

        _dynamo.config.disable = True


def current_context() -> RunContext:
    """Who this rank is, once the process group exists."""
    local_rank = launched_local_rank()
    if torch.cuda.is_available():
        device, device_name = torch.device("cuda", torch.cuda.current_device()), torch.cuda.get_device_name()
    else:
        device, device_name = torch.device("cpu"), "cpu"
    return RunContext(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device,
                      device_name)


_LAYOUT_GROUPS: list = []  # the process groups the current parallel_state layout created


def init_parallel_state(tp: int, pp: int) -> None:
    """megatron's parallel_state for this (tp, pp) layout, replacing a previous one in the same process together with
    its process groups: megatron's `destroy_model_parallel` forgets them without destroying them, and every gloo
    group keeps threads that wake up while idle, so a process that re-initializes slows down each time."""
    from megatron.core import parallel_state

    from megatron_muon.distributed.process_groups import is_alive, live_groups

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in _LAYOUT_GROUPS:
        if is_alive(group):  # not already destroyed by someone else
            torch.distributed.destroy_process_group(group)
    before = set(live_groups())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _LAYOUT_GROUPS[:] = [group for group in live_groups() if group not in before]


def init_distributed(tp: int, pp: int, torch_compile: bool = False) -> RunContext:
    """Start the process group (NCCL on GPUs, gloo + CPU mode without) and parallel_state; returns who we are."""
    if torch.cuda.is_available():
        torch.cuda.set_device(launched_local_rank())
        backend = "nccl"
    else:
        _prepare_cpu(torch_compile)
        backend = "gloo"
    if not torch.distributed.is_initialized():
        init_method, rank_and_size = _rendezvous()
        torch.distributed.init_process_group(backend=backend, init_method=init_method, **rank_and_size)
    init_parallel_state(tp, pp)
    return current_context()


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
