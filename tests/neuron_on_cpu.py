"""Run a Neuron plan on CPU workers (these machines have no NeuronCores).

``TorchXLAConfig.env`` may not override planned variables, so the tests do it where nothing
else can: a Ray ``worker_process_setup_hook`` (``install``) wraps the worker's
``planned_env`` so that, for a run whose config carries ``RTX_TEST_NEURON_ON_CPU=1``, the
process group runs on CPU/gloo while every other variable is the Neuron plan under test.
"""

from __future__ import annotations

MARKER = "RTX_TEST_NEURON_ON_CPU"
OVERRIDES = {
    "PJRT_DEVICE": "CPU",
    "RAY_TRAIN_XLA_PG_BACKEND": "gloo",
    "RAY_TRAIN_XLA_INIT_METHOD": "env://",
}


def install() -> None:
    from ray_train_xla.startup import environment

    original = environment.planned_env

    def planned_env(index):
        env = original(index)
        return {**env, **OVERRIDES} if env.get(MARKER) == "1" else env

    environment.planned_env = planned_env
