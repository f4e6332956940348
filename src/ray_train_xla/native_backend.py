"""The Ray Train backend of native TorchNeuron: XLABackend's gather -> plan -> apply steps
(the plan comes from ``runtimes.native_neuron``), then the ``neuron`` process group created
after ``torch_neuronx`` is imported (or ``gloo`` on CPU). Train V2 and V1."""

from __future__ import annotations

import os

from ray_train_xla import _native_worker
from ray_train_xla.backend import XLABackend, init_process_group
from ray_train_xla.runtimes.base import DEVICE_VAR


class NativeNeuronBackend(XLABackend):
    """Selected by ``TorchNeuronConfig.backend_cls``."""

    def on_training_start(self, worker_group, backend_config) -> None:
        worker_group.execute(init_native_process_group)


def init_native_process_group() -> None:
    """Runs on each worker: the native Neuron steps on Neuron, the plain group on CPU."""
    if os.environ.get(DEVICE_VAR) == "neuron":
        _native_worker.before_process_group()
    init_process_group()
