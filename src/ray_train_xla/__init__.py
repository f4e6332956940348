"""Ray Train's TorchTrainer on AWS Trainium and TPU, with the CPU for development.

Driver side: pass one config as ``torch_config``: ``TorchNeuronConfig()`` for native TorchNeuron
(Neuron SDK 2.30+), ``TorchTPUConfig()`` for native TorchTPU (``torch-tpu``), ``TorchXLAConfig()``
for torch_xla (Trainium's XLA SDK up to Neuron 2.29, TPU, CPU). Inside
the training function: the toolkit helpers below (device, ranks, collectives, data loading,
optimizer step, checkpoints, compile metrics) run the same code on every device.

The package, by role (imports go down this list, never up):

- ``errors``: every error type;
- ``planning/``: options, topology, the environment contract, one module per runtime (no Ray,
  no torch);
- ``toolkit/``: what the training function calls;
- ``startup/``: what runs on every worker at start-up and shutdown;
- ``driver/``: the config classes and Ray's Backend classes;
- ``tools/``: the ``ray-train-xla`` command (plan, doctor, demo, consolidate).

Names are imported on first use, so ``import ray_train_xla.planning`` loads neither Ray nor
torch, and of the toolkit the driver imports only the memory tier's store
(``toolkit/checkpoint/memory/store.py``), which loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it. The toolkit's names are public too: its
# ``__all__``, each imported on first use by ``ray_train_xla.toolkit`` itself.
_EXPORTS = {
    **dict.fromkeys(("TorchXLAConfig", "TorchNeuronConfig", "check_scaling_config", "TorchTPUConfig"),
                    "ray_train_xla.driver.config"),
    **dict.fromkeys(("NeuronOptions", "TPUOptions", "XLAOptions"), "ray_train_xla.planning.options"),
    **dict.fromkeys(("Layout", "Parallelism"), "ray_train_xla.planning.layout"),
    **dict.fromkeys(("XLAConfigError", "WorkerSetupError", "XLAInitError", "RendezvousTimeoutError",
                     "NeuronCompileError", "ShardedStateError", "CheckpointMismatchError",
                     "ReportError", "RecoveryError"), "ray_train_xla.errors"),
    "recoverable": "ray_train_xla.startup.recovery",
}
_TOOLKIT = "ray_train_xla.toolkit"


def __getattr__(name: str) -> Any:
    toolkit = importlib.import_module(_TOOLKIT).__all__
    if name == "__all__":
        value: Any = sorted({*_EXPORTS, *toolkit})
    elif name in _EXPORTS or name in toolkit:
        value = getattr(importlib.import_module(_EXPORTS.get(name, _TOOLKIT)), name)
    else:
        raise AttributeError(f"module 'ray_train_xla' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*__getattr__("__all__"), *globals()})  # __all__ first: it joins the globals
