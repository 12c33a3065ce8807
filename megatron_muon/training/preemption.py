"""Stop cleanly when the cluster asks: on SIGTERM, finish the step, save a checkpoint and end the run.

Slurm sends SIGTERM before a job's time limit (with `#SBATCH --signal=TERM@<seconds>`), on preemption and on
`scancel`, and torchrun passes it on to every rank (`training.exit_signal` picks SIGUSR1, SIGUSR2 or SIGINT for
schedulers or wrappers that warn with another signal). Ranks receive it at different moments, so each step they agree
through one all-reduce (the max of their flags): every rank stops after the same step and the collective checkpoint
save lines up, as megatron's `--exit-signal-handler` does. On by default when the run saves (`checkpoint.save`;
`training.exit_signal_handler: false` turns it off). The flags travel over a CPU (gloo) group, so agreeing does not
wait for the GPU to finish the step.
"""

from __future__ import annotations

import signal
import threading

import torch


class StopOnSignal:
    """Records the signal (SIGTERM unless named) while installed; `agreed()` says whether any rank has received it."""

    def __init__(self, enabled: bool, device: torch.device, signal_name: str = "SIGTERM"):
        self.enabled = enabled
        self.device = device
        self.signum = signal.Signals[signal_name]
        self.received = False
        self._previous = None
        if enabled:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError(
                    "training.exit_signal_handler needs the training loop on the main thread (Python delivers "
                    "signals there); run pretrain from the main thread or set training.exit_signal_handler=false"
                )
            self._previous = signal.signal(self.signum, self._record)
        self._group = None
        if enabled and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            gloo = torch.distributed.get_backend() == "gloo"
            self._group = torch.distributed.group.WORLD if gloo else torch.distributed.new_group(backend="gloo")

    def _record(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        """True on every rank once any rank received the signal. A collective when enabled: call it every step."""
        if not self.enabled:
            return False
        if self._group is None:
            return self.received
        flag = torch.tensor([1.0 if self.received else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def close(self) -> None:
        """Put the previous handler back."""
        if self.enabled:
            signal.signal(self.signum, self._previous)
            self.enabled = False
