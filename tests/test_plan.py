"""Planner unit tests: topologies to environments, pure (no Ray, no torch_xla)."""

import time

import pytest

from ray_train_xla import TorchNeuronConfig, TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan, resolve_device
from ray_train_xla.planning.topology import Topology, WorkerFacts

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


def test_cpu_process_group_is_xla_for_one_worker_and_the_development_mode_for_several():
    one = cpu_plan([1])[0].env
    assert one["RAY_TRAIN_XLA_PG_BACKEND"] == "xla"
    assert one["RAY_TRAIN_XLA_INIT_METHOD"] == "xla://"
    assert "RAY_TRAIN_XLA_CPU_DEVMODE" not in one and "PJRT_LOCAL_PROCESS_RANK" not in one
    for p in cpu_plan([2, 1]):
        assert p.env["RAY_TRAIN_XLA_PG_BACKEND"] == "xla_host"
        assert p.env["RAY_TRAIN_XLA_INIT_METHOD"] == "env://"
        assert p.env["RAY_TRAIN_XLA_CPU_DEVMODE"] == "1"
        # torch_xla's local ordinal and local process count follow the worker's place
        assert p.env["PJRT_LOCAL_PROCESS_RANK"] == str(p.place.local_rank)
        assert p.env["PJRT_LOCAL_PROCESS_COUNT"] == str(p.place.local_world_size)
    # SPMD on one CPU worker: one mesh over its virtual devices, no development mode
    (one,) = cpu_plan([1], spmd=True, cpu_devices_per_worker=2)
    assert "RAY_TRAIN_XLA_CPU_DEVMODE" not in one.env
    assert one.env["RAY_TRAIN_XLA_PG_BACKEND"] == "gloo"


@pytest.mark.parametrize("counts", [[1, 1], [2], [2, 1]])
def test_several_spmd_workers_on_the_cpu_are_refused_naming_why_and_the_fix(counts):
    """Each CPU worker's mesh would be its own (nothing crosses workers): refused before any
    worker starts, whatever the nodes, with the one-worker fix."""
    with pytest.raises(XLAConfigError) as info:
        cpu_plan(counts, spmd=True, cpu_devices_per_worker=2)
    message = str(info.value)
    assert f"with {sum(counts)} workers each one's SPMD mesh would hold only its own" in message
    assert "ScalingConfig(num_workers=1)" in message and "cpu_devices_per_worker" in message
    assert "spmd=False" in message


@pytest.mark.parametrize("device", ["cpu", "neuron", "tpu"])
def test_ray_torch_config_variables_on_every_device(device):
    resource = {"cpu": None, "neuron": "neuron_cores", "tpu": "TPU"}[device]
    facts = [WorkerFacts(node_id=f"n{i // 2}", node_ip=f"10.0.0.{i // 2 + 1}", pid=100 + i,
                         accelerator_ids={resource: (str(i % 2),)} if resource else {})
             for i in range(4)]
    topology = Topology.from_facts(facts, resource)
    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="r", extra_ports=(29501,))
    plans = plan(topology, TorchXLAConfig(device=device), rdzv, device, facts)
    for p in plans:
        assert p.env["NODE_RANK"] == p.env["GROUP_RANK"] == str(p.place.node_rank)
        assert p.env["ACCELERATE_TORCH_DEVICE"] == "xla:0"
        # the development mode is for CPU workers only, never on an accelerator
        assert ("RAY_TRAIN_XLA_CPU_DEVMODE" in p.env) is (device == "cpu")


def test_user_env_is_applied_and_timeout_travels():
    plans = cpu_plan([2], env={"MY_FLAG": 7}, timeout_s=42)
    assert all(p.env["MY_FLAG"] == "7" for p in plans)
    assert all(p.env["RAY_TRAIN_XLA_TIMEOUT_S"] == "42" for p in plans)


@pytest.mark.parametrize("var,owner", [
    ("MASTER_PORT", "reserves free ports"),
    ("WORLD_SIZE", "ScalingConfig"),
    ("PJRT_DEVICE", "the device option"),
    ("NEURON_RT_VISIBLE_CORES", "neuron_cores"),
    ("NEURON_RT_ROOT_COMM_ID", "reserves free ports"),
    ("CLOUD_TPU_TASK_ID", "ScalingConfig"),
    ("TPU_PROCESS_BOUNDS", "tpu_process_bounds"),
    ("XLA_USE_SPMD", "the spmd option"),
    ("RAY_TRAIN_XLA_PG_BACKEND", "our own variable"),
    ("RAY_TRAIN_XLA_SOMETHING_NEW", "ray_train_xla's own"),
])
def test_user_env_may_not_override_a_planned_variable(var, owner):
    with pytest.raises(XLAConfigError, match=f"env\\['{var}'\\]") as info:
        TorchXLAConfig(device="cpu", env={var: "1"})
    assert owner in str(info.value)
    with pytest.raises(XLAConfigError, match=var):
        TorchNeuronConfig(env={var: "1"})


def test_every_planned_variable_has_an_owner():
    # The refusal above covers the whole plan: every variable any plan sets is in the contract
    # (or is one of the few a user may also set, such as the compile cache and interfaces).
    from ray_train_xla.planning.contract import PLANNED_BY_OPTION
    from ray_train_xla.planning.topology import described_facts

    user_settable = {"ACCELERATE_TORCH_DEVICE", "NEURON_COMPILE_CACHE_URL", "FI_PROVIDER",
                     "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "CCOM_SOCKET_IFNAME",
                     "NCCL_SOCKET_IFNAME", "XLA_TRANSFER_SEED_ASYNC", "NCCL_ASYNC_ERROR_HANDLING",
                     "TORCH_NEURONX_NEFF_CACHE_DIR", "USE_TORCH_XLA"}
    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=1, run_id="r", extra_ports=(2,))
    seen: set[str] = set()
    for device, kwargs, per_worker in (
            ("cpu", {}, 0), ("cpu", dict(spmd=True, cpu_devices_per_worker=4), 0),
            ("neuron", dict(neuron_parallel_compile=True, efa=True, compile_cache="/c"), 1),
            ("neuron", dict(runtime="xrt"), 1), ("tpu", {}, 1)):
        facts = described_facts([2, 2] if not kwargs.get("spmd") else [1], per_worker,
                                network_interface="eth0")
        topology = Topology.from_facts(facts, "accelerator")
        if device == "tpu":
            facts = [WorkerFacts(**{**f.__dict__, "accelerator_ids": {"TPU": f.accelerator_ids[
                "accelerator"]}}) for f in facts]
            topology = Topology.from_facts(facts, "TPU")
        elif device == "neuron":
            facts = [WorkerFacts(**{**f.__dict__, "accelerator_ids": {"neuron_cores": f.accelerator_ids[
                "accelerator"]}}) for f in facts]
            topology = Topology.from_facts(facts, "neuron_cores")
        for p in plan(topology, TorchXLAConfig(device=device, **kwargs), rdzv, device, facts):
            seen.update(p.env)
    for native_device in ("neuron", "cpu"):
        facts = [WorkerFacts(node_id="n", node_ip="10.0.0.1", pid=i,
                             accelerator_ids={"neuron_cores": (str(i),)}) for i in range(2)]
        config = TorchNeuronConfig(device=native_device, compile_cache="/fsx")
        seen.update(plan(Topology.from_facts(facts, "neuron_cores"), config, rdzv,
                         native_device, facts)[0].env)
    assert seen - user_settable - set(PLANNED_BY_OPTION) == set()


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


def test_a_refusal_reads_in_the_apis_words_and_in_plans_flags():
    """One message, two spellings: the backend's refusal names ScalingConfig and the config's
    fields; ``for_plan`` (what ``ray-train-xla plan`` prints) names plan's flags. It pickles
    (Ray carries it from a worker) as its API text."""
    import pickle

    from ray_train_xla.errors import Term

    with pytest.raises(XLAConfigError) as info:
        cpu_plan([1, 1], spmd=True, cpu_devices_per_worker=2)
    api, flags = str(info.value), info.value.for_plan()
    assert api.startswith("spmd=True is not valid") and "ScalingConfig(num_workers=1)" in api
    assert flags.startswith("--spmd is not valid") and "ScalingConfig" not in flags
    assert "--nodes 1 --workers-per-node 1 --cpu-devices-per-worker <devices>" in flags
    assert "without --spmd" in flags and "spmd=" not in flags
    error = XLAConfigError(
        "use ", Term("resources_per_worker={'TPU': 1}", "--accelerators-per-worker 1"), ".")
    assert str(error) == "use resources_per_worker={'TPU': 1}." and error.for_plan() == (
        "use --accelerators-per-worker 1.")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is XLAConfigError and str(copy) == str(error)
