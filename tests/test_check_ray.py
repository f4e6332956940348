"""``ray-train-xla check`` on a real local Ray, 2 CPU workers: every config passes with a
complete report, and each injected fault is reported by name and step, not as a traceback."""

from __future__ import annotations

import json
import os

import pytest

from ray_train_xla.tools.check_steps import CHECK_ELEMENTS
from ray_train_xla.tools.cli import main

pytestmark = pytest.mark.ray

STEPS = ["world", "correctness", "bandwidth", "compute", "training", "checkpoint", "restart"]


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["xla", "neuron", "tpu"])
def test_check_passes_with_a_complete_report(ray_local, config, tmp_path, capsys):
    peak = ["--peak-tflops", "0.5"] if config == "neuron" else []  # else the CPU's probe
    code = main(["check", "--config", config, "--device", "cpu", "--workers", "2",
                 "--max-bytes", "4K", "--timeout", "120", "--out", str(tmp_path), *peak])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS: every step passed" in out
    result = json.load(open(tmp_path / "report.json"))
    assert [s["name"] for s in result["steps"]] == STEPS
    assert all(s["ok"] is True for s in result["steps"]), result["steps"]
    by = {s["name"]: s for s in result["steps"]}
    # world: both workers, planned variables compared (every key of the plan, for each rank).
    assert [w["rank"] for w in by["world"]["workers"]] == [0, 1]
    assert len(result["planned_env"]) == 2 and result["planned_env"][1]["RANK"] == "1"
    assert result["planned_env"][0]["RAY_TRAIN_XLA_RUNTIME"] == ("pjrt" if config == "xla"
                                                                 else "native")
    # bandwidth: every op at every size from 8 B to 4 KiB, with algbw and busbw.
    sizes = sorted({r["bytes"] for r in by["bandwidth"]["rows"]})
    assert sizes == [8 << i for i in range(10)]
    assert {r["op"] for r in by["bandwidth"]["rows"]} == {"all_reduce", "all_gather",
                                                           "reduce_scatter"}
    assert all(r["busbw"] > 0 for r in by["bandwidth"]["rows"])
    assert "no published figure for this hardware (cpu)" in by["bandwidth"]["summary"]
    # compute: float32 matmuls on each CPU worker against the peak its MFU is taken against.
    assert by["compute"]["summary"].startswith("float32 matmuls of 512x512: ")
    assert len(by["compute"]["rows"]) == 2 and all(r["tflops"] > 0 for r in by["compute"]["rows"])
    source = ("given: --peak-tflops, the config's peak_tflops" if peak else
              "measured: a float32 matmul probe of this worker")
    assert by["compute"]["peak_source"] == source and source in by["compute"]["summary"]
    assert (result["planned_env"][0].get("RAY_TRAIN_XLA_PEAK_TFLOPS") == "0.5") == bool(peak)
    # training: the config's layout, tokens/s, TFLOP/s and MFU; checkpoint: same and half size.
    assert ("replicated" if config == "xla" else "FSDP2") in by["training"]["summary"]
    assert by["training"]["tokens_per_s"] > 0
    assert 0 < by["training"]["mfu"] and f"MFU {100 * by['training']['mfu']:.2f}% of the " \
        "peak" in by["training"]["summary"]
    assert "at 2 worker(s): equal bit for bit; at 1 worker(s): equal bit for bit" in \
        by["checkpoint"]["summary"]
    assert by["restart"]["cold_first_step_s"] > 0 and by["restart"]["warm_first_step_s"] > 0
    md = open(tmp_path / "report.md").read()
    for step in STEPS:
        assert f"### {step}: PASS" in md
    assert "## Planned environment" in md and "| torch |" in md
    assert os.path.getsize(tmp_path / "bandwidth.png") > 1000


@pytest.mark.e2e
def test_injected_faults_are_reported_by_name_and_step(ray_local, tmp_path):
    from check_faults import Faults

    from ray_train_xla.tools.check import CheckOptions, run_check

    result = run_check(CheckOptions(config="xla", device="cpu", workers=2, max_bytes=64,
                                    timeout_s=120, out=str(tmp_path)), hooks=Faults())
    by = {s["name"]: s for s in result["steps"]}
    assert result["ok"] is False
    assert by["world"]["failures"] == ["rank 1: LOCAL_WORLD_SIZE='3'; the plan says '2'"]
    wrong = by["correctness"]["failures"]
    assert len(wrong) == 1 and wrong[0].startswith(
        f"rank 1: all_reduce bfloat16: {CHECK_ELEMENTS} wrong element(s), the first at index 0: "
        "got 1.0, expected 0.0")
    assert by["bandwidth"]["ok"] is True  # the broken all_reduce was bfloat16 only
    assert by["training"]["failures"] == [
        f"rank {r}: step 5 compiled 1 graph(s) after the 2 warm-up steps (every step after "
        "warm-up must reuse its graphs)" for r in (0, 1)]
    (reload_failure,) = by["checkpoint"]["failures"]
    # rank 0's copy was changed after the load: rank 1's loaded state is the saved one
    assert reload_failure.startswith("at 2 worker(s), rank 0: 1 of ") and "model.tok.weight" in \
        reload_failure
    assert "at 1 worker(s)" not in reload_failure  # the half-size reload was exact
    # Reported, not raised: the report names every failing step, and the exit status says so.
    md = open(tmp_path / "report.md").read()
    for step in ("world", "correctness", "training", "checkpoint"):
        assert f"### {step}: FAIL" in md
    assert "Traceback" not in md


@pytest.mark.e2e
def test_a_step_that_raises_names_the_worker_and_stops_what_follows(ray_local, tmp_path):
    from check_faults import RaisesIn

    from ray_train_xla.tools.check import CheckOptions, run_check

    result = run_check(CheckOptions(config="neuron", device="cpu", workers=2, max_bytes=64,
                                    timeout_s=60, out=str(tmp_path)), hooks=RaisesIn("bandwidth"))
    by = {s["name"]: s for s in result["steps"]}
    assert [by[s]["ok"] for s in STEPS] == [True, True, False, None, None, None, None]
    assert by["bandwidth"]["failures"][0] == \
        "rank 1: RuntimeError: injected: the bandwidth step broke on rank 1"
    assert by["training"]["summary"] == "not run: step 'bandwidth' failed before it"
    (failed,) = [w for w in result["failing_workers"] if w["rank"] == 1]
    assert failed["step"] == "bandwidth"
    assert "injected fault: rank 1 breaks in the bandwidth step" in failed["log_tail"]
    md = open(tmp_path / "report.md").read()
    assert "## Log of rank 1 (bandwidth)" in md and "injected fault: rank 1 breaks" in md


@pytest.mark.e2e
def test_check_on_two_nodes_times_within_and_across_nodes(two_nodes, tmp_path):
    from collections import Counter

    from ray_train_xla.tools.check import CheckOptions, run_check

    from conftest import connected

    with connected(two_nodes):
        result = run_check(CheckOptions(config="neuron", device="cpu", workers=4, max_bytes=256,
                                        timeout_s=120, out=str(tmp_path)))
    by = {s["name"]: s for s in result["steps"]}
    assert result["ok"] is True, [s for s in result["steps"] if not s["ok"]]
    assert result["nodes"] == 2
    per_node = Counter(w["node_rank"] for w in by["world"]["workers"])  # Ray places them
    assert sorted(per_node) == [0, 1]
    scopes = {(r["scope"], r["ranks"]) for r in by["bandwidth"]["rows"]}
    assert scopes == {("across nodes", 4)} | {("within a node", n) for n in per_node.values()
                                              if n > 1}
    assert "at 4 worker(s): equal bit for bit; at 2 worker(s): equal bit for bit" in \
        by["checkpoint"]["summary"]
