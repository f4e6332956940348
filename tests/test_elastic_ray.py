"""An elastic run on a Ray cluster of its own (``ray.cluster_utils.Cluster``): Ray Train V2 with
``ScalingConfig(num_workers=(2, 4))``, twice: ``TorchXLAConfig`` on CPU workers with a replicated
model, and ``TorchNeuronConfig``'s CPU twin with the model sharded by FSDP2
(``prepare_sharded_model``: its checkpoints resharded 4 -> 2 -> 4); data parallelism with
``prepare_data_loader(global_batch_size=...)``, a checkpoint every 4 steps. A
node is drained mid-run as a spot reclaim is (reason PREEMPTION, with a deadline): the workers
see it, ``checkpoint_if_preempted`` saves the step they are at, and when Ray takes the node down
at the deadline the group shrinks to 2 and resumes from that step, none lost. The node is then
added back (the group grows to 4). The final parameters equal a fixed-size run over the same
global batches, computed here with plain torch, and every step is applied once.

This module removes and adds nodes, so it starts its own cluster (a head node without worker
slots and two nodes of two slots each).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from conftest import HAS_TORCH_XLA, fit_in_background, is_train_v2, write_record

# The FSDP2 run (TorchNeuronConfig's twin) is `make test-native`'s, on the torch the native stacks
# ship; the replicated one (the same scenario, the path the toolkit had first) `make test-e2e`'s.
# `make test` runs it in its second process, after the tests without Ray (tests/run_suite.py).
pytestmark = [pytest.mark.ray, pytest.mark.beside]

ROWS, FEATURES, GLOBAL_BATCH = 40, 3, 4  # 10 global batches an epoch
STEPS = 14  # into the second epoch
CHECKPOINT_EVERY = 4  # steps; the preemption checkpoint comes between two of them
SHRINK_AFTER, GROW_AFTER = 4, 8  # steps done when the node is drained / comes back
DRAIN_DEADLINE_S = 8  # from the drain to Ray taking the node down
STEP_SLEEP_S = 0.5  # the group of 4 trains slowly between the drain and the deadline
BLOCK_TIMEOUT_S = 120  # a group waiting for the resize fails after this
LR, MOMENTUM = 0.1, 0.9


def fast_coordinator():
    """worker_process_setup_hook: Ray Data's AutoscalingCoordinator (a detached actor that this
    job creates) refreshes the cluster's nodes every 20 s; Ray Train's elastic policy sizes a
    group from that view. Every second here, so the test waits seconds, not tens of them."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coord

    coord._AutoscalingCoordinatorActor.TICK_INTERVAL_S = 1


def dataset():
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, FEATURES, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True)
    return torch.utils.data.TensorDataset(torch.arange(ROWS), x, y)


def new_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def wait_for_resize(config, name):
    """Tell the test this group reached its point, then wait for Ray to end it (bounded)."""
    write_record(config, name, {"pid": os.getpid()})
    deadline = time.monotonic() + BLOCK_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
    raise RuntimeError(f"{name}: the worker group was not resized within {BLOCK_TIMEOUT_S} s")


def train_elastic(config):
    import torch

    import ray_train_xla as rtx

    r, world = rtx.rank(), rtx.world_size()
    loader = rtx.prepare_data_loader(
        torch.utils.data.DataLoader(dataset(), shuffle=True),
        seed=3, global_batch_size=GLOBAL_BATCH)
    if config.get("sharded"):
        model = rtx.prepare_sharded_model(new_model())
    else:
        model = rtx.prepare_model(new_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    state = rtx.load_checkpoint(model, opt)
    applied = list(state["applied"]) if state else []
    if state:
        loader.load_state_dict(state["data"])
    write_record(config, f"start_w{world}_r{r}_pid{os.getpid()}", {
        "world": world, "rank": r, "pid": os.getpid(), "start_step": len(applied),
        "torch_world": torch.distributed.get_world_size(), "data": loader.state_dict(),
    })
    # Ray Train registers a reported checkpoint at its next poll of the workers.
    registered_s = 4 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2))
    step = len(applied)
    drained = False  # the group of 4 waits for the drain after step SHRINK_AFTER
    while step < STEPS:
        for ids, xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            rtx.optimizer_step(opt)
            applied.append(step)
            write_record(config, f"step{step:02d}_w{world}_r{r}_pid{os.getpid()}", {
                "step": step, "world": world, "rank": r, "ids": ids.cpu().tolist(),
                "t": time.time()})
            step += 1

            def state(applied=applied):
                return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "applied": list(applied), "data": loader.state_dict()}

            block = (world, step) == (2, GROW_AFTER)
            if step % CHECKPOINT_EVERY == 0 or step == STEPS:
                # wait=True where the test then acts: the checkpoint is reported.
                rtx.save_checkpoint(state(), {"step": step},
                                    wait=block or (world, step) == (4, SHRINK_AFTER))
            if (world, step) == (4, SHRINK_AFTER):
                time.sleep(registered_s)
                if r == 0:
                    write_record(config, "ready_w4", {"step": step})
                drained = True
            elif drained:
                # Every step (on every rank: Ray's preemption query is a barrier); no further
                # than the step before the next regular checkpoint.
                info = rtx.checkpoint_if_preempted(state, {"step": step})
                deadline = time.monotonic() + BLOCK_TIMEOUT_S
                while info is None and step >= GROW_AFTER - 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no preemption seen within {BLOCK_TIMEOUT_S} s")
                    time.sleep(0.5)
                    info = rtx.checkpoint_if_preempted(state, {"step": step})
                if info is not None:
                    time.sleep(registered_s)
                    if r == 0:
                        write_record(config, "preempt_saved", {
                            "step": step, "t": time.time(), "deadline_ms": info.deadline_ms,
                            "nodes": list(info.preempted_node_ids)})
                    wait_for_resize(config, f"preempted_w{world}_r{r}")
            if drained:
                time.sleep(STEP_SLEEP_S)
            if block:
                time.sleep(registered_s)
                if r == 0:
                    write_record(config, f"ready_w{world}", {"step": step})
                wait_for_resize(config, f"blocked_w{world}_r{r}")
            if step == STEPS:
                break
    rtx.flush_reports()
    write_record(config, f"final_r{r}_pid{os.getpid()}", {
        "world": world, "rank": r, "applied": applied,
        "params": [whole(p).reshape(-1).tolist() for p in model.parameters()],
    })


def whole(param):
    """A parameter's whole value on the CPU (a DTensor gathered)."""
    full = getattr(param, "full_tensor", None)
    return (full() if full is not None else param).detach().cpu()


def fixed_size_run():
    """The same global batches on one process, plain torch on CPU: (ids per step, params)."""
    import torch

    # torch's autograd engine sizes its per-device queues at a process's first backward, from
    # the devices known then: with torch_xla's device started first, the tests that later run
    # XLA backward passes in this process still find a queue for it.
    if HAS_TORCH_XLA:
        import torch_xla

        torch_xla.device()

    import ray_train_xla as rtx

    loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(dataset(), shuffle=True),
                                     seed=3, global_batch_size=GLOBAL_BATCH, to_device=False)
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    batches = []
    while len(batches) < STEPS:
        for ids, xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            batches.append(ids.tolist())
            if len(batches) == STEPS:
                break
    return batches, [p.detach().reshape(-1).tolist() for p in model.parameters()]


def read_records(out_dir):
    import json

    out = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                out[name[:-5]] = json.load(f)
    return out


def wait_for(path, what, timeout_s=150):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


# After a node leaves, Ray Train may first try the old size again (the coordinator's view of the
# cluster is a moment behind) and waits this long for its placement group (60 s by default)
# before it sizes the group from a fresh view. The controller polls the workers every 0.5 s (a
# reported checkpoint is registered sooner) and Ray's drain state every second. Ray passes these
# from the driver's environment to its controller and workers.
CLUSTER_ENV = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5",
               "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
               "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}


@pytest.fixture(scope="module")
def elastic_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False)  # the head: no worker slot
        nodes = [cluster.add_node(num_cpus=2, resources={"slot": 2}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": f"{__name__}.fast_coordinator"})
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.skipif(not is_train_v2(), reason="elastic training is Ray Train V2's")
@pytest.mark.parametrize("sharded", [
    pytest.param(False, id="replicated-xla", marks=pytest.mark.e2e),
    pytest.param(True, id="fsdp2-native", marks=(pytest.mark.native, pytest.mark.native_only)),
])
def test_elastic_run_shrinks_and_grows_and_matches_a_fixed_size_run(elastic_cluster, sharded):
    import torch
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchNeuronConfig, TorchXLAConfig, check_scaling_config

    cluster, nodes = elastic_cluster
    out_dir = tempfile.mkdtemp(prefix="rtx-test-elastic-")
    scaling = ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 1, "slot": 1},
                            elastic_resize_monitor_interval_s=1)
    config = (TorchNeuronConfig(device="cpu", timeout_s=60) if sharded
              else TorchXLAConfig(device="cpu", timeout_s=60))
    assert check_scaling_config(scaling, config) == (2, 4)
    trainer = TorchTrainer(
        train_elastic, train_loop_config={"out_dir": out_dir, "sharded": sharded},
        torch_config=config,
        scaling_config=scaling,
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="rtx-test-results-"),
                             failure_config=FailureConfig(max_failures=3)))
    t0 = time.monotonic()
    thread, outcome = fit_in_background(trainer)
    wait_for(os.path.join(out_dir, "ready_w4.json"), "4 workers at the first block")
    # Drain a node as a spot reclaim does (what `ray drain-node` and the autoscaler call); at
    # the deadline Ray takes the node down itself.
    deadline_ms = int(time.time() * 1000) + DRAIN_DEADLINE_S * 1000
    accepted, why = GcsClient(address=cluster.address).drain_node(
        nodes[1].node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim (test)", deadline_ms)
    assert accepted, why
    t_shrink = deadline_ms / 1000
    wait_for(os.path.join(out_dir, "ready_w2.json"), "2 workers after the node left")
    try:
        cluster.remove_node(nodes[1])  # Ray has taken it down: its processes are gone
    except Exception:  # noqa: BLE001 (nothing is left to stop)
        pass
    t_grow = time.time()
    drained = nodes[1]
    nodes[1] = cluster.add_node(num_cpus=2, resources={"slot": 2})  # the next run drains it
    thread.join(timeout=240)
    assert not thread.is_alive(), "fit() did not end within 240 s of the node's return"
    took = time.monotonic() - t0
    assert "error" not in outcome, outcome.get("error")
    records = read_records(out_dir)

    # Groups of 4, 2 and 4 workers, each resumed where the last checkpoint left it, and
    # torch_xla / torch.distributed / the toolkit agreeing on the world in each.
    starts = [r for n, r in records.items() if n.startswith("start_")]
    by_group: dict = {}
    for s in starts:
        by_group.setdefault((s["start_step"], s["world"]), []).append(s)
    groups = sorted(by_group)
    assert [w for _, w in groups] == [4, 2, 4], groups
    # The group of 2 starts at the step the preemption checkpoint saved, after the last regular
    # checkpoint and before the drain's deadline: the shrink lost no step.
    saved = records["preempt_saved"]
    assert SHRINK_AFTER < saved["step"] < GROW_AFTER, saved
    assert saved["deadline_ms"] == deadline_ms and saved["nodes"] == [drained.node_id]
    assert saved["t"] * 1000 < deadline_ms
    assert [s for s, _ in groups] == [0, saved["step"], GROW_AFTER], groups
    for (_, world), members in by_group.items():
        assert sorted(m["rank"] for m in members) == list(range(world))
        assert {m["torch_world"] for m in members} == {world}
        assert len({str(m["data"]) for m in members}) == 1  # one data position per group

    # Every step's global batch is the fixed-size run's, rows in the same order.
    fixed_batches, fixed_params = fixed_size_run()
    steps: dict = {}
    for name, rec in records.items():
        if name.startswith("step"):
            steps.setdefault((rec["step"], rec["world"]), {})[rec["rank"]] = rec["ids"]
    for (step, world), by_rank in steps.items():
        rows = [i for r in range(world) for i in by_rank[r]]
        assert rows == fixed_batches[step], (step, world)
    # No step was trained twice (by two groups) or skipped.
    assert sorted(step for step, _ in steps) == list(range(STEPS)), sorted(steps)
    finals = sorted((r for n, r in records.items() if n.startswith("final_")),
                    key=lambda r: r["rank"])
    assert [f["rank"] for f in finals] == [0, 1, 2, 3] and {f["world"] for f in finals} == {4}
    for f in finals:
        assert f["applied"] == list(range(STEPS))  # each step applied once, none skipped
        for got, want in zip(f["params"], fixed_params, strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    step_times = [(r["world"], r["t"]) for n, r in records.items() if n.startswith("step")]
    shrink = min(t for w, t in step_times if w == 2) - t_shrink
    grow = min(t for w, t in step_times if w == 4 and t > t_grow) - t_grow
    print(f"\nelastic run: {took:.1f} s in all; drain deadline -> first step of 2 workers "
          f"{shrink:.1f} s; node added -> first step of 4 workers {grow:.1f} s")
