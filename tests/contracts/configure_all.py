"""Neuron and TPU contracts in one interpreter (torch_xla is imported once for both).

Reads ``{"neuron": [env, ...], "tpu": [[env, local_rank, local_world_size], ...]}`` on stdin and
prints ``{"neuron": [...], "tpu": [...]}``: each case in its own forked child, as
``neuron_configure.py`` and ``tpu_configure.py`` run them.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import neuron_configure  # noqa: E402
import tpu_configure  # noqa: E402
from _fork import run_forked  # noqa: E402

if __name__ == "__main__":
    cases = json.load(sys.stdin)
    json.dump({
        "neuron": [run_forked(env, neuron_configure.configure) for env in cases["neuron"]],
        "tpu": [run_forked(env, tpu_configure.case(lr, lw)) for env, lr, lw in cases["tpu"]],
    }, sys.stdout)
