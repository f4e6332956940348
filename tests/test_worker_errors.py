"""Errors only a worker can know are reported naming the worker, and stop the run."""

import pytest

from ray_train_xla import TorchXLAConfig

from conftest import connected, fit_failure, neuron_scaling
from neuron_probe import neuron_env_probe

# In `make test-e2e`: `make test` has a worker naming itself in a start error in
# test_neuron_ray.py (a missing compile module) and the message in test_native_plan.py.
pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def ray_with_early_import(one_node):
    # Every worker imports torch_xla as soon as it starts, before any backend runs.
    with connected(one_node, runtime_env={
            "worker_process_setup_hook": "neuron_probe.import_torch_xla_early"}) as ray:
        yield ray


def test_torch_xla_imported_before_the_neuron_env_is_a_clear_worker_error(ray_with_early_import):
    message = fit_failure(
        neuron_env_probe, scaling_config=neuron_scaling(1),
        torch_config=TorchXLAConfig(device="neuron", timeout_s=60))
    assert "worker rank 0" in message
    assert "torch_xla was imported before ray_train_xla set the neuron environment" in message
