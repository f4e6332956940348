"""HSDP through real Ray Train on two nodes (``ray.cluster_utils.Cluster``): 2 nodes x 2 CPU
workers of ``TorchNeuronConfig(device="cpu")``, FSDP2 on a ``("replicate", "fsdp")`` mesh with
one replica per node (``get_sharded_mesh("hsdp")``): parameters sharded within a node,
replicated across nodes. The trained model equals torch's unsharded run. One fit."""

from __future__ import annotations

import pytest

from conftest import connected, fit, write_record

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

STEPS = 3


@pytest.fixture(scope="module")
def two_nodes(two_nodes):
    with connected(two_nodes):
        yield two_nodes


def train_hsdp(config):
    import fsdp2_worker as w
    import ray.train

    import ray_train_xla as rtx

    mesh = rtx.get_sharded_mesh("hsdp")
    model = rtx.prepare_sharded_model(w.make_lm(), mesh, auto_wrap_policy={w.block_class()})
    opt = w.optimizer(model)
    for step in range(STEPS):
        opt.zero_grad()
        w.loss_of(model, w.rows(step, rtx.rank(), rtx.world_size())).backward()
        rtx.clip_grad_norm_(model, 1.0)
        rtx.optimizer_step(opt)
    state = w.named_state(model)
    param = next(model.parameters())
    write_record(config, f"rank{rtx.rank()}", {
        "rank": rtx.rank(), "node_rank": rtx.node_rank(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "mesh": mesh.mesh.tolist(), "axes": list(mesh.mesh_dim_names),
        "placements": str(param.placements), "local_rows": param.to_local().shape[0],
        "rows": param.shape[0],
        "diff": w.max_diff(state["model"], w.reference(STEPS)),
        "moved": w.max_diff(state["model"], w.make_lm().state_dict()),
    })


def test_hsdp_shards_within_a_node_replicates_across_nodes_and_trains_like_one_device(two_nodes):
    from ray.train import ScalingConfig

    from ray_train_xla import TorchNeuronConfig

    _, records = fit(train_hsdp, torch_config=TorchNeuronConfig(device="cpu", timeout_s=120),
                     scaling_config=ScalingConfig(num_workers=4,
                                                  resources_per_worker={"CPU": 1, "slot": 1}))
    assert len(records) == 4
    (mesh,) = {str(r["mesh"]) for r in records}
    assert records[0]["mesh"] == [[0, 1], [2, 3]] and records[0]["axes"] == ["replicate", "fsdp"]
    by_rank = {r["rank"]: r for r in records}
    for row in records[0]["mesh"]:  # each shard group (a row) is one node, the rows two nodes
        assert len({by_rank[r]["node_id"] for r in row}) == 1
        assert {by_rank[r]["node_rank"] for r in row} == {row[0] // 2}
    assert by_rank[0]["node_id"] != by_rank[2]["node_id"]
    for r in records:
        assert r["placements"] == "(Replicate(), Shard(dim=0))"
        assert r["local_rows"] * 2 == r["rows"]  # half of each parameter on each worker
        assert r["moved"] > 1e-3 and r["diff"] <= 1e-5
