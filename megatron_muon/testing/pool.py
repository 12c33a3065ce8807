"""A persistent pool of gloo ranks for multi-rank tests.

Starting a process group and importing megatron costs seconds per process, so the ranks are spawned once per world
size and reused: each test sends a module-level function to every rank and gets the per-rank results back, and a
failure on any rank is raised in the test with that rank's traceback.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import socket
import sys
import traceback
from typing import Any, Callable


def free_port() -> int:
    """A TCP port that is free right now on localhost (never a fixed one: tests run side by side)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteError(RuntimeError):
    """A function raised on one or more ranks; the message holds each failing rank's traceback."""


def _worker_main(rank: int, world_size: int, port: int, conn, parent_sys_path: list[str], threads: int) -> None:
    sys.path[:] = parent_sys_path
    import torch
    import torch.distributed as dist

    from megatron_muon._cpu import enable_cpu_mode

    if os.environ.get("TORCHDYNAMO_DISABLE", "1") == "1":  # CPU ranks run eagerly unless the caller asks otherwise
        torch._dynamo.config.disable = True
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=180))
    enable_cpu_mode(nan_empty=True)
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        _fresh_process_state()
        try:
            conn.send(("ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # report everything, the pool stays usable
            conn.send(("error", traceback.format_exc()))
    _exit_now()


def _fresh_process_state() -> None:
    """Undo what an earlier task may have left process-wide, so a test's result never depends on which ran before:
    an fp64 run's default dtype and its fp64-as-fp32 reporting (`.float()` then keeps fp64)."""
    import torch

    from megatron_muon._cpu import report_float64_as_float32

    torch.set_default_dtype(torch.float32)
    report_float64_as_float32(False)


def _exit_now() -> None:
    """Leave at once: stop helper processes megatron started (dist_checkpointing's writer queue manager) and skip
    interpreter teardown, which would otherwise wait on them and on gloo's shutdown."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """`world_size` spawned gloo ranks in CPU mode; `run(fn, *args)` calls `fn(rank, world_size, *args)` on each."""

    def __init__(self, world_size: int, timeout_s: float = 600.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.broken = False
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = 1  # tiny test models: more intra-op threads only add contention between ranks
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, child_conn, list(sys.path), threads),
                daemon=False,  # dist_checkpointing's async writer starts child processes of its own
                name=f"rank{rank}",
            )
            proc.start()
            self._conns.append(parent_conn)
            self._procs.append(proc)
        atexit.register(self.close)
        self._gather("start")

    def _gather(self, what: str) -> list[Any]:
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout_s):
                self.broken = True
                raise TimeoutError(f"rank {rank} gave no answer to {what} within {self.timeout_s:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                self.broken = True
                raise RemoteError(f"rank {rank} died during {what} (exit code {self._procs[rank].exitcode})")
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            results.append(value)
        if errors:
            raise RemoteError(f"{what} failed on {len(errors)} of {self.world_size} ranks:\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """Run `fn(rank, world_size, *args, **kwargs)` on every rank; return the per-rank results in rank order."""
        if self.broken:
            raise RuntimeError("this rank pool is broken by an earlier failure; start a new one")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._gather(getattr(fn, "__name__", "function"))

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive() and not self.broken:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join()
