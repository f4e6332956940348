"""CPU: PyTorch/XLA's CPU device, for development and tests.

torch_xla 2.9 on CPU has no cross-process collectives. One worker uses the ``xla``
process group. Several workers run in the CPU development mode (``startup/devmode.py``): the
process group is ``xla_host`` (CPU and XLA tensors carried over gloo on host copies),
torch_xla's collectives are bridged the same way, and torch_xla sees the Ray world
(``PJRT_LOCAL_PROCESS_RANK``/``COUNT`` below give its local ordinal and local process count).

SPMD on CPU: ``cpu_devices_per_worker`` sets ``CPU_NUM_DEVICES``, and torch_xla shards across
that many virtual devices inside the worker. One worker uses ``gloo`` through ``xla://``; several
workers use ``gloo`` through ``env://``, because every CPU process is PJRT process 0
and each worker's mesh is local to it; the development mode stays off.
"""

from __future__ import annotations

from ray_train_xla.planning.contract import DEVMODE_BACKEND, DEVMODE_VAR, SPMD_PROCESS_GROUP
from ray_train_xla.planning.runtimes.base import Runtime


def uses_devmode(topology, config) -> bool:
    """The CPU development mode is on for several CPU workers, outside SPMD."""
    return topology.world_size > 1 and not config.spmd


class CPURuntime(Runtime):
    name = "cpu"
    pjrt_device = "CPU"

    def process_group(self, topology, config):
        if topology.world_size == 1:
            return SPMD_PROCESS_GROUP if config.spmd else ("xla", "xla://")
        if config.spmd:
            return "gloo", "env://"
        return DEVMODE_BACKEND, "env://"

    def device_env(self, place, topology, rdzv, config, facts):
        # One XLA CPU device per worker process, unless SPMD asks for more.
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(config.cpu_devices_per_worker or 1)}
        if uses_devmode(topology, config):
            env.update({
                DEVMODE_VAR: "1",
                # Read by xr.local_ordinal()/local_process_count() (and PT_XLA_DEBUG's "master"
                # process); the CPU client itself ignores them.
                "PJRT_LOCAL_PROCESS_RANK": str(place.local_rank),
                "PJRT_LOCAL_PROCESS_COUNT": str(place.local_world_size),
            })
        return env
