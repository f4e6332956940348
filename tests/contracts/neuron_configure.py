"""Run torch_xla's own Neuron initialisation on planned environments.

Reads a JSON list of environments on stdin. Imports torch_xla once, then for each environment
forks a fresh child whose environment is exactly that one, calls
``torch_xla._internal.neuron.configure_pjrt_environment()`` there (what ``import torch_xla``
runs on a Neuron host without torch-neuronx), and reports what the child's environment holds
afterwards (or the error). Prints a JSON list, one result per environment.
"""

import json
import os
import sys

import torch_xla._internal.neuron as neuron

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fork import run_forked  # noqa: E402

WATCHED = ("NEURON_RT_VISIBLE_CORES", "NEURON_PJRT_PROCESS_INDEX", "PJRT_LOCAL_PROCESS_RANK",
           "NEURON_RT_ROOT_COMM_ID", "NEURON_PJRT_WORLD_SIZE", "PJRT_LOCAL_PROCESS_COUNT",
           "NEURON_PJRT_PROCESSES_NUM_DEVICES", "XLA_USE_SPMD")


def configure() -> dict:
    neuron.configure_pjrt_environment()
    return {"env": {k: os.environ.get(k) for k in WATCHED}}


if __name__ == "__main__":
    envs = json.load(sys.stdin)
    json.dump([run_forked(env, configure) for env in envs], sys.stdout)
