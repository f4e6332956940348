"""Test double: where the Neuron PJRT plugin lives. Importable only with RTX_TEST_NEURON_IMPORT=1,
so that ``import torch_xla`` takes its Neuron path (``_aws_ec2_inf_trn_init``, which runs
``configure_pjrt_environment`` on the environment) only in the tests that ask for it."""

import os

if os.environ.get("RTX_TEST_NEURON_IMPORT") != "1":
    raise ImportError("the Neuron PJRT plugin double is off (set RTX_TEST_NEURON_IMPORT=1)")


def libneuronpjrt_path() -> str:
    return "/nonexistent/libneuronpjrt.so"
