"""Process-group helpers shared by the evaluation runner and the fine-tuning script."""

from __future__ import annotations

import os

import torch


def cpu_only_multiprocess() -> bool:
    """True for a multi-process launch (torchrun / ``accelerate launch --multi_gpu``) on a machine without an
    accelerator: accelerate then needs ``cpu=True`` to start a gloo process group (MULTI_CPU) instead of
    running every process as an independent single-process job.

    Note: ``accelerate launch --cpu --num_processes N`` starts only ONE process in accelerate 1.x unless MPI is set
    up; for N CPU processes use ``accelerate launch --multi_gpu --num_processes N`` (with no GPU visible) or
    ``torchrun --nproc_per_node N``.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    has_accel = getattr(torch, "accelerator", None)
    available = has_accel.is_available() if has_accel is not None else torch.cuda.is_available()
    return not available


def end_process_group() -> None:
    """Wait for every process, then destroy the default process group (no-op when none is up).

    Call it at the end of a multi-process run: a process that exits while gloo's threads still hold a live group
    can abort in C++ teardown ("terminate called without an active exception") and fail the whole launch after
    its work was done.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
