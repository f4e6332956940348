"""Shared fixtures: one real local Ray per test module, always shut down."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Ray workers import the test modules that define training functions: put them on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p
)


@contextlib.contextmanager
def local_ray(num_cpus: int = 6, **init_kwargs):
    """A real local Ray instance (fake resources, runtime_env, ... in ``init_kwargs``), shut
    down on exit even when a test fails."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # address="local": never attach to a cluster another test or program left behind.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             **init_kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray instance shared by a module."""
    with local_ray() as ray:
        yield ray


def fit(train_fn, num_workers: int = 1, torch_config=None, loop_config=None, **trainer_kwargs):
    """Run TorchTrainer.fit() and return (result, records): one JSON record per file the
    workers wrote into ``config["out_dir"]`` (Train V2 reports no metrics without a checkpoint).
    """
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    out_dir = tempfile.mkdtemp(prefix="rtx-test-out-")
    config = dict(loop_config or {})
    config["out_dir"] = out_dir
    scaling = trainer_kwargs.pop("scaling_config", None) or ScalingConfig(num_workers=num_workers)
    run_config = trainer_kwargs.pop("run_config", None) or RunConfig(
        storage_path=tempfile.mkdtemp(prefix="rtx-test-results-")
    )
    result = TorchTrainer(
        train_fn,
        train_loop_config=config,
        torch_config=torch_config or TorchXLAConfig(device="cpu", timeout_s=120),
        scaling_config=scaling,
        run_config=run_config,
        **trainer_kwargs,
    ).fit()
    records = []
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            records.append(json.load(f))
    return result, records


def fit_failure(train_fn, **fit_kwargs) -> str:
    """Run ``fit()``, which must fail; return the error message the user sees."""
    with pytest.raises(Exception) as info:
        fit(train_fn, **fit_kwargs)
    return str(info.value)


def neuron_scaling(workers: int, cores_per_worker: int = 1):
    """ScalingConfig for workers with fake NeuronCores (``neuron_cores`` resource)."""
    from ray.train import ScalingConfig

    return ScalingConfig(num_workers=workers,
                         resources_per_worker={"CPU": 1, "neuron_cores": cores_per_worker})


def write_record(config: dict, name: str, record: dict) -> None:
    """Called on a worker: leave a JSON record for the test to read."""
    with open(os.path.join(config["out_dir"], f"{name}.json"), "w") as f:
        json.dump(record, f)


def is_train_v2() -> bool:
    from ray.train.v2._internal.constants import is_v2_enabled

    return is_v2_enabled()


DOUBLES_DIR = os.path.join(TESTS_DIR, "doubles")


def with_neuron_doubles() -> dict:
    """A job runtime_env that puts the Neuron SDK test doubles on the workers' import path, and
    lets a run ask for its Neuron plan to run on CPU (``NEURON_ON_CPU``)."""
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([DOUBLES_DIR, os.environ["PYTHONPATH"]])},
            "worker_process_setup_hook": "neuron_on_cpu.install"}


# Workers here have no NeuronCores: with this in TorchXLAConfig.env (and a job started with
# with_neuron_doubles()), the process group runs on CPU/gloo while every other variable is the
# Neuron plan under test (see neuron_on_cpu.py).
NEURON_ON_CPU = {"RTX_TEST_NEURON_ON_CPU": "1"}


def start_cluster(nodes: int = 2, cpus_per_node: int = 3, runtime_env=None, **node_resources):
    """A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), connected.

    Every node gets ``slot`` = 2 so that two workers asking for ``{"slot": 1}`` land per node.
    """
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster()
    try:
        for _ in range(nodes):
            cluster.add_node(
                num_cpus=cpus_per_node,
                resources={"slot": 2, **node_resources},
                include_dashboard=False,
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def stop_cluster(cluster) -> None:
    import ray

    ray.shutdown()
    cluster.shutdown()
