"""Checkpoints through Ray Train, saved and restored the same way on every device.

One seam, two implementations, picked from the state given:

- replicated state (every worker holds the whole model): rank 0 writes one plain torch file,
  ``checkpoint.pt``, that loads without torch_xla or this package (``replicated.py``);
- sharded state (torch_xla SPMD tensors, e.g. FSDPv2; DTensors, e.g. FSDP2 on the native
  configs): every rank writes only its own shards with ``torch.distributed.checkpoint`` into
  the same Ray checkpoint, under the module's own names (``sharded.py``, ``names.py``).

Loading crosses the seam both ways: a sharded checkpoint of either layout restores onto any
mesh, device count, worker count and layout, or into a replicated model (every rank reads the
full tensors); a replicated checkpoint loads into a sharded model (every rank takes its shards
of the full tensors). A save is four steps, each a module, called in order by ``seam.py``:
describe the state once (``sharded.describe``: its layout, names and the rest), copy it to host
memory (``staging.stage``), choose its writer (``writer.writer_for``: DCP, torch's writer
process, a save process), and hand both to the worker's background reporter, which writes and
reports it (``toolkit/reporting.py``). The memory tier keeps a generation through the same
first two steps. State neither can restore (torch_xla FSDP v1 flat shards) is
refused. The on-disk format, shared with ``ray-train-xla consolidate``, is in ``format.py``.

The memory tier, a room of its own, is in ``memory/``. This package imports its names on first
use: the driver imports the memory tier's store (``memory/store.py``), which loads no torch.
"""

from __future__ import annotations

from ray_train_xla.toolkit.lazy import lazy_names

# Name -> the module of this folder that defines it.
_EXPORTS = {"load_checkpoint": "seam", "save_checkpoint": "seam"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
