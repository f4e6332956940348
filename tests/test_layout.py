"""The parallelism layout (planning/layout.py): sizes resolved for a job, each rank's
coordinates in init_device_mesh's order, and the refusals before any worker starts."""

from __future__ import annotations

import itertools

import pytest

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning.layout import DIMS, Layout, Parallelism


def test_resolve_fills_dp_shard_with_what_the_others_leave():
    assert Parallelism(tp=2).resolve(8) == Layout(dp_replicate=1, dp_shard=4, tp=2)
    assert Parallelism(tp=2, dp_replicate=2).resolve(8) == Layout(2, 2, 2)
    assert Parallelism().resolve(5) == Layout(1, 5, 1)
    assert Parallelism.of({"tp": 4}).resolve(4).describe() == "FSDP 1 x TP 4"
    assert Layout(2, 4, 2).describe() == "2 replicas x FSDP 4 x TP 2"


@pytest.mark.parametrize("request_, world, words", [
    (Parallelism(tp=3), 8, ["tp=3", "multiple of 3", "has 8", "tp among [1, 2, 4, 8]"]),
    (Parallelism(tp=2, dp_shard=2), 8, ["makes 4 devices", "has 8", "dp_shard=-1"]),
    ({"tp": 2, "pp": 2}, 8, ["'pp' is not a dimension", "dp_replicate, dp_shard, tp"]),
    ({"tp": 0}, 8, ["tp=0", "an int >= 1"]),
    ({"tp": True}, 8, ["tp=True"]),
    ({"dp_shard": -2}, 8, ["dp_shard=-2", "-1 for every device"]),
    ("tp=2", 8, ["expected None, ray_train_xla.Parallelism"]),
])
def test_bad_requests_name_the_dimension_and_what_fits(request_, world, words):
    with pytest.raises(XLAConfigError) as info:
        Parallelism.of(request_).resolve(world)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_coordinates_follow_init_device_mesh_row_major_order():
    """Rank r sits at the index of r in a row-major array of shape (dp_replicate, dp_shard,
    tp): the order torch's init_device_mesh lays ranks out in."""
    layout = Layout(2, 3, 2)
    for rank, coords in enumerate(itertools.product(*(range(s) for s in layout.shape))):
        assert layout.coordinates(rank) == dict(zip(DIMS, coords))
        assert layout.rank_of(dict(zip(DIMS, coords))) == rank
    # Tensor-parallel peers are consecutive ranks and share their data-parallel rank.
    assert layout.group(5, "tp") == [4, 5]
    assert layout.dp_rank(4) == layout.dp_rank(5) == 2
    assert [layout.dp_rank(r) for r in range(layout.world)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert layout.group(0, "dp_shard") == [0, 2, 4]
    assert Layout.from_text(layout.to_text()) == layout


def test_tensor_parallel_groups_stay_inside_a_node():
    two_nodes_of_4 = ["a"] * 4 + ["b"] * 4
    Layout(1, 2, 4).check_nodes(two_nodes_of_4, "TorchNeuronConfig")
    Layout(1, 4, 2).check_nodes(two_nodes_of_4, "TorchNeuronConfig")
    with pytest.raises(XLAConfigError) as info:
        Layout(1, 1, 8).check_nodes(two_nodes_of_4, "TorchNeuronConfig", "more workers per node")
    assert "ranks 0 to 7" in str(info.value) and "across 2 nodes" in str(info.value)
    assert "tp among [1, 2, 4]" in str(info.value) and "more workers per node" in str(info.value)
    # Nodes of 3: tp=2 would put ranks 2 and 3 on two nodes.
    with pytest.raises(XLAConfigError, match="ranks 2 to 3"):
        Layout(1, 3, 2).check_nodes(["a"] * 3 + ["b"] * 3, "TorchTPUConfig")


def test_tp_must_divide_the_models_heads_and_mlp():
    Layout(1, 1, 8).check_model(heads=64, kv_heads=8, mlp=28672)
    with pytest.raises(XLAConfigError) as info:
        Layout(1, 1, 16).check_model(heads=64, kv_heads=8, mlp=28672)
    assert "16 does not divide the model's 8 key/value heads" in str(info.value)
    assert "[1, 2, 4, 8]" in str(info.value)
    with pytest.raises(XLAConfigError, match="vocabulary"):
        Layout(1, 1, 4).check_model(heads=8, kv_heads=8, mlp=64, vocab=50257)


def test_check_scaling_config_refuses_a_layout_the_workers_cannot_make():
    """Before fit(): the config's parallelism against each end of the worker count."""
    from ray.train import ScalingConfig

    import ray_train_xla as rtx

    assert rtx.check_scaling_config(ScalingConfig(num_workers=8),
                                    rtx.TorchNeuronConfig(parallelism={"tp": 4})) == (8, 8)
    with pytest.raises(XLAConfigError) as info:
        rtx.check_scaling_config(ScalingConfig(num_workers=6),
                                 rtx.TorchTPUConfig(parallelism={"tp": 4}))
    assert "ScalingConfig(num_workers=6)" in str(info.value) and "tp among [1, 2, 3, 6]" in str(info.value)
    with pytest.raises(XLAConfigError, match=r"needs a multiple of 8 devices, but the job has 4"):
        rtx.check_scaling_config(ScalingConfig(num_workers=(4, 8)),
                                 rtx.TorchNeuronConfig(parallelism={"tp": 2, "dp_shard": 4}))
