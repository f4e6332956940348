"""CPU: PyTorch/XLA's CPU device, for development and tests.

torch_xla 2.9 on CPU has no cross-process collectives. One worker uses the ``xla``
process group. Several workers run in the CPU development mode (``startup/devmode.py``): the
process group is ``xla_host`` (CPU and XLA tensors carried over gloo on host copies),
torch_xla's collectives are bridged the same way, and torch_xla sees the Ray world
(``PJRT_LOCAL_PROCESS_RANK``/``COUNT`` below give its local ordinal and local process count).

SPMD on CPU: ``cpu_devices_per_worker`` sets ``CPU_NUM_DEVICES``, and torch_xla shards across
that many virtual devices inside the one worker (``gloo`` through ``xla://``). Several SPMD
workers on the CPU are refused: every CPU process is PJRT process 0 of a world of its own
(``spmd_one_worker`` says what would follow).
"""

from __future__ import annotations

from ray_train_xla.errors import Term, XLAConfigError
from ray_train_xla.planning.contract import DEVMODE_BACKEND, DEVMODE_VAR, SPMD_PROCESS_GROUP
from ray_train_xla.planning.runtimes.base import SPMD, Runtime


def spmd_one_worker(workers: int) -> XLAConfigError:
    """Several SPMD workers on the CPU: what would follow, and the two ways to develop."""
    return XLAConfigError(
        SPMD, " is not valid: expected a single worker ", Term("with spmd=True", "with --spmd"),
        " on the CPU device. "
        f"torch_xla's CPU client has no cross-process collectives: with {workers} workers each "
        "one's SPMD mesh would hold only its own devices, so workers fed different data would "
        "train different models and write one sharded checkpoint of mixed shards (on TPU or "
        "Neuron hosts the same program is one global mesh). Develop SPMD on CPU with ",
        Term("ScalingConfig(num_workers=1) and cpu_devices_per_worker=<devices>",
             "--nodes 1 --workers-per-node 1 --cpu-devices-per-worker <devices>"),
        " (one mesh over that many virtual devices), or use several CPU workers ",
        Term("with spmd=False", "without --spmd"), " (the CPU development mode).")


class CPURuntime(Runtime):
    name = "cpu"
    pjrt_device = "CPU"

    def check(self, config, topology) -> None:
        if config.spmd and topology.world_size > 1:
            raise spmd_one_worker(topology.world_size)
        super().check(config, topology)

    def process_group(self, topology, config):
        if topology.world_size == 1:
            return SPMD_PROCESS_GROUP if config.spmd else ("xla", "xla://")
        return DEVMODE_BACKEND, "env://"

    def device_env(self, place, topology, rdzv, config, facts):
        # One XLA CPU device per worker process, unless SPMD asks for more.
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(config.cpu_devices_per_worker or 1)}
        if topology.world_size > 1 and not config.spmd:  # the CPU development mode
            env.update({
                DEVMODE_VAR: "1",
                # Read by xr.local_ordinal()/local_process_count() (and PT_XLA_DEBUG's "master"
                # process); the CPU client itself ignores them.
                "PJRT_LOCAL_PROCESS_RANK": str(place.local_rank),
                "PJRT_LOCAL_PROCESS_COUNT": str(place.local_world_size),
            })
        return env
