"""Run a Neuron (or TPU) plan on CPU workers (these machines have neither NeuronCores nor TPUs).

``TorchXLAConfig.env`` may not override planned variables, so the tests do it where nothing
else can: a Ray ``worker_process_setup_hook`` (``install``) wraps the worker's
``planned_env`` so that, for a run whose config carries one of the markers below set to ``1``,
the process group runs on CPU/gloo while every other variable is the plan under test:

* ``RTX_TEST_NEURON_ON_CPU``: the Neuron plan, on the CPU PJRT device.
* ``RTX_TEST_TPU_WITHOUT_CLIENT``: the TPU plan, without SPMD switched on, so that no TPU client
  is created (PJRT_DEVICE stays TPU; the training function must not touch the XLA device).

The hook changes nothing for a run without a marker, so one job may serve both kinds of run.
"""

from __future__ import annotations

MARKER = "RTX_TEST_NEURON_ON_CPU"
TPU_MARKER = "RTX_TEST_TPU_WITHOUT_CLIENT"
CPU_PROCESS_GROUP = {
    "RAY_TRAIN_XLA_PG_BACKEND": "gloo",
    "RAY_TRAIN_XLA_INIT_METHOD": "env://",
}
OVERRIDES = {MARKER: {"PJRT_DEVICE": "CPU", **CPU_PROCESS_GROUP},
             TPU_MARKER: {"RAY_TRAIN_XLA_SPMD": "0", **CPU_PROCESS_GROUP}}


def install() -> None:
    from ray_train_xla.startup import environment

    original = environment.planned_env

    def planned_env(index):
        env = original(index)
        for marker, overrides in OVERRIDES.items():
            if env.get(marker) == "1":
                env = {**env, **overrides}
        return env

    environment.planned_env = planned_env
