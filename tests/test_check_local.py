"""``ray-train-xla check`` without Ray: its figures (nccl-tests' bandwidth definitions, the
exact results of the collectives, the published figures), its comparison of the world with the
plan, its judgement of each step, its report and its command line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ray_train_xla.tools import check, check_report, check_steps
from ray_train_xla.tools.cli import main


def test_bus_bandwidth_follows_nccl_tests():
    # nccl-tests doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
    # reduce_scatter); algbw = size / time.
    algbw, busbw = check_report.bus_bandwidth("all_reduce", 8 * 10**9, 2.0, 8)
    assert algbw == pytest.approx(4.0) and busbw == pytest.approx(4.0 * 14 / 8)
    assert check_report.bus_bandwidth("all_gather", 10**9, 1.0, 4)[1] == pytest.approx(0.75)
    assert check_report.bus_bandwidth("reduce_scatter", 10**9, 1.0, 2)[1] == pytest.approx(0.5)


@pytest.mark.parametrize("world", [1, 2, 3, 8, 90, 257])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expected_values_are_torchs_own(world, dtype):
    """The exact results the correctness step expects equal torch's own reductions of the same
    inputs in the same dtype; the inputs differ from rank to rank, so data that went to the
    wrong rank shows."""
    count = check_steps.CHECK_ELEMENTS if world < 50 else 37  # (odd, as the check's)
    tdtype = getattr(torch, dtype)

    def inputs(op, n):
        return [torch.tensor(check_steps.pattern(r, n, world, op, dtype), dtype=tdtype)
                for r in range(world)]

    if check_steps.checked("all_reduce", dtype, world):
        summed = torch.stack(inputs("all_reduce", count)).sum(0, dtype=tdtype)
        assert check_steps.expected("all_reduce", 0, world, count, dtype) == summed.float().tolist()
        full = torch.stack(inputs("reduce_scatter", count * world)).sum(0, dtype=tdtype)
        chunks = [check_steps.expected("reduce_scatter", r, world, count, dtype)
                  for r in range(world)]
        assert chunks[-1] == full[(world - 1) * count:].float().tolist()
        if world > 1:
            assert chunks[0] != chunks[1]  # a rank given another's chunk is seen
    else:
        assert world > check_steps.BF16_EXACT_WORLD and dtype == "bfloat16"
    gathered = torch.cat(inputs("all_gather", count))
    assert check_steps.expected("all_gather", 1 % world, world, count, dtype) == \
        gathered.float().tolist()
    last = inputs("broadcast", count)[-1]
    assert check_steps.expected("broadcast", 0, world, count, dtype) == last.float().tolist()
    if world > 1:  # a broadcast that did nothing is seen on every other rank
        assert check_steps.pattern(0, count, world, "broadcast", dtype) != last.tolist()


def test_sizes_and_iterations():
    assert check_steps.sizes(64) == [8, 16, 32, 64]
    assert check_steps.sizes(1 << 30)[-1] == 1 << 30
    assert check_steps.iterations(8) > check_steps.iterations(1 << 30) >= 2


def test_published_figures_name_their_source():
    trn1n = check_report.published_for("trn1n.32xlarge", "", "within a node")
    assert trn1n.prefixes == ("trn1n.",) and "768" in trn1n.as_published  # not trn1's figure
    assert check_report.published_for("trn1.32xlarge", "", "across nodes").gb_s == 100
    v6e = check_report.published_for("", "v6e-16", "within a node")
    assert v6e.gb_s == 400 and v6e.source.startswith("https://")
    assert check_report.published_for("", "v5litepod-16", "across nodes").gb_s == 200
    assert check_report.published_for("", "tpu7x-32", "within a node").gb_s == 600
    assert check_report.published_for("", "TPU-V6E", "across nodes").gb_s == 400  # Ray's name
    assert check_report.published_for("TRN1.32XLARGE", "", "within a node").prefixes == ("trn1.",)
    assert check_report.published_for("", "v4-64", "within a node") is None
    assert check_report.published_for("", "", "within a node") is None
    assert all(p.source.startswith("https://") for p in check_report.PUBLISHED)


def test_compare_world_names_each_difference():
    planned = [{"RANK": "0", "LOCAL_WORLD_SIZE": "2"}, {"RANK": "1", "LOCAL_WORLD_SIZE": "2"}]
    assert check_report.compare_world([dict(p) for p in planned], planned) == []
    observed = [dict(planned[0]), {"RANK": "1", "LOCAL_WORLD_SIZE": "3"}]
    assert check_report.compare_world(observed, planned) == [
        "rank 1: LOCAL_WORLD_SIZE='3'; the plan says '2'"]
    assert check_report.compare_world([{"RANK": "0"}], planned[:1]) == [
        "rank 0: LOCAL_WORLD_SIZE is not set; the plan says '2'"]
    # TorchTPU's slicebuilder ports are found free at start: only the hosts are compared.
    tpu = [{"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.0.0.1:8070,10.0.0.2:8070"}]
    assert check_report.compare_world(
        [{"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.0.0.1:9001,10.0.0.2:9002"}], tpu) == []
    assert check_report.compare_world(
        [{"TORCH_TPU_SLICEBUILDER_ADDRESSES": "10.0.0.2:8070,10.0.0.1:8070"}], tpu)
    # torch_xla's Neuron start-up keeps the worker's own core of the node's list: not a
    # difference; any other core is.
    cores = [{"NEURON_RT_VISIBLE_CORES": "4,5"}, {"NEURON_RT_VISIBLE_CORES": "4,5"}]
    assert check_report.compare_world(
        [{"LOCAL_RANK": "0", "NEURON_RT_VISIBLE_CORES": "4"},
         {"LOCAL_RANK": "1", "NEURON_RT_VISIBLE_CORES": "5"}], cores) == []
    assert check_report.compare_world(
        [{"LOCAL_RANK": "0", "NEURON_RT_VISIBLE_CORES": "4"},
         {"LOCAL_RANK": "1", "NEURON_RT_VISIBLE_CORES": "4"}], cores) == [
        "rank 1: NEURON_RT_VISIBLE_CORES='4'; the plan says '4,5'"]


def _training_record(rank, compiled, digest=None):
    return {"phase": "main", "step": "training", "rank": rank, "ray_rank": rank, "seconds": 1.0,
            "ok": True, "layout": "replicated", "train_steps": len(compiled), "warmup_steps": 2,
            "compiled_per_step": compiled,
            "recompiled_at": [(i + 1, c) for i, c in enumerate(compiled) if i >= 2 and c],
            "step_seconds": [0.1] * len(compiled), "losses": [2.0] * len(compiled),
            "tokens_per_s": 100.0, "first_step_s": 3.0, "cold_compiles": sum(compiled),
            "digest": digest}


def test_judge_training_names_the_step_that_compiled():
    step = check.judge_training([_training_record(0, [2, 1, 0, 0, 1, 0]),
                                 _training_record(1, [2, 1, 0, 0, 0, 0])], 2, [])
    assert step["ok"] is False
    assert step["failures"] == ["rank 0: step 5 compiled 1 graph(s) after the 2 warm-up steps "
                                "(every step after warm-up must reuse its graphs)"]


def test_a_rank_whose_peer_left_is_listed_after_the_rank_that_failed():
    lost = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection "
            "closed by peer [127.0.0.1]:37001")
    records = [{"rank": r, "error": e, "seconds": 0.1}
               for r, e in ((0, lost), (1, "RuntimeError: injected"), (2, None))]
    assert check.judge_bandwidth(records, 3, [])["failures"] == [
        "rank 1: RuntimeError: injected", f"rank 0: {lost}"]


def _compute_record(rank, tflops, peak, source="the published bf16 peak of a TPU v6e chip"):
    return {"phase": "main", "step": "compute", "rank": rank, "ray_rank": rank, "seconds": 0.6,
            "ok": True, "dtype": "bfloat16", "size": 8192, "tflops": tflops,
            "peak_tflops": peak, "peak_source": source}


def test_judge_compute_sets_each_devices_matmuls_beside_its_peak():
    step = check.judge_compute([_compute_record(0, 800.0, 918.0), _compute_record(1, 760.0, 918.0),
                                _compute_record(2, 780.0, 918.0)], 3, [])
    assert step["ok"] is True  # reported, not judged
    assert step["summary"] == ("bfloat16 matmuls of 8192x8192: 780 TFLOP/s per device (median "
                               "of 3; 760 to 800), 85% of the peak 918 TFLOP/s (the published "
                               "bf16 peak of a TPU v6e chip)")
    assert check.judge_compute([_compute_record(0, 0.09326, 0.08972)], 1, [])["summary"] == (
        "bfloat16 matmuls of 8192x8192: 0.0933 TFLOP/s per device (median of 1), 104% of the "
        "peak 0.0897 TFLOP/s (the published bf16 peak of a TPU v6e chip)")
    assert [round(r["share"], 3) for r in step["rows"]] == [0.871, 0.828, 0.85]
    unknown = check.judge_compute([_compute_record(0, 80.0, None, "no published peak for an "
                                                   "instance type not named here")], 1, [])
    assert unknown["summary"] == ("bfloat16 matmuls of 8192x8192: 80 TFLOP/s per device (median "
                                  "of 1); no peak known (no published peak for an instance type "
                                  "not named here): give --peak-tflops")


def test_judge_training_gives_the_steps_tflops_and_mfu():
    records = [_training_record(r, [2, 1, 0, 0]) | {
        "flops_per_step": 1.2e8, "tflops_per_s": t, "peak_tflops": p, "mfu": t / p,
        "peak_source": "measured: a float32 matmul probe of this worker"}
        for r, t, p in ((0, 0.002, 0.04), (1, 0.004, 0.06))]
    step = check.judge_training(records, 2, [])
    assert step["summary"].endswith(
        "; 1.2e+08 model FLOPs a step, 0.003 TFLOP/s per device, MFU 5.83% of the peak 0.05 "
        "TFLOP/s (measured: a float32 matmul probe of this worker)")  # medians of the workers'
    assert step["mfu"] == pytest.approx(0.175 / 3)
    assert step["mfu_by_rank"] == pytest.approx({0: 0.05, 1: 0.004 / 0.06})
    records[0]["mfu"] = records[1]["mfu"] = None
    records[0]["peak_source"] = "no published peak for device 'neuron'"
    assert "no MFU: no peak known (no published peak for device 'neuron'): give --peak-tflops" \
        in check.judge_training(records, 2, [])["summary"]


def test_the_compute_step_and_the_models_flops_on_this_process(monkeypatch):
    """The worker side of the compute step without Ray: a float32 probe on the CPU against the
    config's peak, and the training step's FLOPs (FlopCounterMode on the meta device) equal to
    the model's formula: 6 per linear weight and token, plus attention's 12 x layers x dim x
    seq x tokens."""
    from ray_train_xla.planning import contract
    from ray_train_xla.tools.examples.train_lm import SEQ

    monkeypatch.setitem(check_steps.MATMUL_SIZE, "cpu", 128)
    monkeypatch.setattr(check_steps, "MATMUL_SECONDS", 0.05)
    monkeypatch.setenv(contract.PEAK_TFLOPS_VAR, "2.5")
    monkeypatch.setenv(contract.DEVICE_VAR, "cpu")
    monkeypatch.setenv(contract.RUNTIME_VAR, "native")
    contract.reload()
    try:
        state = {}
        found = check_steps.compute({"device": "cpu"}, state)
    finally:
        for var in (contract.PEAK_TFLOPS_VAR, contract.DEVICE_VAR, contract.RUNTIME_VAR):
            monkeypatch.delenv(var)
        contract.reload()
    assert found["dtype"] == "float32" and found["size"] == 128 and found["tflops"] > 0
    assert (found["peak_tflops"], found["peak_source"]) == (
        2.5, "given: --peak-tflops, the config's peak_tflops")
    assert state["peak"] == (2.5, "given: --peak-tflops, the config's peak_tflops")
    c = check_steps.model_config()
    linear = c["layers"] * (3 * c["dim"] ** 2 + c["dim"] ** 2 + 2 * c["dim"] * c["ff"]) \
        + c["dim"] * c["vocab"]
    tokens = c["batch_size"] * SEQ
    assert check_steps.step_flops() == 6 * linear * tokens + 12 * c["layers"] * c["dim"] * SEQ \
        * tokens


def test_the_peak_reaches_the_checks_config():
    config = check.torch_config(check.CheckOptions(config="neuron", peak_tflops=79.0), "cpu")
    assert config.peak_tflops == 79.0
    assert check.torch_config(check.CheckOptions(), "cpu").peak_tflops is None


def test_judge_checkpoint_and_restart():
    saved = {"model.w": "a", "model.b": "b"}
    training = [_training_record(0, [2, 1, 0], digest=saved)]
    found = [
        {"phase": "restart", "step": "checkpoint", "rank": 0, "ray_rank": 0, "seconds": 1.0,
         "digest": dict(saved)},
        {"phase": "reload", "step": "checkpoint", "rank": 0, "ray_rank": 0, "seconds": 1.0,
         "digest": {"model.w": "a", "model.b": "X"}},
        {"phase": "restart", "step": "restart", "rank": 0, "ray_rank": 0, "seconds": 1.0,
         "warm_compiles": 1, "first_step_s": 2.0},
    ]
    step = check.judge_checkpoint(found, training, {}, 2)
    assert step["ok"] is False
    assert step["failures"] == ["at 1 worker(s), rank 0: 1 of 2 tensors differ from the saved "
                                "state: model.b"]
    # No persistent cache on the CPU: the restart may compile the cold start's graphs again...
    assert check.judge_restart(found, training, {}, "cpu", "xla")["ok"] is True
    # ... but on TPU under torch_xla every graph must come from the persistent cache.
    tpu = check.judge_restart(found, training, {}, "tpu", "xla")
    assert tpu["ok"] is False and "persistent compile cache" in tpu["failures"][0]


def test_a_phase_that_never_started_is_reported_not_passed():
    errors = {"main": "WorkerSetupError: no process group"}
    result = check.judge(check.CheckOptions(), None, "cpu", [], errors)
    assert result["ok"] is False
    by_name = {s["name"]: s for s in result["steps"]}
    assert by_name["world"]["ok"] is False
    assert by_name["correctness"]["ok"] is False
    assert "WorkerSetupError: no process group" in by_name["correctness"]["summary"]


def test_report_files(tmp_path):
    rows = [{"scope": "within a node", "op": op, "bytes": b, "ranks": 2, "seconds": 1e-3,
             "algbw": b / 1e-3 / 1e9, "busbw": b / 1e-3 / 1e9} for op in ("all_reduce", "all_gather")
            for b in (8, 16)]
    result = {"ok": False, "config": "TorchXLAConfig", "device": "cpu", "workers": 2, "nodes": 1,
              "started": "now", "seconds": 1.0, "versions": {"torch": "2.9.0"},
              "worker_versions": {"torch": "2.9.0"},
              "steps": [{"name": "world", "ok": True, "summary": "fine", "failures": []},
                        {"name": "bandwidth", "ok": True, "summary": "s", "failures": [],
                         "rows": rows, "comparisons": ["within a node: none"]},
                        {"name": "compute", "ok": True, "summary": "c", "failures": [],
                         "dtype": "float32", "rows": [
                             {"rank": 0, "tflops": 0.051, "peak_tflops": 0.06, "share": 0.85},
                             {"rank": 1, "tflops": 0.05, "peak_tflops": None, "share": None}]},
                        {"name": "training", "ok": False, "summary": "t",
                         "failures": ["rank 0: step 5 compiled"]},
                        {"name": "restart", "ok": None, "summary": "not run"}],
              "planned_env": [{"RANK": "0"}],
              "failing_workers": [{"rank": 1, "step": "training", "error": "Boom: x",
                                   "log_tail": "last line"}]}
    files = check_report.write_report(result, str(tmp_path))
    assert set(files) == {"json", "md", "png"} and os.path.getsize(files["png"]) > 1000
    assert json.load(open(files["json"]))["steps"][3]["failures"] == ["rank 0: step 5 compiled"]
    md = open(files["md"]).read()
    for text in ("### training: FAIL", "- rank 0: step 5 compiled", "| within a node | all_reduce | 8 |",
                 "RANK=0", "## Log of rank 1 (training)", "last line", "### restart: NOT RUN",
                 "| rank | float32 matmul TFLOP/s | peak TFLOP/s | share |",
                 "| 0 | 0.051 | 0.06 | 85.0% |", "| 1 | 0.05 | - | - |"):
        assert text in md
    table = check_report.to_table(result)
    assert table.splitlines()[-1] == "FAIL: training, restart"


def test_check_refuses_before_ray(capsys):
    assert main(["check", "--config", "neuron", "--device", "tpu"]) == 2
    assert "--config neuron runs on --device cpu or neuron, not tpu" in capsys.readouterr().err
    assert main(["check", "--max-bytes", "4"]) == 2
    assert "is not a size of at least 8 bytes" in capsys.readouterr().err
    assert main(["check", "--device", "cpu", "--tpu-topology", "2x2"]) == 2
    assert "--tpu-topology describes a TPU slice" in capsys.readouterr().err


@pytest.mark.parametrize("text,size", [("8", 8), ("64K", 65536), ("256MiB", 256 << 20),
                                       ("1G", 1 << 30), ("1gb", 1 << 30)])
def test_sizes_on_the_command_line(text, size):
    from ray_train_xla.tools.check import _size

    assert _size(text) == size


def test_the_command_exits_1_and_names_each_failure(monkeypatch, capsys, tmp_path):
    """The command line's verdict follows the steps: 1 when one failed, each failure printed
    under the table (the run itself is tests/test_check_ray.py's)."""
    seen = {}

    def fake_run(options, hooks=None):
        seen["options"] = options
        return {"ok": False, "files": {"md": str(tmp_path / "report.md")}, "steps": [
            {"name": "world", "ok": True, "summary": "fine", "failures": []},
            {"name": "training", "ok": False, "summary": "1 problem",
             "failures": ["rank 0: step 5 compiled 1 graph(s) after the 2 warm-up steps"]}]}

    monkeypatch.setattr(check, "run_check", fake_run)
    code = main(["check", "--config", "tpu", "--device", "cpu", "--workers", "3",
                 "--max-bytes", "1M", "--timeout", "30", "--out", str(tmp_path),
                 "--peak-tflops", "918"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: training" in out
    assert "  training: rank 0: step 5 compiled 1 graph(s) after the 2 warm-up steps" in out
    options = seen["options"]
    assert (options.config, options.device, options.workers, options.max_bytes,
            options.timeout_s, options.peak_tflops) == ("tpu", "cpu", 3, 1 << 20, 30.0, 918.0)
