"""Sharded checkpoints through real Ray Train on two nodes (ray.cluster_utils.Cluster): an SPMD
worker on 2 virtual XLA CPU devices trains FSDPv2 and saves; one worker on 4 devices (mesh 2x2),
on whichever node Ray picks, restores it exactly. Two fits. (Several SPMD workers on the CPU
are refused: each one's mesh would be its own; see test_plan.)"""

from __future__ import annotations

import os

import pytest

from conftest import connected, fit, write_record

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def two_nodes(two_nodes):
    with connected(two_nodes):
        yield two_nodes


def sharded_train(config):
    import ray.train
    import sharded_worker as w
    import torch
    import torch_xla.runtime as xr

    import ray_train_xla as rtx

    mesh, model, opt, to_device, sync = w.sharded_setup(tuple(config["mesh"]) or None)
    r = rtx.rank()
    record = {"devices": xr.global_runtime_device_count(), "mesh": dict(mesh.shape()),
              "spec": rtx.sharding_spec(next(model.parameters()))}
    if config.get("load"):
        extra = rtx.load_checkpoint(model, opt, checkpoint=ray.train.Checkpoint(config["load"]))
        expected = torch.load(config["expected"], weights_only=False)
        got = w.cpu_state(model, opt)
        record.update(extra=extra, model_exact=w.exact(got["model"], expected["model"]),
                      optimizer_exact=w.exact(got["optimizer"], expected["optimizer"]))
    else:
        w.train(model, opt, w.STEPS, to_device, sync)
        got = w.plain_keys({k: v.cpu() for k, v in model.state_dict().items()})
        record["max_diff"] = w.max_diff(got, w.reference(w.STEPS))
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": w.STEPS}
        if r == 0:
            torch.save(w.cpu_state(model, opt), config["expected"])
        record["written"] = rtx.save_checkpoint(state, {"step": w.STEPS}, wait=True)
    write_record(config, f"rank{r}", record)


@pytest.mark.e2e  # make test: test_sharded_local.py, and FSDPv2 on Ray in test_fsdp2_ray.py
def test_a_worker_saves_its_shards_another_restores_them_on_another_mesh(two_nodes, tmp_path):
    from ray.train import ScalingConfig

    from ray_train_xla import TorchXLAConfig

    expected = str(tmp_path / "expected.pt")
    result, records = fit(
        sharded_train, loop_config={"mesh": [], "expected": expected},
        torch_config=TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=2, timeout_s=120),
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "slot": 2}),
    )
    assert [r["devices"] for r in records] == [2]
    assert all(r["spec"] == "{devices=[2,1]0,1}" for r in records)
    assert all(r["max_diff"] <= 1e-5 for r in records)
    (written,) = (r["written"] for r in records)
    assert "__0_0.distcp" in written["files"] and ".metadata" in written["files"]
    ckpt = result.checkpoint.path
    names = set(os.listdir(ckpt))
    assert {".metadata", "__0_0.distcp", "extra.pt", "sharded.json"} <= names

    _, (rec,) = fit(
        sharded_train, loop_config={"mesh": [2, 2], "load": ckpt, "expected": expected},
        torch_config=TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=4, timeout_s=120),
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "slot": 2}),
    )
    assert rec["devices"] == 4 and rec["mesh"] == {"fsdp": 2, "model": 2}
    assert rec["model_exact"] and rec["optimizer_exact"]
    assert rec["extra"] == {"step": 3}


# The same training as train_lm's, in a fresh process (SPMD on, no Ray, no checkpoints): the
# uninterrupted reference. Saves the final parameters (CPU, unwrapped names) to argv[2].
LM_REFERENCE = """
import os, sys, numpy as np, torch, torch_xla
import torch_xla.runtime as xr
os.environ["RAY_TRAIN_XLA_SPMD"] = "1"
xr.use_spmd()
import ray_train_xla as rtx
from ray_train_xla.tools.demo import load_example
lm = load_example("train_lm")
config = lm.lm_config(steps=int(sys.argv[1]))
model = rtx.prepare_sharded_model(lm.make_model(config))
optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
data = torch.from_numpy(lm.make_tokens({"id": np.arange(config["rows"])})["tokens"])
b, steps_per_epoch = config["batch_size"], config["rows"] // config["batch_size"]
for step in range(config["steps"]):
    i = step % steps_per_epoch
    optimizer.zero_grad()
    lm.lm_loss(model, rtx.shard_batch(data[i * b:(i + 1) * b])).backward()
    optimizer.step()
    torch_xla.sync()
torch.save({k.replace("_orig_module.", ""): v.cpu() for k, v in model.state_dict().items()},
           sys.argv[2])
"""


@pytest.mark.e2e
def test_lm_crashes_resumes_and_ends_like_an_uninterrupted_run(two_nodes, tmp_path):
    """examples/train_lm.py: a transformer LM sharded over 4 devices with Ray Data batches fails
    once after step 4 and resumes from its step-4 sharded checkpoint; the final parameters equal
    those of the same training run uninterrupted (in a fresh process without Ray)."""
    import subprocess
    import sys

    import torch

    from ray_train_xla.tools.demo import load_example

    lm = load_example("train_lm")
    steps = 8
    config = lm.lm_config(steps=steps, report_every=4, crash_at=4, marker_dir=str(tmp_path),
                          out_dir=str(tmp_path))
    # The uninterrupted reference, in a fresh process without Ray, runs while Ray trains.
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="2")
    ref_file = tmp_path / "reference.pt"
    with open(tmp_path / "reference.err", "w+") as err:
        reference = subprocess.Popen([sys.executable, "-c", LM_REFERENCE, str(steps),
                                      str(ref_file)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=err)
        try:
            result = lm.build_trainer(config, 4, str(tmp_path / "results"), "lm").fit()
            reference.wait(timeout=300)
        finally:
            reference.kill()
        err.seek(0)
        stderr = err.read()
    assert os.path.exists(tmp_path / "train_lm_crashed")  # it did fail once
    assert result.metrics["step"] == steps
    assert sorted(os.listdir(result.checkpoint.path)) == [
        ".metadata", "__0_0.distcp", "extra.pt", "param_groups.pt", "sharded.json"]
    # Saved at 4, then (after the restart from 4) at 8.
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ckpt_step")) == [
        "ckpt_step4_rank0", "ckpt_step8_rank0"]

    assert reference.returncode == 0, stderr[-3000:]
    got = torch.load(tmp_path / "final_params.pt")
    want = torch.load(ref_file)
    assert sorted(got) == sorted(want)
    untrained = lm.make_model(config).state_dict()
    assert any(not torch.allclose(want[k], untrained[k]) for k in want)  # it trained
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=0), k
