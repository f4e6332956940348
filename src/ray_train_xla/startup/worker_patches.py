"""Start-up step 4, on every worker once its process group exists: the patches that make it
behave like hardware (``devmode``, the CPU development mode) and make Ray's own torch helpers use
its device (``ray_helpers``). Shutdown undoes them."""

from __future__ import annotations

from ray_train_xla.planning.contract import worker_context


def install_worker_patches() -> None:
    """The CPU development mode's patches where planned, and Ray's torch helpers on the worker's
    device: the XLA device, or the NeuronCore of native TorchNeuron (native TorchTPU points Ray
    at its chip in ``native_tpu``)."""
    ctx = worker_context()
    if ctx.devmode:
        import torch.distributed as dist

        from ray_train_xla.startup import devmode

        devmode.install(dist.get_rank(), dist.get_world_size())
    if not ctx.native or ctx.device == "neuron":
        from ray_train_xla.startup import ray_helpers

        ray_helpers.install_native() if ctx.native else ray_helpers.install(spmd=ctx.spmd)
