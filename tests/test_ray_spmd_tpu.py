"""Real Ray Train: TPU planning with Ray-assigned TPU ids (fake ``TPU`` resources: Ray assigns ids
and sets TPU_* variables as on a TPU host). SPMD on virtual XLA CPU devices (``spmd_train``,
``plain_training``) is checked in test_fsdp2_ray's xla fit, which has the same config."""

import os

import pytest

from conftest import TPU_WITHOUT_CLIENT, connected, fit, is_train_v2, plan_on_cpu, write_record

pytestmark = [pytest.mark.ray]

STEPS = 4
BATCH, IN, HIDDEN = 16, 8, 32


@pytest.fixture(scope="module")
def ray_tpu(one_node):
    """A real local Ray whose node offers 4 fake TPU chips; runs may ask for their TPU plan
    without a TPU client (TPU_WITHOUT_CLIENT)."""
    with connected(one_node, runtime_env=plan_on_cpu()) as ray:
        yield ray


def make_mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )


def make_data():
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5 + 0.1


def train_steps(model, batches, sync=None):
    """Plain SGD on MSE; ``batches`` yields (x, y) per step. Returns the losses."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches:
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sync:
            sync()
        losses.append(loss.item())
    return losses


def spmd_train(config, record: str = "rank0"):
    """A replicated MLP, its batch sharded over the worker's devices (the SPMD test runs it at
    the start of test_fsdp2_ray's xla fit, on the same config)."""
    import torch.distributed as dist
    import torch_xla
    import torch_xla.runtime as xr

    import ray_train_xla as rtx

    model = make_mlp().to(torch_xla.device())
    mesh = rtx.get_mesh()
    x, y = make_data()
    specs = []

    def batches():
        for _ in range(STEPS):
            xb, yb = rtx.shard_batch((x, y), mesh)
            specs.append(rtx.sharding_spec(xb))
            yield xb, yb

    losses = train_steps(model, batches(), sync=torch_xla.sync)
    write_record(config, record, {
        "is_spmd": xr.is_spmd(),
        "devices": xr.global_runtime_device_count(),
        "mesh": dict(mesh.shape()),
        "specs": specs,
        "pg": [dist.get_backend(), dist.get_rank(), dist.get_world_size()],
        "losses": losses,
        "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()],
    })


def plain_training():
    model = make_mlp()
    x, y = make_data()
    losses = train_steps(model, [(x, y)] * STEPS)
    return losses, [p.detach().flatten().tolist() for p in model.parameters()]


TPU_KEYS = ("PJRT_DEVICE", "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_HOST_BOUNDS",
            "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_ADDRESSES",
            "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "RANK", "LOCAL_RANK")


def record_tpu_env(config):
    import ray

    ctx = ray.train.get_context()
    write_record(config, f"rank{ctx.get_world_rank()}", {
        "ray_tpu_ids": ray.get_runtime_context().get_accelerator_ids().get("TPU", []),
        "env": {k: os.environ.get(k) for k in TPU_KEYS},
    })


# No TPU here: the process group goes through gloo and SPMD is not switched on, so that no TPU
# client is created; everything else is the real TPU plan applied on Ray workers.
NO_TPU_CLIENT = TPU_WITHOUT_CLIENT


def test_tpu_spmd_worker_owns_the_chips_ray_assigned(ray_tpu):
    from ray.train import ScalingConfig

    from ray_train_xla import TorchXLAConfig

    config = TorchXLAConfig(device="auto", spmd=True, timeout_s=120, env=NO_TPU_CLIENT)
    scaling = ScalingConfig(num_workers=1, use_tpu=True, resources_per_worker={"TPU": 4})
    _, records = fit(record_tpu_env, torch_config=config, scaling_config=scaling)
    (rec,) = records
    env = rec["env"]
    assert sorted(rec["ray_tpu_ids"], key=int) == ["0", "1", "2", "3"]
    assert env["PJRT_DEVICE"] == "TPU"
    assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,2,1"
    assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "1,1,1"
    assert env["TPU_PROCESS_ADDRESSES"] == "localhost:8476"
    assert (env["TPU_PROCESS_PORT"], env["CLOUD_TPU_TASK_ID"]) == ("8476", "0")


def test_tpu_per_chip_follows_ray_assigned_chips(ray_tpu):
    from ray.train import ScalingConfig

    from ray_train_xla import TorchXLAConfig

    if is_train_v2():
        pytest.skip("Train V2 places several TPU workers only on a real TPU slice "
                    "(use_tpu with topology and accelerator_type reserve a SlicePlacementGroup)")
    config = TorchXLAConfig(device="auto", timeout_s=120, env=NO_TPU_CLIENT)
    scaling = ScalingConfig(num_workers=2, resources_per_worker={"TPU": 1, "CPU": 1})
    _, records = fit(record_tpu_env, torch_config=config, scaling_config=scaling)
    assert len(records) == 2
    chips = []
    for rec in records:
        env = rec["env"]
        (chip,) = rec["ray_tpu_ids"]
        chips.append(chip)
        assert env["PJRT_DEVICE"] == "TPU"
        assert env["TPU_VISIBLE_CHIPS"] == chip  # Ray set it too; one chip per process
        assert env["TPU_PROCESS_PORT"] == str(8476 + int(chip))
        # Ray's bounds for a 1-chip allocation (1,1,1) are replaced by the 2-process grid.
        assert env["TPU_PROCESS_BOUNDS"] == env["TPU_HOST_BOUNDS"] == "1,2,1"
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_CHIPS_PER_HOST_BOUNDS"] == "1,1,1"
    assert len(set(chips)) == 2
    assert len({rec["env"]["TPU_PROCESS_ADDRESSES"] for rec in records}) == 1
    addresses = records[0]["env"]["TPU_PROCESS_ADDRESSES"].split(",")
    assert addresses == [f"localhost:{8476 + int(c)}" for c in sorted(chips, key=int)]
    assert sorted(int(r["env"]["CLOUD_TPU_TASK_ID"]) for r in records) == [0, 1]
