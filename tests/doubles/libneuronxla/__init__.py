"""Test double of the Neuron SDK's libneuronxla (see tests/doubles/README.md)."""

import os

if os.environ.get("RTX_TEST_HIDE_NEURON") == "1":
    raise ImportError("libneuronxla is hidden on this worker (RTX_TEST_HIDE_NEURON=1)")


def configure_environment() -> None:
    """The SDK sets Neuron runtime defaults here; torch_xla calls it at import (Neuron path)."""
