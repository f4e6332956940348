"""A sharded checkpoint's model, one tensor at a time: read from any storage, written as safetensors.

``ray-train-xla consolidate --hf`` exports through these without holding more than a couple of
tensors: :class:`ModelTensors` lists the model's tensors from the checkpoint's ``.metadata``
and reads each one whole (every rank's shards of it, and nothing of the optimizer state)
through torch's ``FileSystemReader``, on a local directory or on any pyarrow filesystem (the one
Ray Train's ``Checkpoint.filesystem`` holds: S3, GCS, a mounted one); :func:`write_safetensors`
writes a safetensors file tensor by tensor (the header first, from the shapes).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.files import (  # noqa: F401 (read here and by consolidate)
    ArrowFileSystem,
    load_small,
    read_file,
)
from ray_train_xla.toolkit.checkpoint.format import check_chunks, reader_for

# The safetensors names of torch dtypes (safetensors' own table).
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class ModelTensors:
    """The tensors of the checkpoint's ``top`` entry (``model``): their names (``rename``
    applied), shapes and dtypes from the metadata, each read whole on request."""

    def __init__(self, path: str, filesystem=None, top: str = "model",
                 rename: Callable[[str], str] = lambda name: name) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.reader, metadata = reader_for(path, filesystem)
        check_chunks(metadata, (top,), f"checkpoint {path}")
        mappings = metadata.planner_data or {}
        self.entries: dict[str, tuple[tuple, tuple[int, ...], torch.dtype]] = {}
        for key, md in metadata.state_dict_metadata.items():
            where = tuple(mappings.get(key, key.split(".", 1)))
            if str(where[0]) != top or not isinstance(md, TensorStorageMetadata):
                continue
            name = rename(".".join(str(p) for p in where[1:]))
            self.entries[name] = (where, tuple(md.size), md.properties.dtype)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (shape, dtype) for name, (_, shape, dtype) in self.entries.items()}

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``: every shard of it, nothing else."""
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        where, shape, dtype = self.entries[name]
        tensor = torch.empty(shape, dtype=dtype)
        state: dict[str, Any] = {}
        node = state
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = tensor
        _load_state_dict(state, storage_reader=self.reader,
                         planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return tensor


def write_safetensors(file, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                      produce: Callable[[str], torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Write the safetensors file ``file`` (a path, or a binary stream) holding ``tensors``
    (name, shape, dtype), asking ``produce(name)`` for each one in turn and writing it before
    asking for the next. Returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    stream = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
    try:
        stream.write(struct.pack("<Q", len(head)))
        stream.write(head)
        for name, shape, dtype in tensors:
            tensor = produce(name).detach().to("cpu", dtype).contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"write_safetensors: {name} has shape {list(tensor.shape)}, "
                                 f"not the {list(shape)} its header says")
            if tensor.numel():
                stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
    finally:
        if stream is not file:
            stream.close()
    return 8 + len(head) + offset


__all__ = ["ArrowFileSystem", "ModelTensors", "load_small", "reader_for", "write_safetensors"]
