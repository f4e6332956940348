"""Profiles and recompilation causes on 2 CPU workers under real Ray Train (V2, and V1 by
``make test``), in one fit:

- three profile windows, one asked in the config, one in the training function and one from
  outside while the run goes (``ray-train-xla profile RUN --steps 3`` from a thread of the
  driver), each leaving one trace per rank of exactly its steps, read back with gzip and json
  (torch_xla's profiler writes a Chrome trace beside its ``xplane.pb``);
- rank 1's batches change shape at step 20: its warning names rank 1, step 20 and the cause as
  torch_xla analysed it (``compile_causes=True``), and rank 0 names the ranks whose graphs
  differ.

The protocol and the arithmetic, in detail and without Ray: ``test_profiling_local.py`` and
``test_compile_causes_local.py``."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import threading
import time

import pytest

from conftest import fit, write_record

# `make test-e2e`; `make test` has test_profiling_local.py and test_compile_causes_local.py.
pytestmark = [pytest.mark.ray, pytest.mark.e2e]

CONFIG_WINDOW, FUNCTION_WINDOW, OUTSIDE_STEPS = (5, 2), (12, 3), 3
SHAPE_CHANGE_STEP, CHECK_EVERY, MIN_STEPS, MAX_STEPS = 20, 10, 40, 3000


def train_observe(config):
    import dataclasses
    import warnings

    import torch

    import ray_train_xla as rtx

    rtx.check_graphs_every(CHECK_EVERY)
    rtx.profile_steps(*FUNCTION_WINDOW)
    device = rtx.get_device()
    model = rtx.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = rtx.CompileMonitor(warmup_steps=3)
    step, started = 0, time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while step < MAX_STEPS:
            rows = 6 if rtx.rank() == 1 and step + 1 >= SHAPE_CHANGE_STEP else 4
            opt.zero_grad()
            model(torch.ones(rows, 4, device=device)).sum().backward()
            rtx.optimizer_step(opt)
            step += 1
            monitor.metrics(step)
            if step == 8 and rtx.rank() == 0:  # the driver may ask from outside now
                with open(os.path.join(config["signal_dir"], "running"), "w") as f:
                    f.write(str(step))
            outside = [w for w in rtx.profile_windows() if w.source not in ("config", "function")]
            # every rank learns the outside window before it starts, so every rank stops at
            # the same step (their collectives need it)
            if outside and step >= max(MIN_STEPS, outside[0].end_after + 1):
                break
    write_record(config, f"rank{rtx.rank()}", {
        "rank": rtx.rank(), "steps": step, "loop_s": time.monotonic() - started,
        "windows": [dataclasses.asdict(w) for w in rtx.profile_windows()],
        "warnings": [{"category": w.category.__name__, "message": str(w.message)}
                     for w in caught
                     if issubclass(w.category, (rtx.RecompilationWarning,
                                                rtx.DivergentGraphsWarning))]})


def ask_from_outside(signal_dir: str, run_dir: str, outcome: dict) -> None:
    from ray_train_xla.tools.cli import main

    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(signal_dir, "running")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    outcome["exit"] = main(["profile", run_dir, "--steps", str(OUTSIDE_STEPS)])


def trace_steps(run_dir: str, start: int, rank: int) -> list[int]:
    """The steps of one rank's torch_xla trace of the window starting at ``start``."""
    base = os.path.join(run_dir, "profiles", str(start), f"rank-{rank}")
    [chrome] = glob.glob(f"{base}/plugins/profile/*/*.trace.json.gz")
    [xplane] = glob.glob(f"{base}/plugins/profile/*/*.xplane.pb")
    assert os.path.getsize(xplane) > 0
    with gzip.open(chrome) as f:
        events = json.load(f)["traceEvents"]
    listed = json.load(open(f"{base}/profile.json"))
    assert listed["rank"] == rank and listed["profiler"] == "torch_xla"
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train_step")


def test_profiles_of_every_rank_and_recompilation_causes(ray_local):
    from ray.train import RunConfig

    from ray_train_xla import TorchXLAConfig

    storage, signal_dir = tempfile.mkdtemp(prefix="rtx-test-results-"), tempfile.mkdtemp()
    run_dir = os.path.join(storage, "observe")
    outcome: dict = {}
    asker = threading.Thread(target=ask_from_outside, args=(signal_dir, run_dir, outcome),
                             daemon=True)
    asker.start()
    _, records = fit(
        train_observe, num_workers=2, loop_config={"signal_dir": signal_dir},
        torch_config=TorchXLAConfig(device="cpu", timeout_s=120, compile_causes=True,
                                    profile_steps=CONFIG_WINDOW),
        run_config=RunConfig(storage_path=storage, name="observe"))
    asker.join(10)
    assert outcome == {"exit": 0}
    ranks = {r["rank"]: r for r in records}
    assert sorted(ranks) == [0, 1] and ranks[0]["steps"] == ranks[1]["steps"] >= MIN_STEPS

    # Profiles: the config's, the function's and the outside request's windows, on every rank
    [accepted] = glob.glob(os.path.join(run_dir, "profiles", "accepted", "*.json"))
    outside = json.load(open(accepted))
    assert outside["count"] == OUTSIDE_STEPS and outside["world_size"] == 2
    for rank, record in ranks.items():
        assert [(w["start"], w["count"], w["source"]) for w in record["windows"]] == [
            (*CONFIG_WINDOW, "config"), (*FUNCTION_WINDOW, "function"),
            (outside["start"], OUTSIDE_STEPS, outside["id"])]
        for start, count in (CONFIG_WINDOW, FUNCTION_WINDOW, (outside["start"], OUTSIDE_STEPS)):
            assert trace_steps(run_dir, start, rank) == list(range(start, start + count))

    # Recompilation: rank 1 names itself, step 20 and torch_xla's cause; rank 0 names the ranks
    recompiled = [w["message"] for w in ranks[1]["warnings"]
                  if w["category"] == "RecompilationWarning"]
    assert len(recompiled) == 1, ranks[1]["warnings"]
    text = recompiled[0]
    assert re.match(rf"rank 1: XLA compiled \d+ new graph\(s\) after warm-up \(3 steps\), by "
                    rf"step {SHAPE_CHANGE_STEP}\. Cause: torch_xla: \w.* \(graph \w+, ", text), text
    # the line of the training function that cut it, and that it cut another graph before
    assert "train_observe (" in text and "an input shape or a Python constant" in text, text
    assert not any(w["category"] == "RecompilationWarning" for w in ranks[0]["warnings"])
    # (once per different outcome: rank 1 may compile one more graph of its own a step later)
    differ = [w["message"] for w in ranks[0]["warnings"]
              if w["category"] == "DivergentGraphsWarning"]
    assert differ and all("; rank 1: " in m for m in differ), ranks[0]["warnings"]
    assert differ[0].startswith(f"ranks compile different graphs (compared at step "
                                f"{SHAPE_CHANGE_STEP}): rank 0: "), differ
    print("\n".join([text, *differ]))  # (-s shows them)
    print({r: (rec["steps"], round(rec["loop_s"], 1)) for r, rec in ranks.items()}, outside)
    assert not any(w["category"] == "DivergentGraphsWarning" for w in ranks[1]["warnings"])
