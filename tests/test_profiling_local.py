"""Profile windows without Ray: the window arithmetic, the request/accept protocol on a local
run directory and a store (two ranks in one process), exact steps, the torch.profiler trace,
the ``profile`` command and the planned ``profile_steps``. The whole path on 2 Ray workers is in
``test_observe_ray.py``."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ray_train_xla.toolkit import steps
from ray_train_xla.toolkit.observability import profiling
from ray_train_xla.toolkit.observability.profiling import Profiles, RequestWatcher, Window
from ray_train_xla.toolkit.run_storage import RunStorage
from ray_train_xla.toolkit.runtime import runtime
from ray_train_xla.tools.cli import main as cli_main


@pytest.fixture(autouse=True)
def fresh_steps():
    steps.reset()
    yield
    steps.reset()
    profiling.uninstall()


class FakeTracer:
    """Records what the profiler was asked to do."""

    name = "fake"
    log: list = []

    def start(self, local_dir, first_step):
        self.log.append(("start", first_step, threading.current_thread().name))

    def step(self, next_step):
        self.log.append(("step", next_step))

    def stop(self, local_dir, rank):
        self.log.append(("stop", rank))
        with open(f"{local_dir}/trace-{rank}.json", "w") as f:
            json.dump({"rank": rank}, f)


def test_window_arithmetic_and_validation():
    w = Window(10, 3)
    assert (w.begin_after, w.end_after, list(w.steps)) == (9, 12, [10, 11, 12])
    assert w.overlaps(Window(12, 5)) and not w.overlaps(Window(13, 1))
    for bad in ((0, 1), (1, 0), (1.5, 2), (True, 2), (3, None)):
        with pytest.raises(ValueError, match="expected an int >= 1"):
            Window(*bad)
    # a request's first step: at least MIN_MARGIN_STEPS ahead, and MARGIN_S seconds of steps
    assert profiling.margin_steps(0.0) == profiling.MIN_MARGIN_STEPS
    assert profiling.margin_steps(100.0) == 100 * profiling.MARGIN_S
    assert profiling.accept("r", 4, steps_done=50, steps_per_s=100.0) == Window(251, 4, "r")


def run_steps(n: int) -> None:
    for _ in range(n):
        steps.step_done()


def test_exact_steps_and_upload(tmp_path):
    storage = RunStorage.at(str(tmp_path / "run"))
    FakeTracer.log = []
    prof = Profiles(rank=1, world=2, storage=storage, tracer_factory=FakeTracer)
    steps.add_step_hook(prof.on_step)
    prof.add(Window(1, 2, "config"))  # starts at once: step 1 is next
    prof.add(Window(5, 3, "function"))
    with pytest.raises(ValueError, match="overlaps"):
        prof.add(Window(6, 1))
    run_steps(9)
    prof.flush(10)
    assert [e[:2] for e in FakeTracer.log] == [
        ("start", 1), ("step", 2), ("stop", 1),
        ("start", 5), ("step", 6), ("step", 7), ("stop", 1)]
    for start, count in ((1, 2), (5, 3)):
        body = json.loads(storage.read_bytes(f"profiles/{start}/rank-1/profile.json"))
        assert body["steps"] == list(range(start, start + count)) and body["profiler"] == "fake"
        assert body["files"] == ["trace-1.json"]
        assert json.loads(storage.read_bytes(f"profiles/{start}/rank-1/trace-1.json")) == {"rank": 1}
    # a window already past is recorded as missed, with a note in the storage
    prof.add(Window(3, 1))
    assert Window(3, 1) in prof.missed
    assert json.loads(storage.read_bytes("profiles/3/rank-1/missed.json"))["at_step"] == 9


def test_a_config_window_of_step_one_starts_with_the_training_function(tmp_path):
    FakeTracer.log = []
    prof = Profiles(rank=0, world=1, storage=RunStorage.at(str(tmp_path)),
                    tracer_factory=FakeTracer)
    runtime().profiles = prof  # as install() leaves it, as the training function starts
    steps.add_step_hook(prof.on_step)
    prof.add(Window(1, 1, "config"), on_training_thread=False)
    assert FakeTracer.log == []  # not on the thread that installed it
    profiling.training_starts()  # the training function's thread, before step 1
    profiling.training_starts()  # (again: the running window goes on)
    run_steps(2)
    assert [e[:2] for e in FakeTracer.log] == [("start", 1), ("stop", 0)]
    prof.flush(10)


def test_request_from_outside_reaches_every_rank_at_the_same_step(tmp_path):
    import torch.distributed as dist

    storage = RunStorage.at(str(tmp_path / "run"))
    store = dist.HashStore()
    FakeTracer.log = []
    ranks = [Profiles(rank=r, world=2, storage=storage, tracer_factory=FakeTracer)
             for r in range(2)]
    for p in ranks:
        steps.add_step_hook(p.on_step)
    watchers = [RequestWatcher(p, lambda: store, "run/profile", poll_s=0.05, wait_s=0.2).start()
                for p in ranks]
    try:
        run_steps(3)
        assert cli_main(["profile", str(tmp_path / "run"), "--steps", "2"]) == 0
        deadline = time.monotonic() + 10
        while not all(p.windows() for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.02)
        [w0], [w1] = ranks[0].windows(), ranks[1].windows()
        assert w0 == w1 and w0.count == 2 and w0.start >= 3 + profiling.MIN_MARGIN_STEPS + 1
        accepted = json.loads(storage.read_bytes(f"profiles/accepted/{w0.source}.json"))
        assert accepted["start"] == w0.start and accepted["world_size"] == 2
        assert profiling.pending_requests(storage) == []  # accepted once, never again
        run_steps(w0.end_after + 1 - 3)
        for p in ranks:
            p.flush(10)
        # both ranks started on the training thread (here: this one) at the same step
        starts = [e for e in FakeTracer.log if e[0] == "start"]
        assert [e[1] for e in starts] == [w0.start, w0.start]
        assert {e[2] for e in starts} == {threading.current_thread().name}
        done = profiling.wait_for_profile(storage, w0.source, timeout_s=5)
        assert done["complete"] and done["ranks"] == {0: "written", 1: "written"}
    finally:
        for w in watchers:
            w.stop()


def test_torch_profiler_writes_a_chrome_trace_of_exactly_the_window(tmp_path):
    import torch

    storage = RunStorage.at(str(tmp_path / "run"))
    prof = Profiles(rank=0, world=1, storage=storage, tracer_factory=profiling.TorchTracer)
    steps.add_step_hook(prof.on_step)
    prof.add(Window(3, 2))
    x = torch.ones(8, 8)
    for _ in range(6):
        x = (x @ x).clamp(max=1.0)
        steps.step_done()
    prof.flush(30)
    trace = json.loads(storage.read_bytes("profiles/3/rank-0/rank-0.pt.trace.json"))
    marks = sorted(e["name"] for e in trace["traceEvents"]
                   if e.get("name", "").startswith("ProfilerStep#"))
    assert marks == ["ProfilerStep#3", "ProfilerStep#4"]
    assert any(e.get("name") == "aten::matmul" for e in trace["traceEvents"])


def test_profile_command_without_a_run_going(tmp_path, capsys):
    from ray_train_xla.tools.cli import main

    run = tmp_path / "run"
    assert main(["profile", str(run), "--steps", "3"]) == 0
    assert "profiles/requests" in capsys.readouterr().out
    [request] = profiling.pending_requests(RunStorage.at(str(run)))
    assert request["steps"] == 3
    assert main(["profile", str(run), "--steps", "2", "--wait", "0.2"]) == 1
    assert "not accepted by the run" in capsys.readouterr().err
    assert main(["profile", str(run), "--steps", "0"]) == 2


def test_profile_steps_in_the_config_reach_the_worker_context():
    # the options alone (what TorchXLAConfig/TorchNeuronConfig are, without Ray's side)
    from ray_train_xla.errors import XLAConfigError
    from ray_train_xla.planning.contract import PROFILE_STEPS_VAR, WorkerContext
    from ray_train_xla.planning.options import NeuronOptions as TorchNeuronConfig
    from ray_train_xla.planning.options import XLAOptions as TorchXLAConfig
    from ray_train_xla.planning.planner import Rendezvous, plan
    from ray_train_xla.planning.topology import Topology, described_facts

    facts = described_facts([2], 0)
    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=1, run_id="r")
    envs = [p.env for p in plan(Topology.from_facts(facts, "accelerator"),
                                TorchXLAConfig(device="cpu", profile_steps=(10, 3),
                                               compile_causes=True), rdzv, "cpu", facts)]
    assert {e[PROFILE_STEPS_VAR] for e in envs} == {"10,3"}
    assert WorkerContext.from_env(envs[1]).profile_steps == (10, 3)
    assert [e["PT_XLA_DEBUG_FILE"] for e in envs] == [
        "/tmp/ray_train_xla-r-rank0-compiles.txt", "/tmp/ray_train_xla-r-rank1-compiles.txt"]
    assert {e["PT_XLA_DEBUG_LEVEL"] for e in envs} == {"1"}
    plain = plan(Topology.from_facts(facts, "accelerator"), TorchXLAConfig(device="cpu"), rdzv,
                 "cpu", facts)[0].env
    assert PROFILE_STEPS_VAR not in plain and "PT_XLA_DEBUG_LEVEL" not in plain
    for bad in ((0, 3), (1,), "1,2", (1, 2.0)):
        with pytest.raises(XLAConfigError, match="profile_steps"):
            TorchXLAConfig(device="cpu", profile_steps=bad)
    with pytest.raises(XLAConfigError, match="compile_causes"):
        TorchXLAConfig(device="cpu", compile_causes=True, env={"PT_XLA_DEBUG_LEVEL": "2"})
    assert TorchXLAConfig(device="cpu", env={"PT_XLA_DEBUG_LEVEL": "2"}).env  # without: allowed
    assert TorchNeuronConfig(device="cpu", profile_steps=(2, 1)).profile_steps == (2, 1)


class RefusingStorage:
    """A run's storage that refuses every write (an object store that is down)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.path = inner.path

    def write_bytes(self, path, data) -> None:
        raise OSError("storage unavailable (test)")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_upload_that_fails_is_warned_and_the_steps_go_on(tmp_path, caplog):
    """A profile never fails the run: a trace the storage refuses is warned about, naming the
    steps, the training steps go on, and nothing claims a profile that is not there."""
    inner = RunStorage.at(str(tmp_path / "run"))
    FakeTracer.log = []
    prof = Profiles(rank=0, world=1, storage=RefusingStorage(inner), tracer_factory=FakeTracer)
    steps.add_step_hook(prof.on_step)
    prof.add(Window(2, 2, "function"))
    run_steps(6)
    prof.flush(10)
    assert steps.steps_done() == 6
    assert [e[:2] for e in FakeTracer.log] == [("start", 2), ("step", 3), ("stop", 0)]
    assert any("could not write the profile of steps 2-3" in r.getMessage() for r in caplog.records)
    assert inner.read_bytes("profiles/2/rank-0/profile.json") is None
