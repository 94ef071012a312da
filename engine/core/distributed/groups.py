"""How the ranks meet: a store on loopback that rank 0 serves, the default group joined through it, and the model's
group whose collectives time out (every rank calls join_groups, in the same order)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# Joining the group: a spawned rank first imports torch and the engine (seconds), which the step timeout may not
# allow for.
START_TIMEOUT = timedelta(seconds=180)


def join_groups(backend: str, port: int, rank: int, size: int, timeout_s: float) -> object:
    """Every rank calls this: the model's group, whose collectives time out after timeout_s, met at a store on
    loopback that rank 0 serves, within START_TIMEOUT."""
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, START_TIMEOUT, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=START_TIMEOUT)
    return dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
