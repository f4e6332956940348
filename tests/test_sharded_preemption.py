"""Preemption through Ray's own drain API: a two-node ray.cluster_utils.Cluster, the worker's
node drained (reason PREEMPTION, with a deadline) while it trains FSDPv2. The worker sees the
preemption (``ray.train.get_preemption_info``), ``checkpoint_if_preempted`` saves before the
deadline, Ray Train restarts the run on another node at the deadline, and the run resumes from
that checkpoint and ends with the parameters of an uninterrupted run. One fit (with a restart)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from conftest import fit, is_train_v2, start_cluster, stop_cluster

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

TOTAL_STEPS, STEP_SLEEP_S, DRAIN_AT, DEADLINE_S = 40, 0.5, 3, 6


def preempted_train(config):
    import ray
    import sharded_worker as w
    import torch

    import ray_train_xla as rtx

    def record(name, data):
        with open(os.path.join(config["events_dir"], f"{name}.json.tmp"), "w") as f:
            json.dump(data, f)
        os.replace(f.name, f.name[:-4])  # the driver's watcher never reads half a file

    mesh, model, opt, to_device, sync = w.sharded_setup(None)
    state = rtx.load_checkpoint(model, opt)
    step = state["step"] if state else 0
    node = ray.get_runtime_context().get_node_id()
    record(f"start_{node}", {"node": node, "resumed_from": step})
    while step < TOTAL_STEPS:
        x, y = to_device(w.batch(step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sync()
        step += 1
        record("progress", {"step": step, "node": node})
        info = rtx.checkpoint_if_preempted(
            lambda step=step: {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            {"step": step})
        if info is not None and not os.path.exists(os.path.join(config["events_dir"], "saved.json")):
            record("saved", {"step": step, "node": node, "time_ms": time.time() * 1000,
                                           "deadline_ms": info.deadline_ms,
                                           "preempted_nodes": info.preempted_node_ids})
        if not state:  # slow until the node goes at the deadline; the resumed run need not wait
            time.sleep(STEP_SLEEP_S)
    # Plain training on one device, steps 0..TOTAL_STEPS-1 uninterrupted, in this process
    # (after XLA is up).
    reference = w.reference(TOTAL_STEPS)
    got = w.plain_keys({k: v.cpu() for k, v in model.state_dict().items()})
    record("final", {"node": node, "max_diff": w.max_diff(got, reference)})


def read(out_dir, name):
    path = os.path.join(out_dir, f"{name}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def test_drained_node_checkpoints_before_the_deadline_and_the_run_resumes_exactly(tmp_path):
    import ray
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from ray_train_xla import TorchXLAConfig

    if not is_train_v2():
        pytest.skip("ray.train.get_preemption_info is Ray Train V2")
    cluster = start_cluster(nodes=1, cpus_per_node=1, runtime_env={"env_vars": {
        "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}})
    try:
        # The head has no "spot" resource: the worker lands on one spot node; the other is
        # where the run restarts.
        for _ in range(2):
            cluster.add_node(num_cpus=2, resources={"spot": 1}, include_dashboard=False)
        cluster.wait_for_nodes()
        out_dir = str(tmp_path / "out")
        os.makedirs(out_dir)
        events = {}

        def preempt():
            # Drain the worker's node through GCS (what `ray drain-node` and the autoscaler
            # call) once training runs. At the deadline Ray itself takes the node down
            # (AUTOSCALER_DRAIN_PREEMPTED), as a reclaimed spot instance goes.
            while (read(out_dir, "progress") or {}).get("step", 0) < DRAIN_AT:
                time.sleep(0.2)
            node = read(out_dir, "progress")["node"]
            deadline_ms = int(time.time() * 1000) + DEADLINE_S * 1000
            accepted, why = GcsClient(address=cluster.address).drain_node(
                node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "spot reclaim (test)", deadline_ms)
            events.update(node=node, accepted=accepted, why=why, deadline_ms=deadline_ms)

        thread = threading.Thread(target=preempt, daemon=True)
        thread.start()
        fit(preempted_train, loop_config={"events_dir": out_dir},
            torch_config=TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=2, timeout_s=120),
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "spot": 1}),
            run_config=RunConfig(storage_path=str(tmp_path / "results"),
                                 failure_config=FailureConfig(max_failures=0)))
        thread.join(timeout=5)
    finally:
        ray.shutdown()
        stop_cluster(cluster)

    assert events.get("accepted"), events
    spot = events["node"]
    saved = read(out_dir, "saved")
    assert saved is not None, "the worker never saw the preemption"
    assert saved["node"] == spot and saved["preempted_nodes"] == [spot]
    assert saved["deadline_ms"] == events["deadline_ms"]
    assert saved["time_ms"] < events["deadline_ms"]  # saved before the deadline
    starts = [json.load(open(os.path.join(out_dir, f))) for f in os.listdir(out_dir)
              if f.startswith("start_")]
    by_node = {s["node"]: s for s in starts}
    assert len(by_node) == 2, starts  # restarted on the spare node
    assert by_node[spot]["resumed_from"] == 0
    (resumed,) = [s for n, s in by_node.items() if n != spot]
    assert resumed["resumed_from"] == saved["step"]  # from the preemption checkpoint
    final = read(out_dir, "final")
    assert final["node"] != spot
    assert final["max_diff"] <= 1e-5
