"""The memory tier on the other configs, replicated state: ``TorchXLAConfig`` (torch_xla on CPU
workers, the model on the XLA device) and ``TorchTPUConfig``'s CPU twin (the native stack), each
with ``memory_every=1`` and 2 workers on the shared local Ray. Every step is kept in memory and
no checkpoint ever goes to storage; a worker fails once, and the next group restores the step
kept last from memory, bit for bit, and trains on to the end. (FSDP2 state on
``TorchNeuronConfig``'s twin, node loss and resharding: ``test_memory_tier_ray.py``.)"""

from __future__ import annotations

import json
import os

import pytest

from conftest import fit, is_train_v2, write_record

# `make test-e2e` (one fit with a restart per config).
pytestmark = [pytest.mark.ray, pytest.mark.e2e]

STEPS, FAIL_AT = 6, 4


def train_kept(config):
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import memory_tier

    rank = rtx.rank()
    torch.manual_seed(0)
    model = rtx.prepare_model(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = rtx.load_checkpoint(model, opt)
    tier = memory_tier()
    start = int(extra["step"]) if extra else 0
    record = {"rank": rank, "start": start, "restored": tier.restored, "pid": os.getpid(),
              "device": str(next(model.parameters()).device)}
    out = config["params_dir"]
    if extra:
        with open(os.path.join(out, f"params{start}.json")) as f:
            record["exact"] = [p.detach().cpu().reshape(-1).tolist() for p in model.parameters()] \
                == json.load(f)
    write_record(config, f"start{start}_rank{rank}", record)
    for step in range(start + 1, STEPS + 1):
        opt.zero_grad()
        x = torch.arange(16.0 * (step + rank), 16.0 * (step + rank + 1)).reshape(2, 8) / 100
        model(x.to(rtx.get_device())).pow(2).sum().backward()
        rtx.optimizer_step(opt)
        tier.wait()  # the previous generation is complete: this keep is taken
        assert rtx.keep_in_memory({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                   "step": step}, step)
        tier.wait()  # kept on every rank (the put ends in a barrier of the ranks)
        if rank == 0:
            with open(os.path.join(out, f"params{step}.json"), "w") as f:
                json.dump([p.detach().cpu().reshape(-1).tolist() for p in model.parameters()], f)
        marker = os.path.join(config["out_dir"], "failed.json")
        if step == FAIL_AT and rank == 1 and not os.path.exists(marker):
            write_record(config, "failed", {"step": step})
            os._exit(1)
    write_record(config, f"end_rank{rank}", {"step": STEPS})


@pytest.mark.skipif(not is_train_v2(), reason="the memory tier's stores live in Ray Train V2's controller")
@pytest.mark.parametrize("kind", ["xla", pytest.param("tpu", marks=pytest.mark.native)])
def test_a_worker_failure_restores_replicated_state_from_memory(ray_local, kind, tmp_path):
    from ray.train import FailureConfig, RunConfig

    from ray_train_xla import TorchTPUConfig, TorchXLAConfig

    config = (TorchXLAConfig(device="cpu", timeout_s=60, memory_every=1) if kind == "xla"
              else TorchTPUConfig(device="cpu", timeout_s=60, memory_every=1))
    (tmp_path / "params").mkdir()
    result, records = fit(train_kept, num_workers=2, torch_config=config,
                          loop_config={"params_dir": str(tmp_path / "params")},
                          run_config=RunConfig(storage_path=str(tmp_path), name="kept",
                                               failure_config=FailureConfig(max_failures=1)))
    starts = [r for r in records if "start" in r]
    first = [r for r in starts if r["start"] == 0]
    again = [r for r in starts if r["start"] == FAIL_AT]
    assert len(first) == 2 and len(again) == 2, starts
    assert all(r["restored"] is None for r in first)
    for r in again:  # the generation of step FAIL_AT, from memory, bit for bit
        assert r["restored"] is not None and r["restored"]["world"] == 2, r
        assert r["restored"]["fetched_bytes"] > 0 and r["exact"] is True, r
    if kind == "xla":
        assert all(r["device"].startswith("xla") for r in starts), starts
    assert sum(1 for r in records if r.get("step") == STEPS) == 2  # both ranks ended
    # Nothing ever went to storage: the restore came from memory alone.
    assert result.checkpoint is None
    assert not [d for d in os.listdir(tmp_path / "kept") if d.startswith("checkpoint_")]

