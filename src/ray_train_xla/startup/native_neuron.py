"""Worker-side steps of native TorchNeuron: refuse a worker the native process group would
fail on (naming the fix), point Ray's own device helpers at the worker's NeuronCore, and import
``torch_neuronx`` explicitly before the ``neuron`` process group is created.

Runs on the workers only; torch, Ray and torch_neuronx are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ray_train_xla.errors import WorkerSetupError
from ray_train_xla.planning.contract import NEURON_VISIBLE_CORES_VAR as VISIBLE_CORES_VAR
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.startup.facts import who

INSTALL_HINT = ("pip install torch-neuronx --extra-index-url "
                "https://pip.repos.neuron.amazonaws.com (Neuron SDK 2.30+)")


def parse_cores(text: str) -> list[str]:
    """The cores a ``NEURON_RT_VISIBLE_CORES`` value names ("3", "0,1", "4-7")."""
    cores: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        if sep and first.isdigit() and last.isdigit():
            cores.extend(str(i) for i in range(int(first), int(last) + 1))
        else:
            cores.append(part)
    return cores


def check_runtime_untouched() -> None:
    """The native process group sets the Neuron runtime up at init and asserts it is not
    initialised yet; fail first, with the fix, if something in this process already did."""
    initialized = getattr(sys.modules.get("torch_neuronx"), "is_neuron_runtime_initialized", None)
    if initialized is not None and initialized():
        raise WorkerSetupError(
            f"{who()}: the Neuron runtime was already initialised in this process before "
            "TorchNeuronConfig set up the process group (something created a neuron tensor or "
            "called torch.neuron.* in a worker setup hook or at the import of a module Ray "
            "loads on the worker). Move every neuron tensor and device call inside the "
            "training function.")


def check_one_core() -> None:
    """The native process group asserts exactly one visible core per process."""
    cores = parse_cores(os.environ.get(VISIBLE_CORES_VAR, ""))
    if len(cores) != 1:
        raise WorkerSetupError(
            f"{who()}: {VISIBLE_CORES_VAR}={os.environ.get(VISIBLE_CORES_VAR, '')!r} names "
            f"{len(cores)} NeuronCores, but the native Neuron process group drives exactly one "
            "per process. Request resources_per_worker={'neuron_cores': 1} and do not set "
            f"{VISIBLE_CORES_VAR} in TorchNeuronConfig.env or the runtime_env.")


def prepare_neuron_worker() -> None:
    """After the plan is applied (``on_start``): check the worker and let Ray's
    ``ray.train.torch.get_device``/``prepare_model`` use the NeuronCore."""
    check_runtime_untouched()
    check_one_core()
    install_ray_device_manager()


class NeuronTorchDeviceManager:
    """Ray's device-manager interface for the native ``neuron`` device: the device index is the
    local rank (torch-neuronx maps ``neuron:<local rank>`` to the one visible core)."""

    def is_available(self) -> bool:
        return True

    def get_devices(self):
        import torch

        return [torch.device("neuron", worker_context().local_rank)]

    def set_device(self, device) -> None:
        pass  # one device per process: nothing to choose

    def supports_stream(self) -> bool:
        return False

    def create_stream(self, device):
        return None

    def get_stream_context(self, stream):
        return contextlib.nullcontext()

    def get_current_stream(self):
        return None


def install_ray_device_manager() -> None:
    """Ray 2.60 maps ``neuron_cores`` to its CPU device manager
    (``ray/air/_internal/device_manager/__init__.py``: no Neuron entry), so its ``get_device``
    would return ``cpu`` and ``prepare_model`` would leave the model there. Ray caches one
    manager per process in ``_torch_device_manager``; set it to the Neuron one."""
    try:
        import ray.air._internal.device_manager as dm
    except ImportError:
        return
    with dm._torch_device_manager_lock:
        dm._torch_device_manager = NeuronTorchDeviceManager()


def before_process_group() -> None:
    """Import torch_neuronx (it registers the ``neuron`` backend; autoload may be off) and check
    the worker once more, just before the process group is created."""
    try:
        import torch_neuronx  # noqa: F401
    except ImportError as exc:
        raise WorkerSetupError(
            f"{who()}: TorchNeuronConfig(device='neuron') needs the native torch-neuronx on "
            f"every worker, but it cannot be imported ({exc}). Install it: {INSTALL_HINT}; or "
            "use TorchNeuronConfig(device='cpu') to run on CPU.") from exc
    check_runtime_untouched()
    check_one_core()
