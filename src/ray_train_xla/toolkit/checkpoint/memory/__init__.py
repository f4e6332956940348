"""The memory tier: the newest checkpoint kept in host memory, on its own node and on a peer node.

With ``memory_every=N`` on the config, the backend starts one **memory store** per node of the
worker group (a Ray actor with no CPU, owned by Ray Train's controller, so it outlives every
worker group of the ``fit()`` and ends with it). :func:`keep_in_memory` (every rank, every
step; it keeps the steps that are multiples of N) takes the same snapshot as
``save_checkpoint`` and returns. DTensor state is written in place into the node's shared
memory: each rank copies its shards straight into one of its two slot files, laid out once as
its DCP data file, and writes its own DCP metadata, rank by rank with no collective
(``rank_files.py``). Replicated state is formatted by a writer process of the tier's own
(``writer.SaveProcess``, one per worker) into a file there: rank 0's ``checkpoint.pt``. In a
background thread, the worker then hands its files to the store of its node, which maps them
(and unlinks them: their memory goes back when the store drops them or ends, however it ends)
and hands them to the store of the next node of the group (its peer) through Ray's object
store. Without shared memory, for torch_xla SPMD state, and for replicated state until the
writer process takes work or without writer processes, the background thread writes the
generation itself into memory (``dcp.save``; ``torch.save`` for replicated state). A
generation is complete once every rank handed its files (a barrier of the ranks ends each one).

After a failure, ``load_checkpoint()`` asks the stores first: rank 0 takes the newest
generation whose files every rank of its world survive on some live store, and which is newer
than the newest checkpoint Ray took into storage (each ``save_checkpoint`` takes a generation
number too, and the stores note it once Ray took it); every rank then reads with ``dcp.load``
over the stores (through torch's ``FileSystemReader``, or ``rank_files.SlotReader`` for a
generation written rank by rank), fetching only the files its shards need, so the restore
reshards onto another world size as from storage. Otherwise the restore comes from storage,
and the log says why. Each store holds at most two generations: the newest complete one and
the one being written.

Sharded (FSDP2 DTensors, torch_xla SPMD) and replicated state, on every config.

The room: ``store.py``, the stores and their start (the backend imports it: no torch);
``tier.py``, the worker's side (keeping generations, choosing one at a restore);
``restore.py``, a generation read back through the stores. Its names are imported on first use,
so that importing ``store`` loads no torch.
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
