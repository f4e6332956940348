"""Native TorchTPU on real Ray (Train V2, and V1 under ``make test``): two nodes x two workers
with fake ``TPU`` chips and the torch-tpu double (``tests/doubles/torch_tpu``), one fit.

The two nodes form a slice of topology ``1x2x2`` (two hosts of two chips by TorchTPU's (2, 2, 1)
host grid): each node's chip coordinates come from the double's coordinate query, keyed by its
raylet, and the first node of the cluster is the slice's *second* host, so TorchTPU's order is
not the order in which the cluster was built. The CPU twin (the same training function on CPU
workers without torch-tpu) is ``test_native_ray.test_cpu_twin_two_workers_equal_one_process``:
``TorchTPUConfig(device="cpu")`` plans what ``TorchNeuronConfig(device="cpu")`` plans (checked
at planning level in test_native_tpu_plan).
"""

import glob
import json
import os
import shutil
import tempfile

import pytest

from ray_train_xla import TorchTPUConfig

from conftest import DOUBLES_DIR, connected, fit, is_train_v2, write_record

pytestmark = [pytest.mark.ray, pytest.mark.train_v1, pytest.mark.native]

RECORDS = tempfile.mkdtemp(prefix="rtx-tpu-double-")
VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "TPU_VISIBLE_DEVICES",
        "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY", "ACCELERATE_TORCH_DEVICE")


@pytest.fixture(scope="module")
def tpu_slice(two_nodes):
    from ray._private import ray_constants

    nodes = two_nodes.list_all_nodes()
    # The cluster's first node is the slice's second host (z = 1), the other the first.
    coords = {str(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid):
              [0, 0, 1 - i] for i, node in enumerate(nodes)}
    hosts = {node.node_id: c for node, c in zip(nodes, coords.values())}
    runtime_env = {
        "env_vars": {"PYTHONPATH": os.pathsep.join([DOUBLES_DIR, os.environ["PYTHONPATH"]]),
                     "RTX_TEST_RECORD_DIR": RECORDS, "RTX_TEST_TPU_COORDS": json.dumps(coords),
                     "TPU_TOPOLOGY": "1x2x2", "TPU_NAME": "test-slice"},
    }
    try:
        with connected(two_nodes, runtime_env=runtime_env):
            yield hosts
    finally:
        shutil.rmtree(RECORDS, ignore_errors=True)


def tpu_probe(config):
    """What the training function sees: device, ranks, the process group, Ray's helpers."""
    import ray
    import ray.train.torch
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import ray_train_xla as rtx

    rank = rtx.rank()
    total = rtx.all_reduce(torch.ones(1)).item()
    torch.manual_seed(0)  # the same start on every worker (the double's tensors stay on the CPU)
    model = torch.nn.Linear(2, 1)
    start = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.full((1, 2), float(rank + 1))).sum().backward()
    rtx.optimizer_step(opt)  # averages the gradients over the workers through tpu_dist
    step = (start - model.weight.detach()).flatten().tolist()
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2), move_to_device=False)
    # Ray's prepare_model wraps in DDP over the default group (tpu_dist). Where Ray gave the worker
    # TPU chips (V1 here) it also passes device_ids=[tpu], which needs the model on the device: the
    # real package only (the double's tensors stay on the CPU).
    wrapped = None if config["chips"] else ray.train.torch.prepare_model(
        torch.nn.Linear(2, 1), move_to_device=False)
    rtx.rendezvous("probe")
    try:
        torch.tpu.set_device(1)
        set_device_error = ""
    except RuntimeError as exc:
        set_device_error = str(exc)
    write_record(config, f"rank{rank}", {
        "rank": rank, "dist_rank": dist.get_rank(), "ray_rank": ray.train.get_context().get_world_rank(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "ray_chips": list(ray.get_runtime_context().get_accelerator_ids().get("TPU", [])),
        "env": {k: os.environ.get(k) for k in VARS},
        "rtx_device": str(rtx.get_device()), "ray_device": str(ray.train.torch.get_device()),
        "backend": dist.get_backend(), "total": total,
        "batches": [b[0].tolist() for b in loader],
        "set_device_error": set_device_error, "step": step,
        "prepared": type(wrapped).__name__ if wrapped is not None else None,
        "torch_xla_loaded": "torch_xla" in __import__("sys").modules,
    })


def test_native_tpu_on_two_hosts_in_torchtpu_order(tpu_slice):
    from ray.train import ScalingConfig

    for path in glob.glob(os.path.join(RECORDS, "*")):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    # Train V1 hands out the fake TPU chips; V2 accepts a TPU resource only with use_tpu=True,
    # which (for more than one worker) reserves a real TPU slice by node labels: there the
    # workers get no chips, device="tpu" is explicit and each takes the chip of its local rank.
    chips = not is_train_v2()
    _, records = fit(tpu_probe, loop_config={"chips": chips}, scaling_config=ScalingConfig(
        num_workers=4, resources_per_worker={"CPU": 1, "TPU" if chips else "slot": 1}),
        torch_config=TorchTPUConfig(device="auto" if chips else "tpu", timeout_s=60))
    records = sorted(records, key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [r["dist_rank"] for r in records] == [0, 1, 2, 3]
    seen = {}
    for name in glob.glob(os.path.join(RECORDS, "tpu_pg_rank*.json")):
        with open(name) as f:
            view = json.load(f)
        seen[view["rank"]] = view
    assert sorted(seen) == [0, 1, 2, 3]  # every rank went through the double's init
    addresses = records[0]["env"]["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == 4 and len(set(addresses)) == 4
    for r in records:
        env, z = r["env"], tpu_slice[r["node_id"]][2]
        assert env["NODE_RANK"] == str(z)  # TorchTPU's host order, from the coordinates
        assert env["RANK"] == str(2 * z + int(env["LOCAL_RANK"]))
        chip = r["ray_chips"][0] if chips else env["LOCAL_RANK"]
        assert env["TPU_VISIBLE_DEVICES"] == chip == seen[r["rank"]]["chip"]
        assert env["TORCH_TPU_TOPOLOGY"] == "1,2,2"
        assert env["TORCH_TPU_SLICEBUILDER_ADDRESSES"] == ",".join(addresses)
        assert seen[r["rank"]]["own_address"] == addresses[r["rank"]]
        assert r["rtx_device"] == "tpu:0" and r["ray_device"] == "tpu"
        assert env["ACCELERATE_TORCH_DEVICE"] == "tpu:0"
        assert r["backend"] == "tpu_dist" and r["total"] == 4.0
        assert "device 0" in r["set_device_error"]
        assert r["step"] == pytest.approx([0.25, 0.25])  # lr x mean gradient (1+2+3+4)/4
        assert r["prepared"] == (None if chips else "DistributedDataParallel")
        assert not r["torch_xla_loaded"]
    host0 = next(r for r in records if r["env"]["NODE_RANK"] == "0")
    assert {r["env"]["MASTER_ADDR"] for r in records} == {addresses[0].split(":")[0]}
    assert records[0]["node_id"] == host0["node_id"]  # rank 0 is on the slice's first host
    # Ray's prepare_data_loader shards by Ray's rank: every sample once over the workers.
    assert sorted(x for r in records for b in r["batches"] for x in b) == list(range(8))
    # One coordinate query per node, by one of its workers (the other reads its answer).
    queries = glob.glob(os.path.join(RECORDS, "coords-queries", "*"))
    assert len(queries) == 2
