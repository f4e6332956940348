"""Sharded models without Ray: FSDPv2 on 4 and 8 virtual XLA CPU devices against one device,
distributed checkpoints restored onto another mesh and device count, the replicated helpers
refusing sharded state, and ``consolidate``. Each scenario runs in a fresh process
(``sharded_worker.py``): torch_xla fixes SPMD mode and the device count per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")


def start_scenario(out_dir, name: str, *args, devices: int = 1) -> subprocess.Popen:
    """sharded_worker.py's scenario ``name`` in a fresh process with ``devices`` XLA CPU devices."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([SRC_DIR, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XLA_USE_SPMD"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, os.path.join(TESTS_DIR, "sharded_worker.py"), name,
                             str(out_dir), *map(str, args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def scenario_result(proc: subprocess.Popen, out_dir, name: str) -> dict:
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        return json.load(f)


def run_scenario(out_dir, name: str, *args, devices: int = 1) -> dict:
    return scenario_result(start_scenario(out_dir, name, *args, devices=devices), out_dir, name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario, each in its own process, started as soon as what it needs exists: FSDPv2
    training on 4 devices (mesh fsdp=4, model=1), checkpointed with DCP, with the refusals
    beside it; then, from its checkpoint, the 2x2 restore, the 8-device run and
    ``consolidate`` together."""
    out, refuse_dir = tmp_path_factory.mktemp("sharded4"), tmp_path_factory.mktemp("refuse")
    refuse = start_scenario(refuse_dir, "refuse")
    try:
        rec = {"train": run_scenario(out, "train", out / "ckpt", devices=4)}
        procs = {"load": start_scenario(out, "load", out / "ckpt", 2, 2, devices=4),
                 "train_load": start_scenario(out, "train_load", out / "ckpt", devices=8)}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC_DIR, TESTS_DIR]))
        rec["consolidate"] = subprocess.run(
            [sys.executable, "-m", "ray_train_xla.tools.cli", "consolidate", str(out / "ckpt"),
             str(out / "full.safetensors"), "--torch", str(out / "full.pt"), "--json"],
            env=env, capture_output=True, text=True, timeout=120)
        if rec["consolidate"].returncode == 0:
            rec["check_consolidated"] = subprocess.run(
                [sys.executable, "-c", CHECK_CONSOLIDATED, str(out / "full.safetensors"),
                 str(out / "expected.pt"), str(out / "full.pt")],
                env=env, capture_output=True, text=True, timeout=120)
        for name, proc in procs.items():
            rec[name] = scenario_result(proc, out, name)
        rec["refuse"] = scenario_result(refuse, refuse_dir, "refuse")
    finally:
        refuse.kill()
    return out, rec


@pytest.fixture(scope="module")
def saved(runs):
    """FSDPv2 training on 4 devices (mesh fsdp=4, model=1), checkpointed with DCP."""
    out, rec = runs
    return out, rec["train"]


def test_fsdpv2_on_four_devices_matches_one_device_and_saves_only_shards(saved):
    out, rec = saved
    assert rec["devices"] == 4 and rec["mesh"] == {"fsdp": 4, "model": 1}
    assert rec["spec"] == "{devices=[4,1]0,1,2,3}"  # the parameter is split, not replicated
    assert rec["diff_to_untrained"] > 1e-3  # it trained
    assert rec["max_diff"] <= 1e-5
    files = rec["saved"]["files"]
    assert {".metadata", "__0_0.distcp", "extra.pt", "sharded.json"} <= set(files)
    marker = json.loads((out / "ckpt" / "sharded.json").read_text())
    assert marker["devices"] == 4 and marker["keys"] == ["model", "optimizer"]


def test_replicated_helpers_refuse_fsdpv2(saved):
    _, rec = saved
    prepare, step = rec["refused"]
    assert prepare.startswith("ShardedStateError: prepare_model: model is a torch_xla FSDPv2 module")
    assert "prepare_sharded_model" in prepare
    assert step.startswith("ShardedStateError: optimizer_step: param_groups[0].params.0 is an SPMD "
                           "tensor sharded {devices=[4,1]0,1,2,3}")
    assert "optimizer.step() followed by torch_xla.sync()" in step


def test_sharded_checkpoint_restores_onto_a_2x2_mesh_exactly(runs):
    rec = runs[1]["load"]
    assert rec["devices"] == 4 and rec["mesh"] == {"fsdp": 2, "model": 2}
    assert rec["spec"] == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
    assert rec["model_exact"] and rec["optimizer_exact"]
    assert rec["extra"] == {"step": 3}


def test_fsdpv2_on_eight_devices_matches_one_device_and_restores_the_four_device_checkpoint(runs):
    rec = runs[1]["train_load"]
    train, load = rec["train"], rec["load"]
    assert train["devices"] == 8 and train["spec"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert train["diff_to_untrained"] > 1e-3
    assert train["max_diff"] <= 1e-5
    assert load["mesh"] == {"fsdp": 8, "model": 1}
    assert load["spec"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert load["model_exact"] and load["optimizer_exact"]
    assert load["extra"] == {"step": 3}


def test_every_helper_refuses_fsdp_v1_and_what_it_cannot_do_with_dtensors(runs):
    rec = runs[1]["refuse"]
    prepare, step, save, load = rec["fsdp_v1"]
    assert prepare.startswith("ShardedStateError: prepare_model: model is a torch_xla FSDP module")
    assert step.startswith("ShardedStateError: optimizer_step: param_groups[0].params.0 is a torch_xla "
                           "FSDP flat parameter shard")
    assert save.startswith("ShardedStateError: save_checkpoint: model._fsdp_shard")
    assert "torch_xla FSDP (v1) state-dict entry" in save
    assert load.startswith("ShardedStateError: load_checkpoint: model is a torch_xla FSDP module")
    prepare, step, unnamed, mixed = rec["dtensor"]
    assert prepare.startswith("ShardedStateError: prepare_model: weight is a DTensor")
    assert step.startswith("ShardedStateError: optimizer_step: param_groups[0].params.0 is a DTensor")
    assert unnamed.startswith("ShardedStateError: save_checkpoint: the optimizer's state dict does "
                              "not name its parameters")
    assert "named_parameters()" in unnamed
    assert mixed.startswith("ShardedStateError: save_checkpoint: model.b._fsdp_shard")


CHECK_CONSOLIDATED = """
import sys, torch
from safetensors.torch import load_file
import sharded_worker as w
full = load_file(sys.argv[1])
model = w.make_model()
model.load_state_dict(full)  # the unwrapped model's names
expected = torch.load(sys.argv[2], weights_only=False)["model"]
assert sorted(full) == sorted(expected), (sorted(full), sorted(expected))
assert all(torch.equal(full[k], expected[k]) for k in full)
pt = torch.load(sys.argv[3])
assert all(torch.equal(pt[k], full[k]) for k in full)
assert "torch_xla" not in sys.modules
print("ok", len(full))
"""


def test_consolidate_writes_the_full_model_for_plain_torch(runs, capsys):
    from ray_train_xla.tools.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["consolidate", "--help"])
    assert "safetensors" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    demo_help = capsys.readouterr().out
    assert "--sharded" in demo_help and "--devices" in demo_help

    # `consolidate ckpt full.safetensors --torch full.pt --json`, then CHECK_CONSOLIDATED.
    proc = runs[1]["consolidate"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["sharded"] is True and summary["tensors"] == 6
    check = runs[1]["check_consolidated"]
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.split() == ["ok", "6"]
