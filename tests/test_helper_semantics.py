"""Worker helpers take Ray Train ranks and, under SPMD on an accelerator, treat XLA tensors as
global values: run on real torch_xla (CPU) in fresh processes with planned environments."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.topology import Topology, WorkerFacts

HERE = os.path.dirname(os.path.abspath(__file__))
RDZV = Rendezvous(master_addr="127.0.0.1", master_port=1, run_id="r")


def rank_mapping_env() -> dict:
    """Ray rank 1 of 2 on the xla process-group path; its XLA ordinal is 0 (alone in its
    process), so rank and ordinal differ as they do on TPU when task ids follow chip order."""
    env = plan(Topology.uniform([2]), TorchXLAConfig(device="cpu"), RDZV, "cpu")[1].env
    return {**env, "RAY_TRAIN_XLA_PG_BACKEND": "xla", "RAY_TRAIN_XLA_INIT_METHOD": "xla://"}


def tpu_spmd_on_cpu_env() -> dict:
    """The 2-host TPU SPMD plan of rank 0, run on an XLA CPU mesh of 4 devices."""
    facts = [WorkerFacts(node_id=f"n{n}", node_ip=f"10.0.0.{n + 1}", pid=1,
                         accelerator_ids={"TPU": ("0", "1", "2", "3")}) for n in range(2)]
    env = plan(Topology.from_facts(facts, "TPU"), TorchXLAConfig(device="tpu", spmd=True),
               RDZV, "tpu", facts)[0].env
    assert env["XLA_USE_SPMD"] == "1" and env["RAY_TRAIN_XLA_DEVICE"] == "tpu"
    return {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


@pytest.fixture(scope="module")
def probes():
    base = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    procs = {
        name: subprocess.Popen([sys.executable, os.path.join(HERE, "helpers_probe.py"), name],
                               env={**env, **base}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        for name, env in (("rank-mapping", rank_mapping_env()),
                          ("spmd-global", tpu_spmd_on_cpu_env()))
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_broadcast_src_is_the_ray_rank_not_the_xla_ordinal(probes):
    res = probes["rank-mapping"]
    assert (res["rank"], res["ordinal"]) == (1, 0)
    # src=1 is this worker: its own value. src=0 is another worker: this one contributes
    # nothing (torch_xla's root_ordinal=0 would have taken this worker's value, ordinal 0).
    assert res["broadcast_src_own_rank"] == [5.0, -1.0]
    assert res["broadcast_src_other_rank"] == [0.0, 0.0]
    assert res["broadcast_nan_from_non_src"] == [0.0, 0.0]


def test_spmd_global_tensors_are_not_reduced_again(probes):
    res = probes["spmd-global"]
    assert res["is_spmd"] and res["devices"] == 4
    assert res["uses_host_collectives"] is False
    # Global values: no host round trip (there is no process group), no hosts x value.
    assert res["sum"] == res["mean"] == res["broadcast"] == res["x"]
    assert res["grad"] == res["expected_grad"]


def test_device_and_sync_fall_back_to_torch_xla_1_x_api(monkeypatch):
    # torch_xla 1.13 (XRT, torch-neuronx 1.x) has no torch_xla.device() or torch_xla.sync():
    # the helpers fall back to xm.xla_device() and xm.mark_step(). The attributes are removed
    # from the real module for this test only.
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import ray_train_xla as rtx

    calls = []
    xla0 = torch_xla.device()
    monkeypatch.delattr(torch_xla, "device")
    monkeypatch.delattr(torch_xla, "sync")
    # torch_xla 2.9's own xm functions call the removed ones: record the fallbacks' calls.
    monkeypatch.setattr(xm, "xla_device", lambda *a, **k: calls.append("xla_device") or xla0)
    monkeypatch.setattr(xm, "mark_step", lambda *a, **k: calls.append("mark_step"))
    assert rtx.get_device() == xla0
    rtx.sync()
    assert calls == ["xla_device", "mark_step"]
    assert torch.ones(2, device=xla0).sum().item() == 2.0
