"""Real Ray Train + real torch_xla on CPU, end to end (run under Train V2 and V1)."""

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


@pytest.mark.train_v1
def test_one_worker_runs_raw_torch_xla(ray_local):
    _, records = fit(raw_xla_all_reduce, num_workers=1)
    (rec,) = records
    assert rec["equal"] is True
    assert rec["pg_backend"] == "xla" and rec["world"] == 1
    assert rec["env"]["PJRT_DEVICE"] == "CPU"


def collectives_loop(config):
    import os

    import torch
    import torch.distributed as dist

    import ray_train_xla as rtx

    device = rtx.get_device()
    n, r = rtx.world_size(), rtx.rank()
    summed = rtx.all_reduce(torch.ones(2, 3, device=device))
    mean = rtx.all_reduce(torch.full((2,), float(r), device=device), op="mean")
    biggest = rtx.all_reduce(torch.tensor([float(r)], device=device), op="max")
    from_last = rtx.broadcast(torch.tensor([float(r * 10)], device=device), src=n - 1)
    rtx.rendezvous("end")
    write_record(config, f"rank{r}", {
        "rank": r,
        "world": n,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "pg_backend": dist.get_backend(),
        "result_device": summed.device.type,
        "sum": summed.cpu().tolist(),
        "mean": mean.cpu().tolist(),
        "max": biggest.cpu().tolist(),
        "broadcast": from_last.cpu().tolist(),
        "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        "ray_rank": __import__("ray").train.get_context().get_world_rank(),
    })


@pytest.fixture(scope="module")
def gloo_fits(ray_local):
    """The records of one fit of collectives_loop per worker count, run when first asked for
    (the run-id test compares the fits the reduction tests made)."""
    done = {}

    def records(workers: int) -> list[dict]:
        if workers not in done:
            done[workers] = fit(collectives_loop, num_workers=workers)[1]
        return done[workers]

    return records


@pytest.mark.train_v1
@pytest.mark.parametrize("workers", [2, 3])
def test_several_workers_reduce_through_gloo(gloo_fits, workers):
    records = gloo_fits(workers)
    assert sorted(r["rank"] for r in records) == list(range(workers))
    expected_mean = sum(range(workers)) / workers
    for rec in records:
        assert rec["world"] == rec["dist_world"] == workers
        assert rec["dist_rank"] == rec["rank"] == rec["ray_rank"]
        assert rec["pg_backend"] == "cpu:gloo,xla:xla_host"  # the CPU development mode
        assert rec["result_device"] == "xla"
        assert rec["sum"] == [[float(workers)] * 3] * 2
        assert rec["mean"] == pytest.approx([expected_mean] * 2)
        assert rec["max"] == [float(workers - 1)]
        assert rec["broadcast"] == [float((workers - 1) * 10)]
    assert len({r["run_id"] for r in records}) == 1


def test_run_id_is_fresh_for_every_fit(gloo_fits):
    first, second = gloo_fits(2), gloo_fits(3)  # two fits (each has one run id: see above)
    assert first[0]["run_id"] != second[0]["run_id"]


def test_demo_seed_check(ray_local):
    from ray_train_xla.tools.demo import run_demo

    summary = run_demo(workers=2, iterations=3, device="cpu")
    assert summary.ok and summary.workers == 2 and summary.iterations == 3
    assert summary.device.startswith("xla") and summary.pjrt_device == "CPU"
    assert summary.process_group == "cpu:gloo,xla:xla_host"
