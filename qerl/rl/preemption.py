"""SIGTERM, what SLURM and Kubernetes send before they kill a job: the step under way
finishes, a checkpoint is saved, and the run stops with an error saying how to resume,
instead of dying mid-step and losing every step since the last scheduled checkpoint."""

from __future__ import annotations

import signal
import threading

from transformers import TrainerCallback

from qerl.errors import QerlError


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` holds in any process of a distributed run: the signal reaches each
    at its own moment, and all must stop after the same step (or the next collective waits
    forever for the ones that stopped)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Preempted(QerlError):
    """Training stopped at a checkpoint because the process was asked to end."""


class Preemption(TrainerCallback):
    """Catches SIGTERM while training runs (in the main thread, where Python delivers
    signals); at the end of the step under way, asks the trainer to save and stop."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _on_signal(self, signum, frame):
        self.requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def on_step_end(self, args, state, control, **kwargs):
        if _any_process(self.requested):
            self.requested = True
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def check(self, output_dir, step: int) -> None:
        """Raise Preempted if the run stopped for SIGTERM (after its checkpoint): in every
        process, also where the signal came after the last step's agreement."""
        if _any_process(self.requested):
            raise Preempted(f"stopped by SIGTERM after step {step}; checkpoint-{step} is saved "
                            f"in {output_dir}: run the same command to resume")
