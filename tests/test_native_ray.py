"""Native TorchNeuron on real Ray (Train V2, and V1 under ``make test-e2e``): two nodes x two
workers with fake ``neuron_cores`` and the torch-neuronx double (Ray's plain
``TorchConfig(backend="neuron")`` fails the same contract on V1 and V2: test_native_plan); and the
same training code on CPU workers without torch_xla.

The double is autoloaded on every worker at ``import torch``, through a ``torch.backends`` entry
point as the real package (``tests/doubles/autoload`` on the workers' path), so a config gets
as far as it would on Trainium, and what the double reads at import (its collective
settings) shows whether the config's ``env`` was in place before torch was imported. The CPU
twin's fit (4 workers, 2 a node) also trains FSDP2 HSDP: sharded within a node, replicated
across the nodes, equal to torch's unsharded run. Two fits under V2, one under V1.
"""

import json
import os
import shutil
import tempfile
from types import SimpleNamespace

import pytest

from ray_train_xla import TorchNeuronConfig

from conftest import (
    DOUBLES_DIR,
    connected,
    fit,
    is_train_v2,
    neuron_scaling,
    write_record,
)

pytestmark = [pytest.mark.ray, pytest.mark.train_v1, pytest.mark.native]

RECORDS = tempfile.mkdtemp(prefix="rtx-native-double-")
VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID", "ACCELERATE_TORCH_DEVICE",
        "TORCH_NEURONX_NEFF_CACHE_DIR", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT")


@pytest.fixture(scope="module")
def two_nodes(two_nodes):
    runtime_env = {
        "env_vars": {"PYTHONPATH": os.pathsep.join([os.path.join(DOUBLES_DIR, "autoload"),
                                                    DOUBLES_DIR, os.environ["PYTHONPATH"]]),
                     "RTX_TEST_RECORD_DIR": RECORDS},
    }
    try:
        with connected(two_nodes, runtime_env=runtime_env):  # 2 fake NeuronCores a node
            yield two_nodes
    finally:
        shutil.rmtree(RECORDS, ignore_errors=True)


def double_records():
    """What the double's process group saw on each rank (latest fit only: cleared before)."""
    out = []
    for name in sorted(os.listdir(RECORDS)):
        if name.startswith("neuron_pg_rank"):
            with open(os.path.join(RECORDS, name)) as f:
                out.append(json.load(f))
    return sorted(out, key=lambda r: r["rank"])


def clear_records():
    shutil.rmtree(RECORDS, ignore_errors=True)
    os.makedirs(RECORDS)


def neuron_probe(config):
    """Record the device, the process group and the variables each worker trains with."""
    import sys

    import ray
    import ray.train.torch
    import torch
    import torch.distributed as dist

    import ray_train_xla as rtx

    native = os.environ.get("RAY_TRAIN_XLA_RUNTIME") == "native"
    ones = torch.ones(1)
    if native:
        total = rtx.all_reduce(ones).item()
    else:
        dist.all_reduce(ones)
        total = ones.item()
    rank = dist.get_rank()
    loader = None
    if native:  # Ray's own helper: sharded as Ray shards, batches for the worker's device
        from torch.utils.data import DataLoader

        prepared = ray.train.torch.prepare_data_loader(DataLoader(list(range(8)), batch_size=1))
        loader = {"len": len(prepared), "rows": list(prepared.sampler)}
    write_record(config, f"rank{rank}", {
        "rank": rank,
        "node_id": ray.get_runtime_context().get_node_id(),
        "ray_cores": list(ray.get_runtime_context().get_accelerator_ids()["neuron_cores"]),
        "env": {k: os.environ.get(k) for k in VARS},
        "rtx_device": str(rtx.get_device()) if native else None,
        "ray_device": str(ray.train.torch.get_device()),
        "backend": dist.get_backend(),
        "total": total,
        "torch_xla_loaded": "torch_xla" in sys.modules,
        "loader": loader,
    })


# Read by torch-neuronx once, at import: through `env`, they must be in place before torch.
READ_AT_IMPORT = {"NEURON_USE_SPLIT_ALLGATHER": "0", "COLLECTIVE_BUCKETSIZE_IN_MB": "64"}


def test_native_neuron_on_two_nodes_passes_the_double(two_nodes):
    clear_records()
    cache = os.path.join(RECORDS, "neff-cache")
    _, records = fit(neuron_probe, scaling_config=neuron_scaling(4),
                     torch_config=TorchNeuronConfig(device="neuron", timeout_s=60,
                                                    compile_cache=cache, env=READ_AT_IMPORT))
    seen = double_records()
    assert [s["rank"] for s in seen] == [0, 1, 2, 3]
    for s in seen:
        assert s["problems"] == []
        assert s["local_rank_source"] == "env" and s["root_comm_preset"]
        assert s["setups_before"] == 0
        assert s["read_at_import"] == {**dict.fromkeys(s["read_at_import"]), **READ_AT_IMPORT}
    assert len({s["node"] for s in seen}) == 2
    assert len({s["root_comm_id"] for s in seen}) == 1
    records = sorted(records, key=lambda r: r["rank"])
    assert len(records) == 4
    for r, s in zip(records, seen):
        env, local = r["env"], int(r["env"]["LOCAL_RANK"])
        assert s["visible_cores"] == r["ray_cores"]  # the one core Ray assigned, V1 too
        assert env["NEURON_RT_VISIBLE_CORES"] == r["ray_cores"][0]
        assert r["rtx_device"] == r["ray_device"] == env["ACCELERATE_TORCH_DEVICE"] == f"neuron:{local}"
        assert r["backend"] == "neuron" and r["total"] == 4.0
        assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == cache
        addr, port = env["NEURON_RT_ROOT_COMM_ID"].rsplit(":", 1)
        assert addr == env["MASTER_ADDR"] and port != env["MASTER_PORT"]
        assert not r["torch_xla_loaded"]
        assert r["loader"] == {"len": 2, "rows": [r["rank"], r["rank"] + 4]}


def train_twin(config):
    """The same loop as on Trainium, on 4 CPU workers (2 a node): helpers only, each worker on
    its quarter of the batch; then FSDP2 HSDP on a ``("replicate", "fsdp")`` mesh, one replica
    per node (``get_sharded_mesh("hsdp")``)."""
    import sys

    import fsdp2_worker as w
    import ray.train.torch
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ray_train_xla as rtx

    torch.manual_seed(rtx.rank())  # different on every worker: prepare_model takes rank 0's
    model = rtx.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    x, y = torch.tensor(config["x"]), torch.tensor(config["y"])
    loader = rtx.prepare_data_loader(DataLoader(TensorDataset(x, y),
                                                batch_size=len(x) // rtx.world_size(),
                                                shuffle=False))
    for _ in range(config["steps"]):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            rtx.optimizer_step(opt)
    compiled = torch.compile(lambda t: t * 2 + 1, backend="eager", dynamic=False)
    before = rtx.metrics()["xla/compiles"]
    compiled(torch.ones(2))
    compiled(torch.ones(3))  # a new shape: one more graph
    rtx.rendezvous("after-compile")
    state = {"model": model.state_dict(), "step": config["steps"]}
    rtx.save_checkpoint(state, metrics={"step": config["steps"]})
    record = {
        "rank": rtx.rank(),
        "weight": model.weight.detach().flatten().tolist(),
        "bias": model.bias.detach().tolist(),
        "compiles": rtx.metrics()["xla/compiles"] - before,
        "broadcast": rtx.broadcast(torch.tensor([float(rtx.rank())]), src=1).item(),
        "mean": rtx.all_reduce(torch.tensor([float(rtx.rank())]), op="mean").item(),
        "devices": [str(rtx.get_device()), str(ray.train.torch.get_device()), str(xb.device)],
        "backend": torch.distributed.get_backend(),
    }

    # HSDP: parameters sharded within a node, replicated across the nodes.
    mesh = rtx.get_sharded_mesh("hsdp")
    lm = rtx.prepare_sharded_model(w.make_lm(), mesh, auto_wrap_policy={w.block_class()})
    lm_opt = w.optimizer(lm)
    for step in range(HSDP_STEPS):
        lm_opt.zero_grad()
        w.loss_of(lm, w.rows(step, rtx.rank(), rtx.world_size())).backward()
        rtx.clip_grad_norm_(lm, 1.0)
        rtx.optimizer_step(lm_opt)
    lm_state = w.named_state(lm)
    param = next(lm.parameters())
    record["hsdp"] = {
        "node_rank": rtx.node_rank(), "node_id": ray.get_runtime_context().get_node_id(),
        "mesh": mesh.mesh.tolist(), "axes": list(mesh.mesh_dim_names),
        "placements": str(param.placements), "local_rows": param.to_local().shape[0],
        "rows": param.shape[0],
        "diff": w.max_diff(lm_state["model"], w.reference(HSDP_STEPS)),
        "moved": w.max_diff(lm_state["model"], w.make_lm().state_dict()),
    }
    # Last: nothing above (Transformers included) brought torch_xla in.
    record["torch_xla_loaded"] = sorted(m for m in sys.modules if m.startswith("torch_xla"))
    write_record(config, f"rank{rtx.rank()}", record)


HSDP_STEPS = 3


@pytest.fixture(scope="module")
def twin(two_nodes):
    """One fit of ``train_twin``: TorchNeuronConfig's CPU twin, 4 workers on the two nodes."""
    import torch
    from ray.train import ScalingConfig

    if not is_train_v2():
        pytest.skip("Train V1 starts native workers in "
                    "test_native_neuron_on_two_nodes_passes_the_double (suite budget)")
    torch.manual_seed(123)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loop = {"x": x.tolist(), "y": y.tolist(), "lr": 0.1, "steps": 3}
    result, records = fit(train_twin, loop_config=loop,
                          scaling_config=ScalingConfig(
                              num_workers=4, resources_per_worker={"CPU": 1, "slot": 1}),
                          torch_config=TorchNeuronConfig(device="cpu", timeout_s=120))
    return SimpleNamespace(x=x, y=y, result=result,
                           records=sorted(records, key=lambda r: r["rank"]))


def test_cpu_twin_four_workers_equal_one_process(twin):
    import torch

    x, y = twin.x, twin.y
    torch.manual_seed(0)  # rank 0's initialisation
    ref = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):  # one process, the whole batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    assert [r["rank"] for r in twin.records] == [0, 1, 2, 3]
    for r in twin.records:
        assert r["torch_xla_loaded"] == []
        assert r["devices"] == ["cpu", "cpu", "cpu"] and r["backend"] == "gloo"
        assert torch.allclose(torch.tensor(r["weight"]), ref.weight.detach().flatten(), atol=1e-5)
        assert torch.allclose(torch.tensor(r["bias"]), ref.bias.detach(), atol=1e-5)
        assert r["compiles"] == 2 and r["broadcast"] == 1.0 and r["mean"] == 1.5
    with twin.result.checkpoint.as_directory() as path:
        saved = torch.load(os.path.join(path, "checkpoint.pt"), weights_only=False)
    assert saved["step"] == 3
    assert torch.allclose(saved["model"]["weight"].flatten(),
                          torch.tensor(twin.records[0]["weight"]))


def test_hsdp_shards_within_a_node_replicates_across_nodes_and_trains_like_one_device(twin):
    records = [r["hsdp"] for r in twin.records]
    assert len({str(r["mesh"]) for r in records}) == 1
    assert records[0]["mesh"] == [[0, 1], [2, 3]] and records[0]["axes"] == ["replicate", "fsdp"]
    for row in records[0]["mesh"]:  # each shard group (a row) is one node, the rows two nodes
        assert len({records[r]["node_id"] for r in row}) == 1
        assert {records[r]["node_rank"] for r in row} == {row[0] // 2}
    assert records[0]["node_id"] != records[2]["node_id"]
    for r in records:
        assert r["placements"] == "(Replicate(), Shard(dim=0))"
        assert r["local_rows"] * 2 == r["rows"]  # half of each parameter on each worker
        assert r["moved"] > 1e-3 and r["diff"] <= 1e-5  # torch's unsharded run of the same data
