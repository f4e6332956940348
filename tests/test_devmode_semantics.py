"""The CPU development mode gives torch_xla 2.9's results, or raises what torch_xla raises, for
every call it bridges (issue 19, items 1-9): three worker processes outside Ray, each started
with the planned environment of a 3-worker CPU run and ``init_process_group`` as on a Ray
worker (tests/devmode_worker.py), calling torch_xla's own API.

The expected values are those of torch_xla's own code for 3 devices (``torch_xla/core/
xla_model.py``, ``torch_xla/distributed/xla_backend.py``); its refusals are expected with their
type and message (the C++ ones as torch_xla 2.9 words them on one CPU device).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.topology import Topology

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _envs(world: int) -> list[dict]:
    rdzv = Rendezvous(master_addr="127.0.0.1", master_port=_free_port(), run_id="devmode")
    config = TorchXLAConfig(device="cpu", timeout_s=60)
    return [p.env for p in plan(Topology.uniform([world]), config, rdzv, "cpu")]


@pytest.fixture(scope="module")
def records():
    """Per rank, what each check of tests/devmode_worker.py got (every check runs once)."""
    extra = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": os.environ.get("HOME", "/tmp"),
             "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "RTX_TEST_WORKER_LIMIT_S": "240"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "devmode_worker.py")],
                              env={**env, **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for env in _envs(WORLD)]
    out = []
    for rank, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=300)
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        out.append({"rank": rank, "stderr": stderr[-4000:],
                    "checks": {rec["check"]: rec for rec in lines if rec["rank"] == rank}})
    return out


def _results(records, check):
    for rec in records:
        got = rec["checks"].get(check)
        assert got is not None, f"rank {rec['rank']} did not finish {check!r}: {rec['stderr']}"
        assert "failure" not in got, f"rank {rec['rank']}: {got['failure']}"
    return [rec["checks"][check]["result"] for rec in records]


def test_rendezvous_returns_payloads_by_ordinal_and_refuses_subsets(records):
    for r in _results(records, "rendezvous"):
        assert r["listed"] == ["0", "1", "2"]  # ordinal i's payload at position i
        assert r["subset"] == ["ValueError", "Only global rendezvous is supported"]
        assert r["xla_subset"] == ["ValueError", "Only global rendezvous is supported"]
        assert r["not_bytes"] == ["TypeError", "`payload` must be bytes, not <class 'str'>"]
        assert r["all"] == ["p0", "p1", "p2"]


def test_dist_reduce_leaves_the_other_ranks_unchanged(records):
    got = [r["value"] for r in _results(records, "dist_reduce")]
    assert got == [[1.0, 1.0], [6.0, 6.0], [3.0, 3.0]]


def test_step_closures_run_at_the_next_mark_step_not_inside_a_collective(records):
    for r in _results(records, "step_closures"):
        assert r["during"] == {name: [] for name in r["during"]}, r["during"]
        assert r["after_mark_step"] == [1.0]  # it ran once, and saw w after w.add_(1)
        assert r["in_optimizer_step"] == 0
        assert r["closure_weight"] == [r["final_weight"]]  # after optimizer.step()


def test_reduce_scatter_refuses_a_dimension_shard_count_does_not_divide(records):
    for rank, r in enumerate(_results(records, "reduce_scatter")):
        msg = "ReduceScatter operand scatter dimension size {} must be dividable by shard_count 3."
        assert r["single"] == ["RuntimeError", msg.format(7)]
        assert r["list"] == ["RuntimeError", msg.format(7)]
        assert r["dim1"] == ["RuntimeError", msg.format(4)]
        assert r["ok"] == [3.0 * 2 * rank, 3.0 * (2 * rank + 1)]


def test_all_gather_into_tensor_takes_stacked_and_concatenated_outputs(records):
    for r in _results(records, "all_gather_into_tensor"):
        assert r["stacked"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        assert r["flat"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert r["scalar"] == [0.0, 1.0, 2.0]
        assert r["wrong"] == [
            "ValueError", "Input shape torch.Size([2]) and output shape torch.Size([5]) are not "
            "compatible for all_gather_into_tensor. Input must be stacked or concatenated to "
            "create output."]


def test_all_reduce_scale_is_converted_to_the_tensor_dtype_first(records):
    for r in _results(records, "scale"):
        assert r["int_half"] == [0, 0]  # the sums are [6, 9]; int64(0.5) == 0
        assert r["int_2_5"] == [12, 18]  # int64(2.5) == 2
        assert r["int_list"] == [[0, 0]]
        assert r["bf16"] == [0.90234375]  # 3 * bf16(0.3), not bf16(3 * 0.3) == 0.8984375
        assert r["f32"] == pytest.approx([0.9])


def test_collective_broadcast_with_groups_zeroes_groups_without_the_root(records):
    got = _results(records, "collective_broadcast")
    assert [r["grouped"] for r in got] == [[3.0, 3.0], [0.0, 0.0], [3.0, 3.0]]
    assert [r["global"] for r in got] == [[2.0, 2.0]] * 3


def test_what_torch_xla_refuses_is_refused(records):
    for rank, r in enumerate(_results(records, "refusals")):
        assert r["list_pinned"] == [
            "RuntimeError",
            "For xm.all_gather with list of tensors input, pin_layout=True is not yet supported."]
        assert r["unequal_unpinned"] == [
            "AssertionError", "Replica groups must have the same number of replicas/shards."]
        # pinned, torch_xla gathers through a padded all_reduce: unequal groups work, in the
        # order each group lists its members
        assert r["unequal_pinned"] == ([1.0] if rank == 1 else [2.0, 0.0])
        assert r["not_tensor"] == [
            "TypeError", "`value` needs to be a Tensor or a list of Tensors, but given <class 'int'>."]


def test_compiled_functions_with_bridged_collectives_work_or_fail_at_compile_time(records):
    for rank, r in enumerate(_results(records, "compile")):
        assert r["all_gather"] == [1.0, 2.0, 3.0]
        assert r["all_gather_full"] == [0.0, 2.0, 4.0]
        assert r["list_all_reduce"] == [9.0] and r["list_all_reduce_inputs"] == [[3.0], [6.0]]
        assert r["grouped_all_reduce"] == ([1.0] if rank == 1 else [2.0])
        assert r["scaled_all_reduce"] == [1.5]
        assert r["reduce_scatter"] == [3.0 * rank - 1]
        assert r["all_gather_out"] == r["all_gather_out_input"] == [0.0, 1.0, 2.0]
        assert r["reduce_scatter_list"] == [[1.5], [1.5]]  # (1+1+1)/2, (0+1+2)/2
        assert r["collective_broadcast"] == [6.0] and r["collective_broadcast_input"] == [6.0]
        assert r["rendezvous"] == [rank + 3.0]  # outside the graph (a graph break)
        # torch.distributed on XLA tensors: torch.compile makes them functional collectives,
        # which torch_xla alone would run on this worker's one device
        assert r["dist_all_reduce"] == [3.0]
        assert r["dist_gather"] == [[0.0, 1.0, 2.0], [6.0 * rank]]
        kind, msg = r["rendezvous_full"]
        assert "xm.rendezvous" in msg and "outside the compiled function" in msg, msg
