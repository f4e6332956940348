"""The memory tier: the newest checkpoint kept in host memory, on its own node and on a peer node
(docs/sharded-models.md, "The memory tier", says what is kept where, and how a restore chooses).

With ``memory_every=N`` on the config, the backend starts one **memory store** per node of the
worker group (a Ray actor with no CPU, owned by Ray Train's controller, so it outlives every
worker group of the ``fit()`` and ends with it). :func:`keep_in_memory` takes the same snapshot
as ``save_checkpoint`` and returns; DTensor state is written in place into the node's shared
memory, rank by rank (``rank_files.py``), replicated state by a writer process of the tier's own
(``writer.SaveProcess``). In a background thread the worker hands its files to its node's store,
which maps them and hands them to the next node's store (its peer). ``load_checkpoint()`` asks
the stores first and reads the newest complete generation newer than storage with ``dcp.load``
over them, resharding as from storage; otherwise the restore comes from storage, and the log
says why.

The room: ``store.py``, the stores and their start (the backend imports it: no torch);
``tier.py``, the worker's side (keeping generations, choosing one at a restore);
``restore.py``, a generation read back through the stores; ``rng.py``, each rank's random
number generators kept with its files and set again at a restore. Its names are imported on
first use, so that importing ``store`` loads no torch.
"""

from __future__ import annotations

from ray_train_xla.toolkit.lazy import lazy_names

# Name -> the module of this folder that defines it.
_EXPORTS = {
    **dict.fromkeys(("NAMESPACE", "STORE_PREFIX", "MemoryStore", "start_stores", "store_name"),
                    "store"),
    **dict.fromkeys(("StoreFiles",), "restore"),
    **dict.fromkeys(("SHARED_ROOT", "MemoryTier", "broadcast_from_rank0", "flush_memory",
                     "keep_in_memory", "memory_tier"), "tier"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
