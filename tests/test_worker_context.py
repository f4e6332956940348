"""WorkerContext: the planned environment as a worker reads it (typed, read once per plan)."""

import pytest

from ray_train_xla.planning import Rendezvous, Topology, XLAOptions, plan
from ray_train_xla.planning.contract import WorkerContext, reload, worker_context

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13


def test_a_planned_environment_reads_back_as_the_options_and_places():
    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id="run-a")
    env = plan(Topology.uniform([2, 2]), XLAOptions(device="cpu", timeout_s=2.5), rdzv, "cpu")[3].env
    ctx = WorkerContext.from_env(env)
    assert (ctx.rank, ctx.local_rank, ctx.node_rank, ctx.world_size, ctx.local_world_size) == (
        3, 1, 1, 4, 2)
    assert (ctx.device, ctx.runtime, ctx.timeout_s, ctx.devmode, ctx.spmd) == (
        "cpu", "pjrt", 2.5, True, False)
    assert (ctx.master_addr, ctx.master_port, ctx.run_id) == ("10.0.0.1", 29500, "run-a")
    assert ctx.planned and not ctx.native and not ctx.spmd_global


def test_outside_a_planned_worker_it_is_a_single_worker_run():
    ctx = WorkerContext.from_env({})
    assert (ctx.rank, ctx.world_size, ctx.planned, ctx.timeout_s) == (0, 1, False, 1800.0)


def test_a_new_plan_is_read_again_and_never_served_stale(monkeypatch):
    # A restarted or resized worker group gives the process a new run id, rank or world size.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "first")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RAY_TRAIN_XLA_TIMEOUT_S", "10")
    reload()
    assert (worker_context().rank, worker_context().timeout_s) == (1, 10.0)
    monkeypatch.setenv("RAY_TRAIN_XLA_TIMEOUT_S", "20")  # same plan: the value read once stays
    assert worker_context().timeout_s == 10.0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "second")  # a new plan: read again
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (worker_context().world_size, worker_context().timeout_s) == (2, 20.0)
    monkeypatch.setenv("RAY_TRAIN_XLA_TIMEOUT_S", "30")
    assert reload().timeout_s == 30.0  # what apply_env calls after setting a plan


@pytest.fixture(autouse=True)
def _fresh_context():
    yield
    reload()


@pytest.mark.parametrize("device,workers,host", [("cpu", [2], True), ("cpu", [1], False)])
def test_collectives_cross_the_host_exactly_on_several_cpu_workers(monkeypatch, device, workers,
                                                                   host):
    # The development mode's group (xla_host): the toolkit reduces gradients in host buckets
    # through it; one worker reduces nothing. Read from each planned environment as a worker.
    from ray_train_xla.toolkit.ranks import uses_host_collectives

    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=29500, run_id=f"run-{sum(workers)}")
    for row in plan(Topology.uniform(workers), XLAOptions(device=device), rdzv, device):
        for key, value in row.env.items():
            monkeypatch.setenv(key, value)
        reload()
        assert uses_host_collectives() is host
    reload()
