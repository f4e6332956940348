"""Real Ray Train + real torch_xla on CPU, end to end (run under Train V2 and V1). The helpers'
collectives on several workers, and a fresh run id for every fit, are checked with the other
multi-worker checks in test_devmode_ray.py (same fits)."""

import pytest

from conftest import fit, write_record

pytestmark = pytest.mark.ray


def raw_xla_all_reduce(config):
    """One worker, plain torch_xla code: the 'xla' process group and xm.all_reduce."""
    import os

    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    out = xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, 3, device=device)).cpu()
    write_record(config, "rank0", {
        "equal": torch.equal(out, torch.ones(2, 3)),
        "pg_backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "env": {k: os.environ.get(k) for k in ("PJRT_DEVICE", "TORCHELASTIC_RUN_ID")},
    })


@pytest.mark.e2e  # xla:// rendezvous of real torch_xla processes: test_rendezvous_errors.py
def test_one_worker_runs_raw_torch_xla(ray_local):
    _, records = fit(raw_xla_all_reduce, num_workers=1)
    (rec,) = records
    assert rec["equal"] is True
    assert rec["pg_backend"] == "xla" and rec["world"] == 1
    assert rec["env"]["PJRT_DEVICE"] == "CPU"


def test_demo_seed_check(ray_local):
    from ray_train_xla.tools.demo import run_demo

    summary = run_demo(workers=2, iterations=3, device="cpu")
    assert summary.ok and summary.workers == 2 and summary.iterations == 3
    assert summary.device.startswith("xla") and summary.pjrt_device == "CPU"
    assert summary.process_group == "xla_host"


@pytest.mark.e2e
def test_train_demo_then_a_resumed_run_that_fails_midway_ends_at_its_target(ray_local, tmp_path):
    """`demo --train`'s run (8 steps, the packaged train_mlp), then `train_mlp.py --resume` for
    8 more: it fails once after step 12 and restarts from its step-12 checkpoint, and still ends
    at step 16, the target fixed when it started (not 8 steps past the restart's checkpoint)."""
    import os

    from ray_train_xla.tools.demo import load_example, run_train_demo

    storage = str(tmp_path / "runs")
    first = run_train_demo(workers=2, steps=8, device="cpu", storage_path=storage, report_every=4)
    assert first.ok and [m["step"] for m in first.history] == [4, 8]

    mlp = load_example("train_mlp")
    config = mlp.default_config(steps=8, report_every=4)
    config.update(more=True, crash_at=12, marker_dir=str(tmp_path / "markers"))
    result = mlp.build_trainer(2, config, storage, "train_mlp", "cpu", keep=None).fit()
    # every rank failed once, after step 12
    assert sorted(os.listdir(tmp_path / "markers")) == ["train_mlp_crashed_rank0",
                                                         "train_mlp_crashed_rank1"]
    assert result.metrics["step"] == 16
    steps = sorted(m["step"] for _, m in result.best_checkpoints)
    assert 12 in steps and max(steps) == 16, steps
