"""Replicated state: every worker holds the whole model; rank 0 writes one plain torch file.
Its kind (``REPLICATED``, ``describe.kind_of`` picks it) stages, writes and restores it.

Saving follows the rules that avoid the known torch_xla hangs: every worker syncs the graph (so
nothing collective is left pending, done by the caller), then only rank 0 copies the state to
the CPU (:meth:`Replicated.stage`) and writes it with ``torch.save`` (``writer.write_replicated``,
in the reporter's thread or its writer process); no torch_xla collective and no ``xm.save``
rendezvous runs in a branch that only rank 0 takes. The file needs neither torch_xla nor this
package to load. A restore reads it, or every tensor of a sharded checkpoint whole, into the
replicated model and optimizer.
"""

from __future__ import annotations

from typing import Any

from ray_train_xla.toolkit.checkpoint.source import check_whole
from ray_train_xla.toolkit.checkpoint.staging import Staged, shared_pool, tensors_in
from ray_train_xla.toolkit.checkpoint.writer import save_process, write_file
from ray_train_xla.toolkit.device import sync, to_cpu


class Replicated:
    """Replicated state: rank 0 writes ``checkpoint.pt``; a restore loads whole tensors."""

    layout = None  # what sharded.json says: none, no shards
    sharded = False  # every rank writes its own shards
    in_place = False
    writer_process = False

    def stage(self, state, overlap: bool = False, shared: bool = False, stager=None) -> Staged:
        """Rank 0's host copy of ``state`` (``describe.CheckpointState``) as one plain file
        holds it. ``shared``: tensors with storage (the CPU, the native devices) in shared
        buffers reused from save to save, for a writer process; torch_xla's move into shared
        memory when handed to the process."""
        whole = {**{p.key: p.state for p in state.models},
                 **{o.key: o.state for o in state.optimizers}, **state.extras}
        if shared and not any(t.device.type == "xla" for t in tensors_in(whole)):
            copy, release = shared_pool().stage(whole)
            return Staged(self, copy, release)
        return Staged(self, to_cpu(whole))

    def writer(self, staged: Staged, filename: str, writer_process: bool = False):
        """``write(directory, filesystem)``: rank 0 writes ``filename``, through its save
        process where ``writer_process`` (started at the first save, in the background)."""
        process = save_process() if writer_process else None

        def write(directory: str, filesystem) -> dict[str, Any]:
            return write_file(staged, directory, filename, filesystem, process)

        return write

    def restore(self, target, source) -> dict[str, Any]:
        """Load ``target`` (``describe.CheckpointState``) whole from ``source`` (either format,
        ``source.py``): the plain file, or every tensor of a sharded checkpoint (every rank
        reads every shard). Returns what ``target.restored`` gives of the saved state. Raises
        ``CheckpointMismatchError`` before anything is loaded when the saved state does not
        fit."""
        where = f"load_checkpoint: {source.where}"
        source.require(target)  # every entry it restores: before anything is read
        saved = source.rest()
        state = source.read_whole(target)
        check_whole(state, target, where)
        for part in target.models:
            part.module.load_state_dict(state[part.key])  # into the parameters, on their device
        for part in target.optimizers:
            if part.key in state:  # onto each parameter's (XLA) device
                part.optimizer.load_state_dict(state[part.key])
        sync()
        return target.restored(saved)


REPLICATED = Replicated()


__all__ = ["REPLICATED", "Replicated"]
