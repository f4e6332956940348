"""Reports off the step path under real Ray Train (2 CPU workers, torch_xla): the loop's report
and checkpoint calls return at once, every checkpoint reaches Ray in order, the training
function's end delivers what is still in flight, and a checkpoint that fails in the background
is raised in the training function. The same guarantees, fast and in detail, are in
``test_reporting_local.py``."""

from __future__ import annotations

import os
import time

import pytest

from conftest import fit, is_train_v2, write_record

# `make test-e2e` (its V1 pass too); `make test` has test_reporting_local.py.
pytestmark = [pytest.mark.ray, pytest.mark.e2e]

STEPS, CKPT_EVERY = 8, 2


def train_reports(config):
    import torch

    import ray_train_xla as rtx

    rtx.configure_reports(max_in_flight=STEPS)  # no backpressure: every call returns at once
    device = rtx.get_device()
    w = torch.zeros(4, device=device)
    calls, fail_error = [], None
    for step in range(1, STEPS + 1):
        w = w + 1
        start = time.perf_counter()
        try:
            rtx.report({"step": step, "kind": "metrics"})
            if step % CKPT_EVERY == 0:
                bad = config.get("fail_at") == step and rtx.rank() == 0
                # a lambda cannot be pickled: the background write of this checkpoint fails
                state = {"w": w, "step": step, **({"oops": lambda: 0} if bad else {})}
                rtx.save_checkpoint(state, {"step": step, "kind": "checkpoint"})
        except rtx.ReportError as exc:
            fail_error = {"step": step, "error": str(exc)}
            write_record(config, f"error_rank{rtx.rank()}", fail_error)
            raise
        calls.append(time.perf_counter() - start)
        if config.get("fail_at"):
            time.sleep(0.3)  # let the background write of the bad checkpoint happen
    rtx.report({"step": "end", "kind": "metrics"})
    # still in flight when the function returns: its end delivers it (Train V2 keeps the
    # metrics of checkpoint reports only)
    rtx.save_checkpoint({"w": w, "step": "end"}, {"step": "end", "kind": "checkpoint"})
    write_record(config, f"rank{rtx.rank()}", {
        "rank": rtx.rank(), "max_call_s": max(calls), "loop_done": time.time()})


def checkpoint_steps(result) -> list:
    import torch

    dirs = sorted(d for d in os.listdir(result.path)
                  if d.startswith("checkpoint_") and os.path.isdir(os.path.join(result.path, d)))
    return [torch.load(os.path.join(result.path, d, "checkpoint.pt"), weights_only=True)["step"]
            for d in dirs]


@pytest.mark.train_v1
def test_reports_never_wait_and_all_arrive_in_order(ray_local):
    start = time.time()
    result, records = fit(train_reports, num_workers=2)
    ended = time.time()
    assert sorted(r["rank"] for r in records) == [0, 1]
    # Ray takes one report per poll (0.5 s here): 8 metrics + 4 checkpoints reported one by
    # one would hold the loop for seconds; handed to the background, no call waits for Ray
    for rec in records:
        assert rec["max_call_s"] < 0.4, rec
    # every checkpoint arrived, in order, and the last report (after the loop) too
    assert checkpoint_steps(result) == [2, 4, 6, 8, "end"]
    assert result.checkpoint is not None
    assert result.metrics["step"] == "end"
    assert min(r["loop_done"] for r in records) < ended and start < ended


@pytest.mark.skipif(not is_train_v2(), reason="Ray Train V2 (FailureConfig and results differ on V1)")
def test_a_checkpoint_that_fails_in_the_background_fails_the_training_function(ray_local):
    import tempfile

    from ray.train import RunConfig

    storage = tempfile.mkdtemp(prefix="rtx-test-results-")
    with pytest.raises(Exception) as info:
        fit(train_reports, num_workers=2, loop_config={"fail_at": 4},
            run_config=RunConfig(storage_path=storage, name="fails"))
    assert "ReportError" in str(info.value) and "pickle" in str(info.value).lower()
    out = [d for d in os.listdir(storage)]
    assert out == ["fails"]
    run = os.path.join(storage, "fails")
    steps = [d for d in os.listdir(run)
             if d.startswith("checkpoint_") and os.path.isdir(os.path.join(run, d))]
    assert len(steps) == 1  # the checkpoint before the failed one was reported, nothing after
