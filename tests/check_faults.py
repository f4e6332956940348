"""Faults injected into ``ray-train-xla check`` (its ``hooks``, called on the workers), each
the way it would happen on a cluster, and recording where it struck so a test can assert that
the check names it:

- ``world``: something on rank 1 changes a planned variable after the plan was applied (a setup
  script, the user's code): ``LOCAL_WORLD_SIZE`` becomes 3;
- ``correctness``: rank 1's ``torch.distributed.all_reduce`` adds 1 to every bfloat16 result
  (a broken collective; float32 and the bandwidth sweep are left alone);
- ``training``: step 5's batch is one token shorter on every rank (a new input shape, so a new
  graph after warm-up);
- ``checkpoint``: after the same-size reload, rank 0 adds 1 to the first parameter it holds (a
  checkpoint that did not restore the state it saved).
"""

from __future__ import annotations

import os

FAULTS = ("world", "correctness", "training", "checkpoint")


class Faults:
    def __init__(self, faults=FAULTS):
        self.faults = tuple(faults)

    def before(self, step: str) -> None:
        import torch
        import torch.distributed as dist

        import ray_train_xla as rtx

        if step == "world" and "world" in self.faults and rtx.rank() == 1:
            os.environ["LOCAL_WORLD_SIZE"] = "3"
        if step == "correctness" and "correctness" in self.faults and rtx.rank() == 1:
            real = dist.all_reduce

            def broken(tensor, *args, **kwargs):
                work = real(tensor, *args, **kwargs)
                if tensor.dtype == torch.bfloat16:
                    tensor.add_(1)
                return work

            broken.real = real
            dist.all_reduce = broken
        if step == "bandwidth":
            dist.all_reduce = getattr(dist.all_reduce, "real", dist.all_reduce)

    def batch(self, step: int, tokens):
        if "training" in self.faults and step == 5:
            return tokens[:, :-1]
        return None

    def after_load(self, model, optimizer) -> None:
        import torch

        import ray_train_xla as rtx

        if "checkpoint" in self.faults and rtx.rank() == 0 and rtx.world_size() > 1:
            with torch.no_grad():
                param = next(model.parameters())
                local = getattr(param, "_local_tensor", param)
                local.add_(1)


class RaisesIn:
    """Rank 1 raises at the start of ``step`` after writing a line to its log (stderr)."""

    def __init__(self, step: str):
        self.step = step

    def before(self, step: str) -> None:
        import sys

        import ray_train_xla as rtx

        if step == self.step and rtx.rank() == 1:
            print(f"injected fault: rank 1 breaks in the {step} step", file=sys.stderr, flush=True)
            raise RuntimeError(f"injected: the {step} step broke on rank 1")
