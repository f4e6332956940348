"""Planner unit tests: topologies to environments, pure (no Ray, no torch_xla)."""

import time

import pytest

from ray_train_xla import TorchXLAConfig
from ray_train_xla.runtimes import Rendezvous, plan, resolve_device
from ray_train_xla.topology import Topology, WorkerFacts

RDZV = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="run-1")
TORCHRUN = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID"]


def cpu_plan(counts, **config):
    return plan(Topology.uniform(counts), TorchXLAConfig(device="cpu", **config), RDZV, "cpu")


@pytest.mark.parametrize(
    "counts,expected",
    [
        # (rank, local_rank, node_rank, local_world_size) per worker
        ([1], [(0, 0, 0, 1)]),
        ([4], [(0, 0, 0, 4), (1, 1, 0, 4), (2, 2, 0, 4), (3, 3, 0, 4)]),
        ([2, 2], [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]),
        ([3, 1], [(0, 0, 0, 3), (1, 1, 0, 3), (2, 2, 0, 3), (3, 0, 1, 1)]),
        ([1, 3], [(0, 0, 0, 1), (1, 0, 1, 3), (2, 1, 1, 3), (3, 2, 1, 3)]),
    ],
    ids=["1x1", "1x4", "2x2", "uneven-3+1", "uneven-1+3"],
)
def test_ranks_and_torchrun_contract(counts, expected):
    plans = cpu_plan(counts)
    world = sum(counts)
    assert len(plans) == world
    for p, (rank, local, node, local_world) in zip(plans, expected):
        env = p.env
        assert all(k in env for k in TORCHRUN)
        assert (int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["GROUP_RANK"]),
                int(env["LOCAL_WORLD_SIZE"])) == (rank, local, node, local_world)
        assert (p.place.rank, p.place.local_rank, p.place.node_rank) == (rank, local, node)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == str(world)
        assert env["GROUP_WORLD_SIZE"] == str(len(counts))
        assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
        assert env["TORCHELASTIC_RUN_ID"] == "run-1"
        assert env["PJRT_DEVICE"] == "CPU"
        # integers as integer strings, never "2.0"
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_PORT"):
            assert env[key].isdigit(), (key, env[key])


def test_cpu_process_group_is_xla_for_one_worker_and_gloo_for_several():
    assert cpu_plan([1])[0].env["RAY_TRAIN_XLA_PG_BACKEND"] == "xla"
    assert cpu_plan([1])[0].env["RAY_TRAIN_XLA_INIT_METHOD"] == "xla://"
    for p in cpu_plan([2]):
        assert p.env["RAY_TRAIN_XLA_PG_BACKEND"] == "gloo"
        assert p.env["RAY_TRAIN_XLA_INIT_METHOD"] == "env://"


def test_user_env_is_applied_last_and_timeout_travels():
    plans = cpu_plan([2], env={"PJRT_DEVICE": "CPU", "MY_FLAG": 7}, timeout_s=42)
    assert all(p.env["MY_FLAG"] == "7" for p in plans)
    assert all(p.env["RAY_TRAIN_XLA_TIMEOUT_S"] == "42" for p in plans)
    overridden = cpu_plan([1], env={"MASTER_PORT": "1234"})
    assert overridden[0].env["MASTER_PORT"] == "1234"


def test_ranks_follow_node_ids_not_ips():
    # ray.cluster_utils.Cluster: two nodes, one IP, workers interleaved in rank order.
    facts = [
        WorkerFacts(node_id="b", node_ip="127.0.0.1", pid=1),
        WorkerFacts(node_id="a", node_ip="127.0.0.1", pid=2),
        WorkerFacts(node_id="b", node_ip="127.0.0.1", pid=3),
        WorkerFacts(node_id="a", node_ip="127.0.0.1", pid=4),
    ]
    topo = Topology.from_facts(facts)
    assert [(w.node_rank, w.local_rank) for w in topo.workers] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert topo.num_nodes == 2
    assert [w.local_world_size for w in topo.workers] == [2, 2, 2, 2]


def test_resolve_device_auto():
    cpu = WorkerFacts(node_id="n", node_ip="1.1.1.1", pid=1)
    neuron = WorkerFacts(node_id="n", node_ip="1.1.1.1", pid=2,
                         accelerator_ids={"neuron_cores": ("0",)})
    tpu = WorkerFacts(node_id="n", node_ip="1.1.1.1", pid=3, accelerator_ids={"TPU": ("0",)})
    pjrt_tpu = WorkerFacts(node_id="n", node_ip="1.1.1.1", pid=4, pjrt_device="TPU")
    assert resolve_device("auto", [cpu, cpu]) == "cpu"
    assert resolve_device("auto", [neuron, neuron]) == "neuron"
    assert resolve_device("auto", [tpu]) == "tpu"
    assert resolve_device("auto", [pjrt_tpu]) == "tpu"
    assert resolve_device("cpu", [neuron]) == "cpu"
    with pytest.raises(ValueError, match="PJRT_DEVICE='CUDA'"):
        resolve_device("auto", [WorkerFacts(node_id="n", node_ip="x", pid=5, pjrt_device="CUDA")])


def test_planning_8192_workers_is_fast_and_each_env_is_constant_size():
    topo = Topology.uniform([32] * 256)
    start = time.perf_counter()
    plans = plan(topo, TorchXLAConfig(device="cpu"), RDZV, "cpu")
    elapsed = time.perf_counter() - start
    assert len(plans) == 8192
    assert len({len(p.env) for p in plans}) == 1
    assert elapsed < 2.0  # generous bound for a loaded CI machine; typical is ~0.05 s
