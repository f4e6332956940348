"""CPU: PyTorch/XLA's CPU device, for development and tests.

torch_xla 2.9 on CPU has no cross-process collectives (spec §1): one worker uses the ``xla``
process group; several workers use ``gloo`` on host copies, and each still computes on its own
XLA CPU device.

SPMD on CPU: ``cpu_devices_per_worker`` sets ``CPU_NUM_DEVICES``, and torch_xla shards across
that many virtual devices inside the worker. One worker uses ``gloo`` through ``xla://``; several
workers use ``gloo`` through ``env://``, because every CPU process is PJRT process 0 (spec §1)
and each worker's mesh is local to it.
"""

from __future__ import annotations

from ray_train_xla.runtimes.base import SPMD_PROCESS_GROUP, Runtime


class CPURuntime(Runtime):
    name = "cpu"
    pjrt_device = "CPU"

    def process_group(self, topology, config):
        if topology.world_size == 1:
            return SPMD_PROCESS_GROUP if config.spmd else ("xla", "xla://")
        return "gloo", "env://"

    def device_env(self, place, topology, rdzv, config, facts):
        # One XLA CPU device per worker process, unless SPMD asks for more.
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(config.cpu_devices_per_worker or 1)}
