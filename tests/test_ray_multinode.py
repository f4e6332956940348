"""Two Ray nodes on one machine (ray.cluster_utils.Cluster), two workers per node."""

import pytest

from conftest import (
    NEURON_ON_CPU,
    connected,
    fit,
    with_neuron_doubles,
    write_record,
)
from neuron_probe import compile_records, neuron_env_probe

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes(two_nodes):
    # Each node: 3 CPUs, 2 "slot"s and 2 fake NeuronCores; the Neuron SDK double on the path.
    with connected(two_nodes, runtime_env=with_neuron_doubles()):
        yield two_nodes


def where_am_i(config):
    import os

    import ray
    import torch

    import ray_train_xla as rtx

    total = rtx.all_reduce(torch.ones(1, device=rtx.get_device())).cpu().item()
    write_record(config, f"rank{rtx.rank()}", {
        "node_id": ray.get_runtime_context().get_node_id(),
        "rank": rtx.rank(),
        "local_rank": rtx.local_rank(),
        "node_rank": rtx.node_rank(),
        "env": {k: os.environ[k] for k in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "WORLD_SIZE",
                                           "MASTER_ADDR", "MASTER_PORT")},
        "total": total,
    })


# Train V1 on two nodes: test_native_ray and test_native_tpu_ray (the same worker group, ranks
# renumbered by the plan).
def test_ranks_on_two_nodes(two_nodes):
    from ray.train import ScalingConfig

    _, records = fit(
        where_am_i,
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1, "slot": 1}),
    )
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    by_node = {}
    for r in records:
        by_node.setdefault(r["node_id"], []).append(r)
        assert r["env"]["WORLD_SIZE"] == "4"
        assert r["env"]["LOCAL_WORLD_SIZE"] == "2"
        assert r["env"]["GROUP_WORLD_SIZE"] == "2"
        assert r["total"] == 4.0
    assert len(by_node) == 2
    assert sorted(sorted(w["local_rank"] for w in ws) for ws in by_node.values()) == [[0, 1]] * 2
    for workers in by_node.values():
        assert len({w["node_rank"] for w in workers}) == 1  # one node rank per node
    assert sorted(ws[0]["node_rank"] for ws in by_node.values()) == [0, 1]
    # rank 0's node is node 0, and every worker meets at one address
    rank0 = next(r for r in records if r["rank"] == 0)
    assert rank0["node_rank"] == 0 and rank0["local_rank"] == 0
    assert len({(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in records}) == 1


def test_neuron_on_two_nodes_maps_cores_and_compiles_once_per_node(two_nodes):
    import tempfile

    from ray.train import ScalingConfig

    from ray_train_xla import TorchXLAConfig

    records_dir = tempfile.mkdtemp(prefix="rtx-compile-")
    config = TorchXLAConfig(device="neuron", neuron_parallel_compile=True, timeout_s=120,
                            env=dict(NEURON_ON_CPU, RTX_TEST_RECORD_DIR=records_dir))
    _, records = fit(neuron_env_probe, torch_config=config, scaling_config=ScalingConfig(
        num_workers=4, resources_per_worker={"CPU": 1, "neuron_cores": 1}))
    assert len(records) == 4
    nodes = {}
    for r in records:
        nodes.setdefault(r["node_id"], []).append(r)
        assert r["after_init"] == r["ray_cores"][0]  # torch_xla's remap gives Ray's core
        assert r["after_index"] == r["planned"]["RANK"]
    assert len(nodes) == 2
    for workers in nodes.values():
        workers.sort(key=lambda r: int(r["planned"]["LOCAL_RANK"]))
        expected = ",".join(w["ray_cores"][0] for w in workers)
        assert {w["planned"]["NEURON_RT_VISIBLE_CORES"] for w in workers} == {expected}
        assert len({w["planned"]["GROUP_RANK"] for w in workers}) == 1
    assert len({r["planned"]["NEURON_RT_ROOT_COMM_ID"] for r in records}) == 1
    calls = compile_records(records_dir)
    assert sorted(c["node_id"] for c in calls) == sorted(nodes)  # exactly one per node
    assert {c["local_rank"] for c in calls} == {"0"}
