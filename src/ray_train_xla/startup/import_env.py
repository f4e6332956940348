"""What a native TorchNeuron worker reads at ``import torch``, in its environment before then.

torch autoloads torch-neuronx at ``import torch``, and torch-neuronx reads its collective
settings once, at import (``NEURON_USE_SPLIT_*``, ``COLLECTIVE_BUCKETSIZE_IN_MB``, ...). On a Ray
Train worker the first ``import torch`` is the unpickling of ``TorchNeuronConfig`` itself (its
module imports ``ray.train.torch``; measured on Train V2, where the run context carrying the
config reaches every worker before the backend's ``on_start``), so setting them in ``on_start`` is
too late. ``TorchNeuronConfig`` therefore pickles as a call to ``rebuild_config``, which lives in
this torch-free module: in a Ray worker process it puts the config's import-time variables
(``planning.runtimes.native_neuron.import_env``) in the environment, then imports the config's
module (and torch with it) and rebuilds the object.

Only in Ray worker processes (the training workers, and Ray Train's controller, where they are
unused): a driver that copies or unpickles a config keeps its environment.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any


def rebuild_config(module: str, qualname: str, state: Mapping[str, Any],
                   env: Mapping[str, str]) -> Any:
    """Unpickle a config: apply ``env`` first (in a Ray worker), then build the object."""
    if in_ray_worker():
        os.environ.update(env)
    cls = getattr(importlib.import_module(module), qualname)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def in_ray_worker() -> bool:
    """True in a Ray worker process (an actor or a task), False in a driver or outside Ray."""
    if "ray" not in sys.modules:
        return False
    try:
        from ray._private import worker
    except ImportError:  # pragma: no cover - another Ray layout
        return False
    return worker.global_worker.mode == worker.WORKER_MODE
