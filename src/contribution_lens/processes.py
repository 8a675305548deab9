"""Several processes sharing one run: torchrun's rank and world size, and waiting for the others.

A run started by ``torchrun --nproc_per_node N`` finds ``RANK`` and ``WORLD_SIZE`` in its environment;
a plain ``python`` run is rank 0 of 1 and never touches ``torch.distributed``. The resumable runners
(faithfulness, replication, circuits) share their work this way.
"""

import os

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes, joining torchrun's process group where there are several.

    >>> rank_and_world()  # a plain run
    (0, 1)
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return rank, world


def barrier(world: int) -> None:
    """Wait until every process of the run gets here (nothing to wait for in a run of one)."""
    if world > 1:
        dist.barrier()
