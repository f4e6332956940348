"""CPU: PyTorch/XLA's CPU device, for development and tests.

torch_xla 2.9 on CPU has no cross-process collectives (spec §1): one worker uses the ``xla``
process group; several workers use ``gloo`` on host copies, and each still computes on its own
XLA CPU device.
"""

from __future__ import annotations

from ray_train_xla.runtimes.base import Runtime


class CPURuntime(Runtime):
    name = "cpu"
    pjrt_device = "CPU"

    def process_group(self, topology, config):
        if topology.world_size == 1:
            return "xla", "xla://"
        return "gloo", "env://"

    def device_env(self, place, topology, rdzv, config, facts):
        # One XLA CPU device per worker process.
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
