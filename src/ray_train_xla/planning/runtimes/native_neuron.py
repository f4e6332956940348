"""Native TorchNeuron (Neuron SDK 2.30+, ``torch-neuronx`` without XLA), and its CPU twin.

The native package's process group (``init_process_group("neuron", init_method="env://")``)
sets the Neuron runtime up from the environment at init, once per process
(``torch_neuronx/distributed/backend.py``, ``_neuron_runtime_setup``; details and sources in
``docs/trainium.md``, "Sources for native TorchNeuron"). It keeps ``NEURON_RT_VISIBLE_CORES`` and
``NEURON_RT_ROOT_COMM_ID`` when they are set and otherwise guesses them, so the plan sets them,
per worker, before anything touches the runtime:

- the torchrun contract (``base.torchrun_env``), including ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``:
  without both, the process group groups ranks by hostname through the store;
- ``NEURON_RT_VISIBLE_CORES``: the **one** core Ray assigned the worker. Train V1 shares a
  node's cores among its workers (the union, sorted as strings) before the backend starts; the
  plan, applied after that, puts each worker back on its own core. The runtime asserts exactly
  one visible core per process;
- ``NEURON_RT_ROOT_COMM_ID``: rank 0's address and a port reserved there, the same on every rank
  (the native default is ``$MASTER_ADDR`` or ``localhost`` and a port chosen at init);
- ``ACCELERATE_TORCH_DEVICE=neuron:<local rank>``: the device index is the local rank
  (``set_local_device_start_index``), as Accelerate's own ``neuron`` path names it;
- ``TORCH_NEURONX_NEFF_CACHE_DIR`` from ``compile_cache`` (the default ``/tmp/neff_cache`` is
  node-local), in the process-start environment of the training processes;
- EFA (``FI_*``) and socket-interface variables where the node has them (``neuron.network_env``).

``device="cpu"`` plans the same torchrun contract with ``gloo`` on CPU workers, so the same
training function runs on a development machine.
"""

from __future__ import annotations

import logging

from ray_train_xla.planning.contract import NATIVE, NEURON_ROOT_COMM_VAR, NEURON_VISIBLE_CORES_VAR
from ray_train_xla.planning.runtimes.base import Runtime, check_one_accelerator_each
from ray_train_xla.planning.runtimes.neuron import NEURON_RESOURCE, network_env, root_comm_id

logger = logging.getLogger(__name__)

NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"


def import_env(config) -> dict[str, str]:
    """The variables a native worker must have before ``import torch``, identical on every
    worker: torch autoloads torch-neuronx, which reads its collective settings once at import
    (``NEURON_USE_SPLIT_ALLGATHER``, ``NEURON_USE_SPLIT_REDUCE_SCATTER``,
    ``COLLECTIVE_BUCKETSIZE_IN_MB``, ``COLLECTIVE_MIN_BUCKETS``: any of them comes through
    ``env``), and its compile cache directory is best in place from the start. So: every ``env``
    entry and ``TORCH_NEURONX_NEFF_CACHE_DIR``. ``startup/import_env.py`` applies them."""
    env = {k: str(v) for k, v in dict(config.env).items()}
    if config.compile_cache:
        env[NEFF_CACHE_VAR] = config.compile_cache
    return env


class NativeNeuronRuntime(Runtime):
    """One NeuronCore per worker, process group ``neuron`` through ``env://``."""

    name = "neuron-native"
    resource = NEURON_RESOURCE

    def check(self, config, topology) -> None:
        check_one_accelerator_each(
            topology, "TorchNeuronConfig", "neuron", "neuron_cores", "core", NEURON_RESOURCE,
            "the native Neuron process group drives exactly one NeuronCore per process (it "
            "asserts one visible core at init)", logger)

    def ports_needed(self, config) -> int:
        return 1  # NEURON_RT_ROOT_COMM_ID

    def process_group(self, topology, config) -> tuple[str, str]:
        return "neuron", "env://"

    def device_env(self, place, topology, rdzv, config, facts) -> dict[str, str]:
        core = place.accelerator_ids[0] if place.accelerator_ids else str(place.local_rank)
        env = {
            NEURON_VISIBLE_CORES_VAR: core,
            NEURON_ROOT_COMM_VAR: root_comm_id(rdzv.master_addr, rdzv.extra_ports[0]),
            "ACCELERATE_TORCH_DEVICE": f"neuron:{place.local_rank}",
        }
        if config.compile_cache:
            env[NEFF_CACHE_VAR] = config.compile_cache
        env.update(network_env(config, facts))
        return env


class NativeCPURuntime(Runtime):
    """The CPU twin: the same torchrun contract, ``gloo`` on CPU, no torch_xla."""

    name = "cpu-native"

    def process_group(self, topology, config) -> tuple[str, str]:
        return "gloo", "env://"

    def device_env(self, place, topology, rdzv, config, facts) -> dict[str, str]:
        return {"ACCELERATE_TORCH_DEVICE": "cpu"}


RUNTIMES = {("neuron", NATIVE): NativeNeuronRuntime, ("cpu", NATIVE): NativeCPURuntime}
