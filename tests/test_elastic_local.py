"""Elastic runs without Ray: every worker-group start planned afresh for the group Ray gives,
ranges checked in the driver, and the data order kept across world sizes."""

from __future__ import annotations

import pytest

from ray_train_xla import (
    TorchNeuronConfig,
    TorchTPUConfig,
    TorchXLAConfig,
    XLAConfigError,
    check_scaling_config,
)
from ray_train_xla.driver.backend import plan_workers
from ray_train_xla.planning.contract import DEVMODE_VAR, WorkerContext
from ray_train_xla.planning.topology import WorkerFacts

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13


def group(workers_per_node, resource=None):
    """One WorkerFacts per worker of a group Ray started: node n at 10.0.0.<n+1>."""
    facts = []
    for n, count in enumerate(workers_per_node):
        for local in range(count):
            ids = {resource: (str(local),)} if resource else {}
            facts.append(WorkerFacts(node_id=f"node{n}", node_ip=f"10.0.0.{n + 1}",
                                     pid=1000 * n + local, accelerator_ids=ids))
    return facts


class Ports:
    """reserve_ports on the worker that serves the rendezvous (rank 0's host), as the backend
    calls it (once per start)."""

    def __init__(self):
        self.next, self.calls = 40000, 0

    def __call__(self, worker, count):
        self.calls += 1
        taken = list(range(self.next, self.next + count))
        self.next += count
        return taken


@pytest.mark.parametrize("config,resource", [
    (TorchXLAConfig(device="cpu"), None),
    (TorchXLAConfig(device="neuron"), "neuron_cores"),
    (TorchNeuronConfig(device="neuron"), "neuron_cores"),
], ids=["xla-cpu", "xla-neuron", "native-neuron"])
def test_every_group_start_is_planned_afresh(config, resource):
    # An elastic run: 4 workers on 2 nodes, a node leaves (2 on the other node, which now holds
    # rank 0), one worker, then 4 again. Nothing is carried from one start to the next.
    ports = Ports()
    starts = [[2, 2], [2], [1], [2, 2]]
    seen_run_ids, seen_ports = set(), set()
    for start, shape in enumerate(starts):
        facts = group(shape, resource)
        if start == 1:  # the group of two runs on the node that was node 1
            facts = [WorkerFacts(node_id="node1", node_ip="10.0.0.2", pid=5000 + i,
                                 accelerator_ids=f.accelerator_ids) for i, f in enumerate(facts)]
        plans = plan_workers(facts, config, ports)
        assert ports.calls == start + 1  # ports taken again at every start
        ctxs = [WorkerContext.from_env(p.env) for p in plans]
        world = sum(shape)
        assert [c.rank for c in ctxs] == list(range(world))
        assert {c.world_size for c in ctxs} == {world}
        assert {p.env["GROUP_WORLD_SIZE"] for p in plans} == {str(len(shape))}
        assert {c.master_addr for c in ctxs} == {facts[0].node_ip}
        run_ids = {c.run_id for c in ctxs}
        assert len(run_ids) == 1 and not run_ids & seen_run_ids
        seen_run_ids |= run_ids
        used = {c.master_port for c in ctxs} | {p.env.get("NEURON_RT_ROOT_COMM_ID") for p in plans}
        used.discard(None)
        assert not used & seen_ports
        seen_ports |= used
        if config.device == "cpu":  # the development mode's world: several CPU workers only
            assert {p.env.get(DEVMODE_VAR) for p in plans} == ({"1"} if world > 1 else {None})
        if resource:
            assert [p.env["NEURON_RT_VISIBLE_CORES"] for p in plans][:1] != [""]
            if "NEURON_PJRT_WORLD_SIZE" in plans[0].env:
                assert {p.env["NEURON_PJRT_WORLD_SIZE"] for p in plans} == {str(world)}


def test_spmd_group_with_two_workers_on_a_node_is_refused_at_its_start():
    # Neuron SPMD is one worker per node: a resize that puts two on one node is refused before
    # any worker is set up (the plan is made before the environment is applied).
    with pytest.raises(XLAConfigError, match="one worker per node"):
        plan_workers(group([2], "neuron_cores"), TorchXLAConfig(device="neuron", spmd=True),
                     Ports())


def test_scaling_ranges_are_checked_before_fit(monkeypatch):
    from ray.air.config import ScalingConfig as V1ScalingConfig
    from ray.train.v2.api.config import ScalingConfig

    assert check_scaling_config(ScalingConfig(num_workers=(2, 4))) == (2, 4)
    assert check_scaling_config(ScalingConfig(num_workers=3), TorchXLAConfig()) == (3, 3)
    # Ray Train V1 has no elastic training: V1's ScalingConfig takes the tuple and its fit()
    # fails with "'<=' not supported between instances of 'tuple' and 'int'".
    with pytest.raises(XLAConfigError, match=r"ScalingConfig.num_workers=\(2, 4\).*Ray Train V2"):
        check_scaling_config(V1ScalingConfig(num_workers=(2, 4)), TorchXLAConfig())
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "0")
    with pytest.raises(XLAConfigError, match="RAY_TRAIN_V2_ENABLED=0"):
        check_scaling_config(ScalingConfig(num_workers=(2, 4)), TorchNeuronConfig())
    monkeypatch.delenv("RAY_TRAIN_V2_ENABLED")
    # TPU: one whole slice (4 hosts of a v4 2x2x4); more is multislice.
    tpu = dict(use_tpu=True, topology="2x2x4", accelerator_type="TPU-V4")
    assert check_scaling_config(ScalingConfig(num_workers=(4, 4), **tpu),
                                TorchXLAConfig(spmd=True)) == (4, 4)
    with pytest.raises(XLAConfigError, match=r"at most 4 workers \(one TPU slice"):
        check_scaling_config(ScalingConfig(num_workers=(4, 8), **tpu), TorchXLAConfig(spmd=True))
    # TorchTPU runs multislice: one slice to two (Ray's ScalingConfig itself refuses a range
    # whose ends are not whole slices).
    assert check_scaling_config(ScalingConfig(num_workers=(4, 8), **tpu),
                                TorchTPUConfig()) == (4, 8)
    with pytest.raises(ValueError, match=r"must be a multiple of 4"):
        ScalingConfig(num_workers=(2, 8), **tpu)
    # SPMD on the CPU is one worker (its mesh is that worker's devices): it cannot grow.
    spmd_cpu = TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=4)
    assert check_scaling_config(ScalingConfig(num_workers=(1, 1)), spmd_cpu) == (1, 1)
    with pytest.raises(XLAConfigError, match=r"num_workers=\(1, 2\).*SPMD on the CPU is one worker"):
        check_scaling_config(ScalingConfig(num_workers=(1, 2)), spmd_cpu)
    # TPU v7x (2 devices per chip): one worker per device needs Ray counting devices; slices
    # are then counted in devices (2x2x4: 16 chips, 32 workers), else in chips (SPMD: hosts).
    v7x = dict(use_tpu=True, topology="2x2x4", accelerator_type="TPU-V7X")
    one = {"TPU": 1}
    monkeypatch.delenv("RAY_TPU_RESOURCE_PER_CHIP", raising=False)
    with pytest.raises(XLAConfigError, match=r"Ray counts TPU per chip here.*"
                                             r"RAY_TPU_RESOURCE_PER_CHIP=2 in the driver"):
        check_scaling_config(ScalingConfig(num_workers=16, resources_per_worker=one, **v7x),
                             TorchTPUConfig())
    assert check_scaling_config(ScalingConfig(num_workers=(4, 4), **v7x),
                                TorchXLAConfig(spmd=True)) == (4, 4)
    monkeypatch.setenv("RAY_TPU_RESOURCE_PER_CHIP", "2")
    assert check_scaling_config(ScalingConfig(num_workers=(32, 64), resources_per_worker=one,
                                              **v7x), TorchTPUConfig()) == (32, 64)
    with pytest.raises(XLAConfigError, match=r"at most 32 workers .*counted in devices"):
        check_scaling_config(ScalingConfig(num_workers=(32, 64), resources_per_worker=one,
                                           **v7x), TorchXLAConfig())
    with pytest.raises(XLAConfigError, match=r"\{'TPU': 1\} with TorchTPUConfig.*got 8"):
        check_scaling_config(ScalingConfig(num_workers=4, **v7x), TorchTPUConfig())
    with pytest.raises(ValueError, match=r"must be a multiple of 32"):  # part of a slice
        ScalingConfig(num_workers=(16, 32), resources_per_worker=one, **v7x)


# ---- the same global batches on every world size ---------------------------------------------

ROWS = 22  # not a multiple of the global batch: the last global batch is short
GLOBAL = 4


def loaders(world, ragged="drop", state=None, global_batch=GLOBAL, **kwargs):
    """Every worker's loader in a world of ``world`` (rank order), resumed at ``state``."""
    import os

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ray_train_xla as rtx
    from ray_train_xla.planning.contract import reload

    out = []
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    try:
        for r in range(world):
            os.environ.update(RANK=str(r), WORLD_SIZE=str(world))
            reload()
            loader = rtx.prepare_data_loader(
                DataLoader(TensorDataset(torch.arange(float(ROWS))), batch_size=3, shuffle=True),
                ragged=ragged, seed=7, to_device=False, global_batch_size=global_batch, **kwargs)
            if state is not None:
                loader.load_state_dict(state)
            out.append(loader)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reload()
    return out


def steps(workers, count, ragged="drop"):
    """``count`` steps of every worker (across epochs): per step, the global batch as the
    workers' rows in rank order (and the masks in pad mode)."""
    iters = [iter(w) for w in workers]
    taken = []
    while len(taken) < count:
        batches = [next(it, None) for it in iters]
        if batches[0] is None:  # the epoch ended on every worker alike
            assert all(b is None for b in batches)
            iters = [iter(w) for w in workers]
            continue
        if ragged == "pad":
            taken.append(([float(v) for (b,), _ in batches for v in b],
                          [float(m) for _, mask in batches for m in mask]))
        else:
            taken.append([float(v) for (b,) in batches for v in b])
    return taken


@pytest.mark.parametrize("ragged", ["drop", "pad"])
def test_a_resized_run_sees_the_fixed_size_runs_global_batches(ragged):
    # Fixed size: one worker through 3 epochs. Elastic: 4 workers, 2 (after a restart from the
    # position saved at step 3), 1, then 4 again, each resumed from the state the previous group
    # saved. The steps are the same global batches, rows in the same order.
    per_epoch = ROWS // GLOBAL + (ragged == "pad")
    total = 3 * per_epoch
    fixed = steps(loaders(1, ragged), total, ragged)
    elastic, state = [], None
    for world, count in ((4, 3), (2, 5), (1, 2), (4, total - 10)):
        group = loaders(world, ragged, state)
        elastic += steps(group, count, ragged)
        states = [w.state_dict() for w in group]
        assert all(s == states[0] for s in states)  # every worker agrees on the position
        state = states[0]
    assert elastic == fixed
    # No sample skipped or repeated: every epoch is a permutation of the rows (pad mode: the
    # real rows, by their masks; drop mode: all but the short tail).
    for e in range(3):
        epoch = fixed[e * per_epoch:(e + 1) * per_epoch]
        if ragged == "pad":
            real = [v for rows, mask in epoch for v, m in zip(rows, mask) if m == 1.0]
            assert sorted(real) == [float(i) for i in range(ROWS)]
        else:
            seen = [v for rows in epoch for v in rows]
            assert len(seen) == len(set(seen)) == ROWS - ROWS % GLOBAL
    assert fixed[:per_epoch] != fixed[per_epoch:2 * per_epoch]  # reshuffled every epoch
    assert state == {"epoch": 3, "sample": 0, "global_batch_size": GLOBAL}


def test_the_position_is_saved_and_checked():
    (worker,) = loaders(1)
    it = iter(worker)
    next(it), next(it)
    assert worker.state_dict() == {"epoch": 0, "sample": 8, "global_batch_size": 4}
    assert len(loaders(2, state=worker.state_dict())[0]) == 3  # 5 global batches, 2 done
    with pytest.raises(ValueError, match="saved with global_batch_size=4, this loader has 8"):
        loaders(2, state=worker.state_dict(), global_batch=8)
    with pytest.raises(ValueError, match="sample=6 is not valid"):
        loaders(1, state={"epoch": 0, "sample": 6, "global_batch_size": 4})


def test_the_position_follows_iterations_and_set_epoch():
    def rows(batch):
        return [float(v) for v in batch[0]]

    def batch_of(epoch, index):
        (fresh,) = loaders(1)
        fresh.set_epoch(epoch)
        it = iter(fresh)
        for _ in range(index):
            next(it)
        return rows(next(it))

    (worker,) = loaders(1)
    assert worker.epoch == 0
    assert worker.state_dict() == {"epoch": 0, "sample": 0, "global_batch_size": 4}
    next(iter(worker))
    assert worker.epoch == 1  # the next iter() is epoch 1 ...
    assert worker.state_dict() == {"epoch": 0, "sample": 4, "global_batch_size": 4}
    # ... from its start, even though epoch 0 was left after one batch.
    assert rows(next(iter(worker))) == batch_of(1, 0)
    assert worker.state_dict() == {"epoch": 1, "sample": 4, "global_batch_size": 4}
    worker.set_epoch(5)
    assert worker.state_dict() == {"epoch": 5, "sample": 0, "global_batch_size": 4}
    # A loaded position keeps its sample through set_epoch until it is iterated.
    (resumed,) = loaders(1, state={"epoch": 0, "sample": 8, "global_batch_size": 4})
    resumed.set_epoch(2)
    assert resumed.epoch == 2 and len(resumed) == 3
    assert resumed.state_dict() == {"epoch": 2, "sample": 8, "global_batch_size": 4}
    assert rows(next(iter(resumed))) == batch_of(2, 2)
    assert resumed.state_dict() == {"epoch": 2, "sample": 12, "global_batch_size": 4}
    resumed.set_epoch(3)
    assert resumed.state_dict() == {"epoch": 3, "sample": 0, "global_batch_size": 4}
    assert [rows(b) for b in resumed] == [batch_of(3, i) for i in range(ROWS // GLOBAL)]
    assert resumed.state_dict() == {"epoch": 4, "sample": 0, "global_batch_size": 4}


def test_world_sizes_that_do_not_divide_the_global_batch_are_refused():
    with pytest.raises(ValueError, match=r"for 3 workers.*one of \[1, 2, 4\]"):
        loaders(3)
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ray_train_xla as rtx

    with pytest.raises(ValueError, match="needs prepare_data_loader\\(global_batch_size"):
        rtx.prepare_data_loader(DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2),
                                to_device=False).state_dict()
