"""Recovery in place without Ray: the config's refusals, the decision every rank takes from the
faults, and two processes over gloo started as the backend starts them (the planned
environment, ``init_native_process_group``), running ``rtx.recoverable`` inside the training
function's context:

- rank 1 raises while rank 0 waits in FSDP2's all-gather with it: rank 0 fails at once (its
  connection to rank 1 is shut down), not after ``timeout_s``; both re-enter the function in
  their own processes, on generation 1's process group, where a collective works again;
- the function then takes a step without ``load_checkpoint``: the run fails with
  ``RecoveryError`` on both ranks;
- a fault at the same step every time: the second is not recovered, and the run fails with
  the origin's own error (a note says why) and ``RecoveryError`` naming it on the other rank,
  within seconds;
- a fault on rank 1 after rank 0's function returned: rank 1 does not wait ``timeout_s`` for
  it, and fails with its own error at once (a restart of the group takes over).
(Through Ray Train, with FSDP2, the memory tier and a killed process: ``test_recovery_ray.py``.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ray_train_xla import TorchNeuronConfig, TorchTPUConfig, TorchXLAConfig, XLAConfigError

pytestmark = pytest.mark.native

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 60


def test_the_configs_refuse_recovery_in_place_that_cannot_work():
    for config in (TorchXLAConfig, TorchNeuronConfig, TorchTPUConfig):
        with pytest.raises(XLAConfigError, match=r"recovery='in_place'.*set memory_every=N"):
            config(recovery="in_place")
        with pytest.raises(XLAConfigError, match=r"recovery='later' .*'restart'.*'in_place'"):
            config(recovery="later")
        with pytest.raises(XLAConfigError, match=r"max_in_place_restarts=0 .*int >= 1"):
            config(recovery="in_place", memory_every=1, max_in_place_restarts=0)
    for config in (TorchNeuronConfig, TorchTPUConfig):
        assert config(recovery="in_place", memory_every=1).max_in_place_restarts == 3
    # torch_xla: its runtime starts once per process (on the CPU too)
    for device in ("auto", "neuron", "tpu", "cpu"):
        with pytest.raises(XLAConfigError, match="TorchNeuronConfig or TorchTPUConfig"):
            TorchXLAConfig(device=device, recovery="in_place", memory_every=1)


def test_the_plan_carries_the_budget():
    from ray_train_xla.planning.contract import RECOVERY_VAR, WorkerContext
    from ray_train_xla.planning.planner import Rendezvous, plan
    from ray_train_xla.planning.topology import Topology

    def planned(config, device):
        topology = Topology.uniform([1], 0 if device == "cpu" else 1)
        return plan(topology, config, Rendezvous("10.0.0.1", 29500, run_id="r"), device)

    env = planned(TorchNeuronConfig(device="cpu", recovery="in_place", memory_every=2,
                                    max_in_place_restarts=5), "cpu")[0].env
    assert env[RECOVERY_VAR] == "in_place:5"
    assert WorkerContext.from_env(env).in_place_restarts == 5
    assert RECOVERY_VAR not in planned(TorchNeuronConfig(device="cpu"), "cpu")[0].env
    assert WorkerContext.from_env({}).in_place_restarts == 0


def _fault(rank, at, order, calls=(0, 0)):
    return {"rank": rank, "at": list(at), "order": order, "calls": list(calls),
            "error": f"RuntimeError: rank {rank}", "t": 0.0}


def test_every_rank_decides_alike_from_the_faults():
    from ray_train_xla.startup.recovery import decide

    first = [_fault(1, (-1, 4), 1), _fault(0, (-1, 4), 2)]
    assert decide(first, (), 3) == ""
    before = (first[0],)
    # another step after the same restore, or the same step after another one: recovered
    assert decide([_fault(0, (2, 3), 1), _fault(1, (2, 3), 2)], before, 3) == ""
    assert decide([_fault(0, (-1, 5), 1), _fault(1, (-1, 5), 2)], before, 3) == ""
    # the origin's place again: refused, whoever raised first this time
    again = decide([_fault(0, (-1, 4), 1), _fault(1, (-1, 3), 2)], before, 3)
    assert "repeats at step 4" in again
    # the budget spent
    spent = decide(first, (first[0], first[0], first[0]), 3)
    assert spent.startswith("max_in_place_restarts=3 recoveries in place were made already")
    # reports handed to Ray differ: Ray's barrier would hang on one rank
    assert "different numbers of checkpoints and reports" in decide(
        [_fault(0, (-1, 4), 1, (2, 0)), _fault(1, (-1, 4), 2, (1, 0))], (), 3)


WORKER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[5])
import fsdp2_worker as w
rank, port, scenario, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
w.native_cpu_env(rank, 2, port, "rec", TIMEOUT_S)
os.environ["RAY_TRAIN_XLA_RECOVERY"] = "in_place:3"
import torch, torch.distributed as dist
from ray_train_xla.startup.process_group import init_native_process_group
from ray_train_xla.startup import train_function
from ray_train_xla.toolkit.runtime import world
import ray_train_xla as rtx
init_native_process_group()
log = []

def record(**kw):
    log.append({"rank": rank, "pid": os.getpid(), "generation": world().generation,
                "t": time.time(), **kw})

def train():
    record(event="enter")
    if scenario == "peer" and world().generation == 0:
        # FSDP2 keeps its groups' connections open past destroy_process_group: the recovery
        # shuts them down itself
        model = rtx.prepare_sharded_model(w.make_lm(), auto_wrap_policy={w.block_class()})
        w.loss_of(model, w.rows(1, rank, 2)).backward()
        if rank == 1:
            time.sleep(1.0)  # rank 0 is in the all-gather of the next forward by now
            record(event="raise")
            raise RuntimeError("injected on rank 1")
        try:
            w.loss_of(model, w.rows(2, rank, 2)).backward()
        except Exception as exc:
            record(event="peer failed", error=str(exc)[:200])
            raise
    if scenario == "peer":  # generation 1: the group works, then a step without a restore
        total = torch.ones(1)
        dist.all_reduce(total)
        record(event="all_reduce", total=float(total))
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2)).sum().backward()
        rtx.optimizer_step(opt)
        record(event="stepped")
    if scenario == "repeat":
        record(event="raise")
        raise RuntimeError(f"the same fault on rank {rank}")
    if scenario == "late" and rank == 1:  # after rank 0's function returned
        time.sleep(1.0)
        record(event="raise")
        raise RuntimeError("a fault after the last collective")

try:
    with train_function.training_function():
        rtx.recoverable(train)()
except Exception as exc:
    record(event="failed", type=type(exc).__name__, error=str(exc)[:400],
           notes=getattr(exc, "__notes__", []))
json.dump(log, open(os.path.join(out, f"rank{rank}.json"), "w"))
time.sleep(3)  # as a Ray worker's process, it outlives its function (rank 0 serves the store)
""".replace("TIMEOUT_S", str(TIMEOUT_S))


def _run(scenario: str, tmp_path) -> dict[int, list[dict]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), scenario,
                               str(tmp_path), HERE], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=2 * TIMEOUT_S)[0] for p in procs]
    logs = {}
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), outs[r][-3000:]
        logs[r] = json.loads(path.read_text())
    return logs


def test_a_peer_blocked_with_the_failed_rank_fails_at_once_and_both_recover(tmp_path):
    logs = _run("peer", tmp_path)
    raised = next(e for e in logs[1] if e["event"] == "raise")
    peer = next(e for e in logs[0] if e["event"] == "peer failed")
    # rank 0 learnt of the fault from its connection, not from timeout_s
    assert peer["t"] - raised["t"] < 10 < TIMEOUT_S, (peer, raised)
    for r in (0, 1):
        enters = [e for e in logs[r] if e["event"] == "enter"]
        assert [e["generation"] for e in enters] == [0, 1]
        assert len({e["pid"] for e in logs[r]}) == 1  # one process throughout
        assert next(e for e in logs[r] if e["event"] == "all_reduce")["total"] == 2.0
        # a step after the recovery without load_checkpoint: refused, not trained
        assert not [e for e in logs[r] if e["event"] == "stepped"]
        failed = logs[r][-1]
        assert failed["type"] == "RecoveryError" and "without restoring" in failed["error"]


def test_a_fault_at_the_same_step_again_fails_the_run_with_its_error(tmp_path):
    logs = _run("repeat", tmp_path)
    ends = {r: logs[r][-1] for r in (0, 1)}
    raises = sorted((e for r in (0, 1) for e in logs[r] if e["event"] == "raise"),
                    key=lambda e: e["t"])
    assert [e["generation"] for e in raises].count(1) == 2  # both raised again, once
    origin = {e["rank"] for e in raises if e["generation"] == 1}
    for r, end in ends.items():
        assert end["event"] == "failed", end
        if end["type"] == "RuntimeError":  # the origin: its own error, with why
            assert end["error"] == f"the same fault on rank {r}"
            assert any("repeats at step 0" in n for n in end["notes"]), (end["notes"], end["error"])
        else:
            assert end["type"] == "RecoveryError" and "repeats at step 0" in end["error"]
            assert "the same fault on rank" in end["error"]
    assert {e["type"] for e in ends.values()} == {"RuntimeError", "RecoveryError"}
    assert origin == {0, 1}
    assert max(e["t"] for e in ends.values()) - raises[0]["t"] < 30  # bounded: no timeout


def test_recovery_in_place_without_the_wrapper_is_named_at_the_restore(monkeypatch):
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.runtime import runtime

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "wrapper-check")  # a plan of its own
    monkeypatch.setenv("RAY_TRAIN_XLA_RECOVERY", "in_place:3")
    with pytest.raises(ValueError, match=r"recovery='in_place'.*rtx.recoverable\(train_func\)"):
        rtx.load_checkpoint(torch.nn.Linear(2, 2))
    assert rtx.recoverable(lambda: runtime().recoverable)() is True


def test_a_fault_after_another_rank_returned_is_not_waited_for(tmp_path):
    logs = _run("late", tmp_path)
    raised = next(e for e in logs[1] if e["event"] == "raise")
    end = logs[1][-1]
    assert end["type"] == "RuntimeError" and end["error"] == "a fault after the last collective"
    assert any("rank(s) [0] returned from the training function" in n for n in end["notes"]), end
    assert end["t"] - raised["t"] < 10 < TIMEOUT_S  # not the timeout: rank 0 said it returned
    assert [e["event"] for e in logs[0]] == ["enter"]  # rank 0 returned, once
