"""Ranks and world sizes inside the training function, from the planned environment.

Every helper that takes a rank takes the **Ray Train rank** (``RANK``, what
``ray.train.get_context().get_world_rank()`` returns), on every device. Outside a planned worker
these are the values of a single-worker run (rank 0 of 1).
"""

from __future__ import annotations

from ray_train_xla.planning.contract import DEVMODE_BACKEND, worker_context


def rank() -> int:
    """Global rank of this worker (``RANK``)."""
    return worker_context().rank


def local_rank() -> int:
    """Rank of this worker among the workers of its node (``LOCAL_RANK``)."""
    return worker_context().local_rank


def node_rank() -> int:
    """Rank of this worker's node (``GROUP_RANK``)."""
    return worker_context().node_rank


def world_size() -> int:
    """Number of workers (``WORLD_SIZE``)."""
    return worker_context().world_size


def spmd_global() -> bool:
    """True under SPMD on an accelerator: one mesh over every worker, so XLA tensors are global
    values. (CPU SPMD workers each have their own mesh: their tensors are local.)"""
    return worker_context().spmd_global


def uses_host_collectives() -> bool:
    """True when collectives go through gloo on host copies (several CPU workers: the
    development mode's ``xla_host`` group, or a ``gloo`` group). False under SPMD on an
    accelerator, where XLA tensors are already global."""
    ctx = worker_context()
    return ((ctx.pg_backend == DEVMODE_BACKEND or "gloo" in ctx.pg_backend)
            and ctx.world_size > 1 and not ctx.spmd_global)
