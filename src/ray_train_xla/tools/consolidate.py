"""``ray-train-xla consolidate``: one file of the full model from a checkpoint, for plain torch.

Reads a sharded checkpoint (``torch.distributed.checkpoint``, written by ``save_checkpoint`` of
SPMD state) or a replicated one (``checkpoint.pt``) on the CPU, without torch_xla, and writes the
model's full tensors as safetensors (and, on request, a ``torch.save`` file). FSDPv2's
``_orig_module.`` key prefixes are removed, so the file loads into the unwrapped model.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.format import is_sharded_checkpoint, read_full_state

FSDP_V2_PREFIX = "_orig_module."


def plain_model_state(model_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model tensors under the unwrapped model's names (FSDPv2 prefixes removed), contiguous."""
    out = {}
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor):
            out[key.replace(FSDP_V2_PREFIX, "")] = value.detach().to("cpu").contiguous()
    return out


def consolidate(checkpoint: str, out: str, torch_file: str | None = None) -> dict[str, Any]:
    """Write the full model of ``checkpoint`` (a local checkpoint directory, or a URI Ray Train
    can read) to ``out`` (safetensors) and optionally ``torch_file``; returns a summary."""
    from safetensors.torch import save_file

    if "://" in checkpoint:
        import ray.train

        with ray.train.Checkpoint(checkpoint).as_directory() as path:
            return consolidate(path, out, torch_file)
    sharded = is_sharded_checkpoint(checkpoint)
    state = read_full_state(checkpoint)
    if "model" not in state:
        raise KeyError(f"{checkpoint} has no 'model' entry to consolidate")
    model = plain_model_state(state["model"])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file(model, out, metadata={"format": "pt", "source": json.dumps(
        {"checkpoint": os.path.abspath(checkpoint), "sharded": sharded})})
    if torch_file:
        torch.save(model, torch_file)
    return {
        "checkpoint": checkpoint,
        "sharded": sharded,
        "tensors": len(model),
        "parameters": sum(t.numel() for t in model.values()),
        "bytes": os.path.getsize(out),
        "out": out,
        "torch_file": torch_file,
    }
