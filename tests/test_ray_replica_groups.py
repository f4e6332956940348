"""What Ray Train does for a backend that declares replica groups (``Backend.has_replica_groups``,
the mechanism a dead worker's replacement alone would take, docs/recovery.md), watched here
because its behaviour in Ray 2.60 is why this package does not use it: when a later Ray changes
it, a test below fails and the choice is made again.

One fit of 4 workers (2 per node, each a replica group of its own, as Ray makes them) on a
cluster of its own, a ``TorchConfig`` whose backend declares replica groups and does nothing:

- every worker's context says local rank 0 of a local world of 1 (Ray counts ranks per node and
  replica group), where the same workers without replica groups are local ranks 0 and 1 of 2;
- a worker killed with SIGKILL is replaced alone (one new process, same rank and node) while
  the others keep running: what recovery would want;
- the other node removed (its two workers dead at once): the run fails with Ray's controller
  error within seconds, though ``FailureConfig(max_failures=3)`` has failures left. Ray
  replaces the failed groups one by one and, for the first, drains the result queues of the
  others, the second dead one among them (``_replace_replica_group_impl``'s
  ``clear_result_queue``). Today's whole-group restart survives the same loss
  (``test_memory_tier_ray.py``), so replica groups would make a lost node fatal.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import connected, fit_in_background, new_cluster

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.timeout(400)]


def _sleeper(config):
    import ray
    import ray.train

    ctx = ray.train.get_context()
    rec = {"rank": ctx.get_world_rank(), "local": ctx.get_local_rank(),
           "local_world": ctx.get_local_world_size(), "pid": os.getpid(), "t": time.time(),
           "node": ray.get_runtime_context().get_node_id()}
    with open(os.path.join(config["out"], f"{rec['rank']}-{rec['pid']}.json"), "w") as f:
        json.dump(rec, f)
    time.sleep(config["sleep_s"])


def _records(out: str) -> list[dict]:
    return [json.load(open(os.path.join(out, n))) for n in os.listdir(out)]


def _wait(out: str, count: int, outcome: dict, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(_records(out)) < count:
        assert "error" not in outcome and time.monotonic() < deadline, (outcome, _records(out))
        time.sleep(0.2)
    return _records(out)


def test_replica_groups_replace_a_killed_worker_alone_but_a_lost_node_fails_the_run(tmp_path):
    import ray.train
    from ray.train.backend import Backend
    from ray.train.torch import TorchConfig, TorchTrainer

    class ReplicaBackend(Backend):
        has_replica_groups = True

    class ReplicaConfig(TorchConfig):
        @property
        def backend_cls(self):
            return ReplicaBackend

    cluster = new_cluster(nodes=2, cpus_per_node=2)
    out = tmp_path / "records"
    out.mkdir()
    try:
        with connected(cluster):
            trainer = TorchTrainer(
                _sleeper, train_loop_config={"out": str(out), "sleep_s": 120},
                torch_config=ReplicaConfig(),
                scaling_config=ray.train.ScalingConfig(num_workers=4,
                                                       resources_per_worker={"slot": 1}),
                run_config=ray.train.RunConfig(
                    storage_path=str(tmp_path / "storage"),
                    failure_config=ray.train.FailureConfig(max_failures=3)))

            thread, outcome = fit_in_background(trainer)
            first = _wait(str(out), 4, outcome)
            assert len({r["node"] for r in first}) == 2
            # Every worker its own replica group: Ray's local ranks are per group, all 0 of 1.
            assert {(r["local"], r["local_world"]) for r in first} == {(0, 1)}, first
            head = cluster.head_node.node_id
            victim = next(r for r in first if r["node"] == head)
            os.kill(victim["pid"], signal.SIGKILL)
            after = _wait(str(out), 5, outcome)
            [new] = [r for r in after if r["pid"] not in {f["pid"] for f in first}]
            assert (new["rank"], new["node"]) == (victim["rank"], victim["node"]), new
            other = next(n for n in cluster.worker_nodes
                         if n.node_id in {r["node"] for r in first} - {head})
            removed = time.monotonic()
            cluster.remove_node(other)
            thread.join(90)
            seconds = time.monotonic() - removed
            assert not thread.is_alive(), "the fit neither failed nor restarted in 90 s"
            error = outcome.get("error")
            assert error is not None and "controller error" in str(error), outcome
            assert "died" in str(error) and seconds < 60, (seconds, error)
            assert len(_records(str(out))) == 5, "no worker was started after the node loss"
    finally:
        cluster.shutdown()
