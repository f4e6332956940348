"""Checkpoints through Ray Train, saved and restored the same way on every device.

A checkpoint's state is one typed value (``describe.py``: a list of model parts, a list of
optimizers, the replicated rest, and the objects, such as LR schedulers, a restore gives their
state back) of one of three kinds, found once from the tensors it holds; the kind object is the
implementation (``replicated.py``, ``sharded.py``):

- replicated state (every worker holds the whole model): rank 0 writes one plain torch file,
  ``checkpoint.pt``, that loads without torch_xla or this package;
- sharded state (torch_xla SPMD tensors, e.g. FSDPv2; DTensors, e.g. FSDP2 and tensor
  parallelism on the native configs): every rank writes only its own shards of every model and
  optimizer with ``torch.distributed.checkpoint`` into the same Ray checkpoint, under the
  module's own names (``names.py``).

A save is four steps, called in order by ``seam.py``: describe the state once
(``describe.describe``), copy it to host memory (its kind's ``stage``, into the pool of
``staging.py``), give its writer (its kind's ``writer``: DCP in this thread or torch's writer
process, ``writer.py``; a save process for a replicated file), and hand the writer to the
worker's background reporter, which writes and reports it (``toolkit/reporting.py``). The memory
tier keeps a generation through the same first two steps. A restore is the mirror, one way:
describe what it fills (``describe.target``), open the source once (``source.py``: the memory
tier's newest generation or a checkpoint in storage, either format) and let the kind restore
it: any checkpoint into any model, a sharded one onto any mesh, worker count and layout, a
replicated one into a sharded model's shards, a sharded one whole into a replicated model.
State neither can restore (torch_xla FSDP v1 flat shards) is refused. The on-disk format,
shared with ``ray-train-xla consolidate``, is in ``format.py``.

The memory tier, a room of its own, is in ``memory/``. This package imports its names on first
use: the driver imports the memory tier's store (``memory/store.py``), which loads no torch.
"""

from __future__ import annotations

from ray_train_xla.toolkit.lazy import lazy_names

# Name -> the module of this folder that defines it.
_EXPORTS = {"load_checkpoint": "seam", "save_checkpoint": "seam"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
