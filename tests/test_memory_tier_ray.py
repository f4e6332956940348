"""The memory tier through real Ray Train on a cluster of three nodes on this machine (a head
and two worker nodes with 2 worker slots each): FSDP2 on 4 workers (TorchNeuronConfig's CPU
twin), ``memory_every=1``, a run's storage whose reads are counted (``counting_fs.py``), and one
elastic ``fit()`` (2 to 4 workers, ``FailureConfig(max_failures=3)``) through four worker groups:

- **a0**: trains, saves to storage at step 2, keeps every step in memory; rank 3 crashes at step 4;
- **a1** (a worker failed; 4 workers): restores from memory, reading nothing from storage, bit
  for bit the state of the step it restored; trains to step 6, saves it to storage and to
  memory; then the test removes the node of rank 3 (its memory store goes with it);
- **a2** (a node lost; elastic: 2 workers on the node left): restores from memory, the lost
  node's shards from its peer's copy, resharded from 4 workers to 2; then the test kills every
  memory store (both copies gone) and rank 0 fails;
- **a3**: restores from storage (the step-6 checkpoint), and the log says why.

`make test-e2e` (a cluster of its own and four worker groups); `make test` has
``test_memory_tier_local.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from unittest import mock

import pytest

from conftest import fit_in_background, is_train_v2

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.native, pytest.mark.timeout(900),
              pytest.mark.skipif(not is_train_v2(), reason="elastic runs need Ray Train V2")]

SAVE_AT, CRASH_AT, REMOVE_AT, LAST = 2, 4, 6, 8


def _phase(out: str) -> str:
    if os.path.exists(os.path.join(out, "killed.json")):
        return "a3"
    if os.path.exists(os.path.join(out, "removed.json")):
        return "a2"
    if os.path.exists(os.path.join(out, "a0-crash.json")):
        return "a1"
    return "a0"


def _put(out: str, name: str, record: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, f"{name}.json"))


def train_tiered(config):
    import fsdp2_worker as w
    import ray
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import memory_tier

    out = config["out_dir"]
    phase = _phase(out)
    rank, world = rtx.rank(), rtx.world_size()
    model = rtx.prepare_sharded_model(w.make_lm(), auto_wrap_policy={w.block_class()})
    opt = w.optimizer(model)
    t0 = time.time()
    extra = rtx.load_checkpoint(model, opt)
    tier = memory_tier()
    start = int(extra["step"]) if extra else 0
    record = {"phase": phase, "rank": rank, "world": world, "start": start, "t_load": t0,
              "restored": tier.restored, "node": ray.get_runtime_context().get_node_id()}
    if extra:  # bit for bit the state the first groups had at that step
        whole = w.named_state(model, opt)
        saved = torch.load(os.path.join(out, f"state{start}.pt"), weights_only=False)
        record["exact"] = w.exact(whole, saved)
    _put(out, f"{phase}-rank{rank}", record)
    if phase == "a2":  # the test kills every memory store, then this group fails
        if rank == 0:
            _put(out, "ready_kill", {})
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(out, "killed.json")) and time.time() < deadline:
                time.sleep(0.2)
            raise RuntimeError("injected failure after the memory stores were killed")
        time.sleep(120)
        return
    step = start
    for step in range(start + 1, LAST + 1):
        opt.zero_grad()
        w.loss_of(model, w.rows(step, rank, world)).backward()
        rtx.optimizer_step(opt)
        whole = w.named_state(model, opt)  # every rank (collective); rank 0 keeps it
        if rank == 0 and phase in ("a0", "a1"):
            torch.save(whole, os.path.join(out, f"state{step}.pt"))
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        if phase in ("a0", "a1") and step in (SAVE_AT, REMOVE_AT):
            rtx.save_checkpoint(state, {"step": step}, wait=True)
        if phase in ("a0", "a1"):
            # Every step kept (a keep while the previous one is still going keeps nothing:
            # here each waits for the one before, so the steps the test expects are there).
            tier.wait()
            assert rtx.keep_in_memory(state, step) is True
        if phase == "a0" and step == CRASH_AT and rank == 3:
            _put(out, "a0-crash", {"t": time.time(), "kept": tier.kept,
                                   "by_writer": tier.by_writer, "by_rank": tier.by_rank})
            raise RuntimeError("injected worker failure")
        if phase == "a1" and step == REMOVE_AT:
            tier.wait()  # this step is in memory on every rank's node and its peer
            rtx.rendezvous("kept")
            time.sleep(2)  # Ray's controller takes the step-6 report at its next poll (0.5 s)
            if rank == 3:
                _put(out, "ready_remove", {"node": record["node"], "kept": tier.kept,
                                           "by_writer": tier.by_writer,
                                           "by_rank": tier.by_rank})
            time.sleep(120)  # the test removes rank 3's node; Ray restarts the group
            return
    _put(out, f"{phase}-end-rank{rank}", {"step": step})


@pytest.fixture(scope="module")
def tiered_run():
    import ray
    from counting_fs import counting_filesystem
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchNeuronConfig
    from ray_train_xla.toolkit.checkpoint.memory import NAMESPACE, STORE_PREFIX

    if ray.is_initialized():
        ray.shutdown()
    # After a node is removed, Ray Train first tries the group of 4 again (the node's resources
    # linger) and waits RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S for it (60 s by default).
    env = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}
    with mock.patch.dict(os.environ, env):
        cluster = Cluster()
        cluster.add_node(num_cpus=2, include_dashboard=False)  # the head: the driver, Ray Train
        nodes = [cluster.add_node(num_cpus=2, resources={"mslot": 2}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out = tempfile.mkdtemp(prefix="rtx-test-memory-")
    log = os.path.join(out, "..", os.path.basename(out) + "-reads.log")
    storage = tempfile.mkdtemp(prefix="rtx-test-results-")
    trainer = TorchTrainer(
        train_tiered, train_loop_config={"out_dir": out},
        torch_config=TorchNeuronConfig(device="cpu", timeout_s=60, memory_every=1),
        scaling_config=ScalingConfig(num_workers=(2, 4),
                                     resources_per_worker={"CPU": 0.5, "mslot": 1},
                                     elastic_resize_monitor_interval_s=1),
        run_config=RunConfig(storage_path=storage, name="tiered",
                             storage_filesystem=counting_filesystem(log),
                             failure_config=FailureConfig(max_failures=3)))
    thread, outcome = fit_in_background(trainer)
    events = {}
    try:
        _wait(out, "ready_remove", outcome)
        node_id = json.load(open(os.path.join(out, "ready_remove.json")))["node"]
        removed = next(n for n in nodes if n.node_id == node_id)
        events["t_remove"] = time.time()
        cluster.remove_node(removed)
        _put(out, "removed", {"node": node_id})
        _wait(out, "ready_kill", outcome)
        stores = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(STORE_PREFIX)]
        for name in stores:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        events["killed"] = stores
        events["t_kill"] = time.time()
        _put(out, "killed", {})
        thread.join(300)
        records = {}
        for name in os.listdir(out):
            if name.endswith(".json"):
                records[name[:-5]] = json.load(open(os.path.join(out, name)))
        yield {"outcome": outcome, "records": records, "events": events, "log": log,
               "removed": node_id, "run_path": os.path.join(storage, "tiered")}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _wait(out: str, name: str, outcome: dict, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not os.path.exists(os.path.join(out, f"{name}.json")):
        assert "error" not in outcome, outcome["error"]
        assert time.time() < deadline, f"no {name} within {timeout_s} s"
        time.sleep(0.2)


def test_memory_tier_serves_worker_and_node_failures_and_storage_serves_when_both_copies_are_gone(
        tiered_run):
    from counting_fs import checkpoint_reads

    outcome, records, events = tiered_run["outcome"], tiered_run["records"], tiered_run["events"]
    assert "error" not in outcome, outcome.get("error")
    a1 = [records[f"a1-rank{r}"] for r in range(4)]
    a2 = [records[f"a2-rank{r}"] for r in range(2)]
    a3 = [records[f"a3-rank{r}"] for r in range(2)]
    # The generations restored below were written in place, rank by rank, from the first one
    # (each rank's own metadata, merged when read: resharding 4 -> 2 reads them too), with no
    # writer process.
    for name in ("a0-crash", "ready_remove"):
        rec = records[name]
        # (a generation in flight when the record was made may count as written, not kept)
        assert 0 < rec["kept"] <= rec["by_rank"] and rec["by_writer"] == 0, rec
    # a1: after a worker failure, from memory, bit for bit, same world size.
    for rec in a1:
        assert rec["world"] == 4 and rec["restored"] is not None, rec
        assert rec["restored"]["world"] == 4 and rec["start"] in (CRASH_AT - 1, CRASH_AT)
        assert rec["exact"] is True
        assert rec["restored"]["fetched_bytes"] > 0
    # a2: the node of rank 3 removed: 2 workers on the node left, from memory; rank 3's shards
    # came from the copy its peer (the node left) holds; resharded 4 -> 2, bit for bit.
    for rec in a2:
        assert rec["world"] == 2 and rec["node"] != tiered_run["removed"], rec
        assert rec["restored"] is not None and rec["restored"]["world"] == 4, rec
        assert rec["start"] == REMOVE_AT and rec["exact"] is True
        left = next(r["node"] for r in a2)
        assert [s.rsplit("-", 1)[1] for s in rec["restored"]["stores"]] == [left], rec
    # No restore so far read a checkpoint file from storage.
    reads = checkpoint_reads(tiered_run["log"])
    assert not [r for r in reads if r[0] < events["t_kill"]], reads
    # a3: every memory store gone: from storage (the step-6 checkpoint), read through it.
    for rec in a3:
        assert rec["restored"] is None and rec["start"] == REMOVE_AT and rec["exact"] is True, rec
    assert sum(size for t, size, _ in reads if t > events["t_kill"]) > 0
    assert records["a3-end-rank0"]["step"] == LAST
    # The goodput events say which tier served each group, and `ray-train-xla goodput` too.
    from ray_train_xla.toolkit.observability import goodput
    from ray_train_xla.tools.goodput import format_table

    result = goodput.goodput_of(tiered_run["run_path"])
    served = [a.restore["tier"] for a in result.attempts if a.restore]
    assert served[-3:] == ["memory", "memory", "storage"], served
    assert all(0 < a.restore["seconds"] < 30 for a in result.attempts if a.restore)
    assert "restored from memory in" in format_table(result)
    # The run's storage is a pyarrow filesystem that is not the local one (as S3 or GCS): the
    # storage checkpoints were written in place through it by every rank (DCP's .metadata.tmp,
    # renamed there; a copy uploaded by Ray would not have one).
    from counting_fs import checkpoint_writes

    written = [p for p in checkpoint_writes(tiered_run["log"]) if "/checkpoint_2" in p]
    assert any(p.endswith("/.metadata.tmp") for p in written), written
    assert any(p.endswith("/__1_0.distcp") for p in written), written
