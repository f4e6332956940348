"""``torch_tpu._loader.load()``: registers the ``tpu_dist`` backend (the real one does so only
when a TPU is visible; the double always). Ray's own ``tpu_dist`` path calls it too."""

import torch.distributed as dist

_LOADED = False


def load() -> None:
    global _LOADED
    if _LOADED:
        return
    import torch_tpu

    dist.Backend.register_backend("tpu_dist", torch_tpu._create_process_group, devices=["cpu"])
    _LOADED = True
