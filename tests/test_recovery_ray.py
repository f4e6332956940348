"""Recovery in place through real Ray Train: FSDP2 on ``TorchNeuronConfig``'s CPU twin, 4 workers
over 2 nodes (``two_nodes``), ``recovery="in_place"`` with ``memory_every=1``, the training
function wrapped in ``rtx.recoverable``; ``make test-e2e`` and ``make test-native`` run it (``make
test`` keeps its budget with ``test_recovery_local.py``: the same recovery in two processes
without Ray). The ``in_place`` fit, two faults in turn:

1. rank 2 raises before its step 3: every rank re-enters the function in its own process
   (the 4 PIDs unchanged, Ray starts no worker), restores step 2 from memory and goes on;
2. rank 1 raises before step 5: another fault (not the one before again), recovered the same
   way.

The ``killed`` fit: rank 1's process is killed with SIGKILL from outside
before step 6; the others cannot recover without it, and Ray Train restarts the group (new
processes), which restores from the memory tier.

Every generation records its rank, PID, start step and where it restored from. Each step draws
from torch's, Python's and NumPy's generators (seeded per rank at every entry of the function),
so only a restore that sets them as they were keeps the run exact. After the last step every
rank seeds again and trains a fresh model the same steps without a fault: the parameters and the
optimizer state of the recovered run equal that uninterrupted run's, bit for bit. The run's
goodput names the kinds of recovery (``in_process``, ``group_restart``) and the tier.
(A fault at the same step every time, the budget, the refusals: ``test_recovery_local.py``.)
"""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import connected, fit, neuron_scaling, write_record

pytestmark = [pytest.mark.ray, pytest.mark.native, pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 7
# (generation, rank, step): raise before that step, or be killed
RAISE = [(0, 2, 3), (1, 1, 5)]
KILL = (0, 1, 6)


@pytest.fixture(scope="module")
def two_nodes(two_nodes):
    with connected(two_nodes):
        yield two_nodes


def _seed(rank: int) -> None:
    """Every rank's generators as a fresh start sets them (at every entry of the function)."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)


def _train(model, opt, start: int, steps: int, on_step=None) -> None:
    import random

    import fsdp2_worker as w
    import numpy as np
    import torch

    import ray_train_xla as rtx

    dp_rank, dp = rtx.data_parallel()
    for step in range(start + 1, steps + 1):
        if on_step is not None:
            on_step(step)
        opt.zero_grad()
        # Each step draws from torch's, Python's and NumPy's generators: the recovered run
        # equals the uninterrupted one only if a restore sets them as they were at that step.
        scale = 1 + torch.rand(()).item() + random.random() + float(np.random.rand())
        (scale * w.loss_of(model, w.rows(step, dp_rank, dp))).backward()
        rtx.optimizer_step(opt)
        if on_step is not None:  # the recovered run keeps every step in host memory
            from ray_train_xla.toolkit.checkpoint.memory import memory_tier

            assert rtx.keep_in_memory({"model": model, "optimizer": opt, "step": step}, step)
            memory_tier().wait()


def train_recovering(config):
    import fsdp2_worker as w
    import ray

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import memory_tier
    from ray_train_xla.toolkit.runtime import runtime

    rank, out = rtx.rank(), config["out_dir"]
    world = runtime().world
    ctx = runtime().ctx
    generation = len([f for f in os.listdir(out) if f.startswith("gen")]) // 4  # of this fit
    _seed(rank)
    model = rtx.prepare_sharded_model(w.make_lm(), auto_wrap_policy={w.block_class()})
    opt = w.optimizer(model)
    extra = rtx.load_checkpoint(model, opt)
    start = int(extra["step"]) if extra else 0
    tier = memory_tier()
    rtx.rendezvous(f"started-{world.generation}-{ctx.run_id}")  # every rank counted its generation
    write_record(config, f"gen{generation}_rank{rank}", {
        "rank": rank, "pid": os.getpid(), "run": ctx.run_id, "world_generation": world.generation,
        "generation": generation, "start": start, "node": ray.get_runtime_context().get_node_id(),
        "restored": tier.restored and {k: tier.restored[k]
                                       for k in ("gen", "world", "stores", "generators")}})

    def on_step(step: int) -> None:
        for g, r, s in RAISE if not config["kill"] else []:
            if (generation, rank, step) == (g, r, s):
                raise RuntimeError(f"injected fault on rank {rank} before step {step}")
        if config["kill"] and (generation, rank, step) == KILL:
            subprocess.run(["kill", "-9", str(os.getpid())])  # from another process
            import time

            time.sleep(60)  # (killed before this ends)

    _train(model, opt, start, STEPS, on_step)
    recovered = w.named_state(model, opt)
    _seed(rank)
    fresh = rtx.prepare_sharded_model(w.make_lm(), auto_wrap_policy={w.block_class()})
    fresh_opt = w.optimizer(fresh)
    _train(fresh, fresh_opt, 0, STEPS)
    write_record(config, f"end_rank{rank}", {
        "rank": rank, "pid": os.getpid(), "generation": generation,
        "exact": w.exact(recovered, w.named_state(fresh, fresh_opt)),
        "moved": w.max_diff(recovered["model"], w.named_state(w.make_lm())["model"])})


def _fit(tmp_path_factory, kill: bool) -> dict:
    import ray.train

    import ray_train_xla as rtx
    from ray_train_xla import TorchNeuronConfig

    tmp = tmp_path_factory.mktemp("recovery")
    result, records = fit(
        rtx.recoverable(train_recovering),
        torch_config=TorchNeuronConfig(device="cpu", timeout_s=60, memory_every=1,
                                       recovery="in_place"),
        scaling_config=neuron_scaling(4), loop_config={"kill": kill},
        run_config=ray.train.RunConfig(storage_path=str(tmp), name="recovery",
                                       failure_config=ray.train.FailureConfig(max_failures=1)))
    return {"result": result, "records": records, "path": str(tmp / "recovery")}


@pytest.fixture(scope="module")
def run(two_nodes, tmp_path_factory):
    return _fit(tmp_path_factory, kill=False)


@pytest.fixture(scope="module")
def killed(two_nodes, tmp_path_factory):
    return _fit(tmp_path_factory, kill=True)


def _gens(records) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = {}
    for r in records:
        if "world_generation" in r:
            out.setdefault(r["generation"], {})[r["rank"]] = r
    return out


def test_a_raised_fault_recovers_every_rank_in_its_own_process(run):
    gens = _gens(run["records"])
    assert sorted(gens) == [0, 1, 2] and all(len(g) == 4 for g in gens.values()), gens
    first, second, third = (gens[i] for i in range(3))
    # In place: the same 4 processes, the same Ray run, the world's generation counted up.
    for before, after in ((first, second), (second, third)):
        assert {r: v["pid"] for r, v in after.items()} == {r: v["pid"] for r, v in before.items()}
        assert {v["run"] for v in after.values()} == {v["run"] for v in before.values()}
        assert {v["world_generation"] for v in after.values()} == \
            {next(iter(before.values()))["world_generation"] + 1}
    # Each restored the step before its fault from memory, written by all 4 ranks.
    assert {v["start"] for v in second.values()} == {RAISE[0][2] - 1}
    assert {v["start"] for v in third.values()} == {RAISE[1][2] - 1}
    for g in (second, third):
        assert all(v["restored"] and v["restored"]["world"] == 4 for v in g.values()), g
        assert all(v["restored"]["generators"] is True for v in g.values()), g


def _bit_for_bit(fitted: dict) -> None:
    """Every rank's parameters and optimizer state equal the uninterrupted run's."""
    ends = [r for r in fitted["records"] if "exact" in r]
    assert len(ends) == 4, ends
    assert all(r["exact"] is True and r["moved"] > 0 for r in ends), ends


# (Each test names its fixture as an argument: conftest orders the tests by the cluster their
# fixtures use, which a fixture looked up by name inside a test would hide.)
def test_the_recovered_run_equals_an_uninterrupted_one_bit_for_bit(run):
    _bit_for_bit(run)


def test_goodput_names_each_recovery(run):
    from ray_train_xla.toolkit.observability.goodput import goodput_of

    result = goodput_of(run["path"]).to_json()
    kinds = [(a["recovery"] or {}).get("kind") for a in result["attempts"]]
    assert kinds == [None, "in_process", "in_process"], kinds
    for a in result["attempts"][1:]:
        rec = a["recovery"]
        assert rec["tier"] == "memory" and rec["seconds"] is not None and rec["seconds"] > 0, a
    assert result["buckets_s"]["recovery"] > 0 and result["buckets_s"]["restart"] == 0
    assert all(a["outcome"] == "failed" for a in result["attempts"][:2])
    assert result["attempts"][2]["outcome"] == "finished"


def test_a_killed_process_falls_back_to_restarting_the_group(killed):
    from ray_train_xla.toolkit.observability.goodput import goodput_of

    gens = _gens(killed["records"])
    assert sorted(gens) == [0, 1] and all(len(g) == 4 for g in gens.values()), gens
    first, restarted = gens[0], gens[1]
    # Ray Train started 4 new processes (a new run id, generation 0) and they restored the
    # step before the kill from the memory tier, written by all 4 ranks.
    assert not {v["pid"] for v in restarted.values()} & {v["pid"] for v in first.values()}
    assert {v["world_generation"] for v in restarted.values()} == {0}
    assert {v["start"] for v in restarted.values()} == {KILL[2] - 1}
    assert all(v["restored"] and v["restored"]["world"] == 4 for v in restarted.values())
    assert all(v["restored"]["generators"] is True for v in restarted.values())
    _bit_for_bit(killed)
    result = goodput_of(killed["path"]).to_json()
    kinds = [(a["recovery"] or {}).get("kind") for a in result["attempts"]]
    assert kinds == [None, "group_restart"], kinds
