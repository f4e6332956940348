"""The background reporter's guarantees, fast and without Ray: two ranks are two reporters in
this process that agree through a real ``TCPStore``; their report function behaves like Ray
Train's (every call is a barrier across the ranks, and a slow consumer takes one report at a
time). Ray runs of the same paths are in ``test_reporting_ray.py``."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ray_train_xla.errors import ReportError
from ray_train_xla.toolkit.reporting import COALESCED_KEY, Reporter

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeRay:
    """Ray Train's report path for ``world`` ranks: the k-th call of every rank meets at a
    barrier (like the synchronisation actor), then waits until the consumer took the previous
    report (a queue of one, drained every ``take_s``). Records what each rank reported."""

    def __init__(self, world: int, take_s: float = 0.0, fail_at: tuple[int, int] | None = None):
        self.world, self.take_s, self.fail_at = world, take_s, fail_at
        self.calls: dict[int, list[tuple[dict, bool]]] = {r: [] for r in range(world)}
        self._barrier = threading.Barrier(world, timeout=20)
        self._taken = threading.Lock()

    def fn(self, rank: int):
        def report(metrics: dict, directory: str | None) -> None:
            if self.fail_at == (rank, len(self.calls[rank])):
                raise OSError("storage is full")
            self._barrier.wait()
            with self._taken:  # one at a time, at the consumer's pace
                time.sleep(self.take_s)
            files = directory is not None
            self.calls[rank].append((dict(metrics), files))
        return report


def reporters(fake: FakeRay, max_in_flight: int = 2, timeout_s: float = 20.0):
    port = _free_port()
    stores = [dist.TCPStore("127.0.0.1", port, fake.world, r == 0, timedelta(seconds=20),
                            wait_for_workers=False) for r in range(fake.world)]
    return [Reporter(fake.fn(r), rank=r, world=fake.world, max_in_flight=max_in_flight,
                     timeout_s=timeout_s, store=stores[r], key_prefix="t")
            for r in range(fake.world)]


def writer(log: list, step: int):
    def write(directory: str, filesystem=None) -> dict:
        log.append(step)
        return {"files": [f"{step}.pt"], "bytes": step}
    return write


def run_ranks(fns):
    """Run one training function per rank in threads; re-raise the first error."""
    errors: list = []

    def wrap(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("take_s,paces", [(0.05, (0.0, 0.004)), (0.0, (0.0, 0.01)),
                                          (0.0, (0.01, 0.0))])
def test_checkpoints_in_order_none_lost_metrics_coalesced_same_sequence_on_every_rank(take_s, paces):
    """Ranks at different speeds (either one ahead), a slow or a fast consumer."""
    fake = FakeRay(world=2, take_s=take_s)
    reps = reporters(fake, max_in_flight=2)
    written = {0: [], 1: []}
    returned = {}

    def train(rank: int, pace: float):
        rep = reps[rank]
        for step in range(12):
            rep.metrics({"step": step})  # every step: far faster than the consumer
            time.sleep(pace)  # ranks at different speeds: their queues differ in time
            if step % 4 == 3:
                rep.checkpoint({"step": step}, writer(written[rank], step) if rank == 0 else None)
        returned[rank] = rep.checkpoint({"step": "final"}, writer(written[rank], 99)
                                        if rank == 0 else None, wait=True)
        rep.metrics({"step": "after"})
        rep.close()

    run_ranks([lambda: train(0, paces[0]), lambda: train(1, paces[1])])
    # the same sequence of calls on both ranks (Ray's barrier needs it), none lost
    assert len(fake.calls[0]) == len(fake.calls[1])
    ckpts = [m["step"] for m, files in fake.calls[0] if files]
    assert ckpts == [3, 7, 11, "final"], fake.calls[0]  # in order, every one
    assert written[0] == [3, 7, 11, 99]
    assert returned[0] == {"files": ["99.pt"], "bytes": 99} and returned[1] is None
    # rank 1's checkpoint reports (it writes no files) sit where rank 0's do
    at = [i for i, (_, files) in enumerate(fake.calls[0]) if files]
    assert [fake.calls[1][i][0]["step"] for i in at] == [3, 7, 11, "final"]
    # metrics-only calls: 12 + 1 of them, coalesced; rank 0's counts add up to every call, and
    # each coalesced report carries the last metrics of its calls (before the next checkpoint)
    metric_reports = [m for m, files in fake.calls[0] if not files]
    assert sum(m.get(COALESCED_KEY, 1) for m in metric_reports) == 13
    assert len(metric_reports) < 13 or take_s == 0
    assert metric_reports[-1] == {"step": "after"}
    order = [("C", m["step"]) if files else ("M", m["step"]) for m, files in fake.calls[0]]
    steps_seen = [s for _, s in order if isinstance(s, int)]
    assert steps_seen == sorted(steps_seen)  # metrics never overtake a checkpoint


def test_a_failed_write_is_raised_at_the_next_call_and_at_the_end():
    fake = FakeRay(world=1)
    (rep,) = reporters(fake)

    def failing(directory: str, filesystem) -> dict:
        raise OSError("disk full")

    rep.checkpoint({"step": 1}, failing)
    deadline = time.monotonic() + 10
    with pytest.raises(ReportError, match="disk full"):
        while time.monotonic() < deadline:  # the next call after the failure raises it
            rep.metrics({"step": 2})
            time.sleep(0.01)
    with pytest.raises(ReportError, match="disk full"):
        rep.close()
    assert fake.calls[0] == []  # nothing reported after (nor instead of) the failed one


def test_a_failed_report_on_one_rank_reaches_its_training_function():
    fake = FakeRay(world=2, fail_at=(1, 1))  # rank 1's second report fails
    reps = reporters(fake, timeout_s=3)
    seen = {}

    def train(rank: int):
        rep = reps[rank]
        try:
            for step in range(4):
                rep.checkpoint({"step": step}, None)
                time.sleep(0.05)
            rep.close(timeout_s=3)
        except ReportError as exc:
            seen[rank] = str(exc)

    run_ranks([lambda: train(0), lambda: train(1)])
    assert "storage is full" in seen[1]
    assert 0 in seen  # rank 0 is not left waiting: its end is bounded and says why


def test_backpressure_bounds_snapshots_in_flight_is_warned_once_and_times_out(caplog):
    fake = FakeRay(world=1, take_s=1.2)
    (rep,) = reporters(fake, max_in_flight=2, timeout_s=10)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="ray_train_xla.toolkit.reporting"):
        for step in range(5):
            rep.checkpoint({"step": step}, writer([], step))
            assert rep._checkpoints <= 2  # never more than max_in_flight held
    blocked = time.monotonic() - start
    assert blocked > 2  # the loop was backed off to the consumer's pace
    warned = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(warned) == 1 and "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" in warned[0], warned
    rep.close()
    assert [m["step"] for m, _ in fake.calls[0]] == [0, 1, 2, 3, 4]

    stuck = FakeRay(world=1, take_s=30)
    (rep,) = reporters(stuck, max_in_flight=1, timeout_s=1)
    rep.checkpoint({"step": 0}, None)
    with pytest.raises(ReportError, match="timeout_s=1"):
        for step in range(1, 3):
            rep.checkpoint({"step": step}, None)


def test_unequal_calls_across_ranks_are_an_error_not_a_hang():
    fake = FakeRay(world=2)
    reps = reporters(fake, timeout_s=2)
    seen = {}

    def train(rank: int):
        rep = reps[rank]
        try:
            rep.checkpoint({"step": 0}, None)
            if rank == 0:
                rep.checkpoint({"step": 1}, None)  # rank 1 never makes this one
            rep.close(timeout_s=4)
        except ReportError as exc:
            seen[rank] = str(exc)

    run_ranks([lambda: train(0), lambda: train(1)])
    assert seen, "neither rank noticed"


def test_a_rank_that_waits_for_its_last_checkpoint_while_rank_0_ends_gets_it(monkeypatch):
    """Both ranks save once with ``wait=True``; rank 0 ends its reports as soon as its save is
    reported, and rank 1's background thread follows that end before rank 1's training thread
    looks again (its wake-up delayed here): the save was reported, and rank 1 gets it."""
    from ray_train_xla.toolkit import reporting

    late_threads = set()  # rank 1's training thread

    class LateEvent(threading.Event):
        def wait(self, timeout=None):
            if super().wait(timeout):
                if threading.current_thread() in late_threads:
                    time.sleep(1.0)  # its background thread follows rank 0's end meanwhile
                return True
            return False

    original = reporting._Checkpoint.__init__

    def late(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.done = LateEvent()

    monkeypatch.setattr(reporting._Checkpoint, "__init__", late)
    fake = FakeRay(world=2)
    reps = reporters(fake)
    written = {}

    def train(rank: int):
        if rank == 1:
            late_threads.add(threading.current_thread())
        written[rank] = reps[rank].checkpoint({"step": 0}, writer([], 0), wait=True)
        if rank == 1:  # rank 0 ended its reports meanwhile, and this rank follows it
            assert not reps[1]._thread.is_alive()
        reps[rank].close(timeout_s=10)

    run_ranks([lambda: train(0), lambda: train(1)])
    assert written == {0: {"files": ["0.pt"], "bytes": 0}, 1: {"files": ["0.pt"], "bytes": 0}}


def test_a_long_run_leaves_no_decisions_in_the_store():
    """Every decision key rank 0 puts in the store is deleted once every other rank read it:
    hundreds of reports keep the store at a few keys during the run and none after it."""
    fake = FakeRay(world=3)
    reps = reporters(fake, timeout_s=20)
    store = reps[0]._store
    before = store.num_keys()
    most, running = [before], threading.Event()
    running.set()

    def watch():
        while running.is_set():
            most.append(store.num_keys())
            time.sleep(0.01)

    def train(rank: int):
        rep = reps[rank]
        for step in range(200):
            rep.checkpoint({"step": step}, None)  # each its own report: 200 decisions
            if step % 10 == 0:
                rep.metrics({"step": step})
        rep.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run_ranks([lambda r=r: train(r) for r in range(3)])
    finally:
        running.clear()
        watcher.join()
    assert len(fake.calls[0]) == len(fake.calls[2]) >= 200
    # At most the decision being read, its readers' count and the next one (and the
    # watcher's own samples: none of them can have seen hundreds).
    assert max(most) - before <= 4, max(most) - before
    assert store.num_keys() == before


@pytest.mark.parametrize("storage", ["local", "remote"])
def test_in_place_checkpoints_share_rank0s_name_and_a_failed_write_leaves_no_directory(
        tmp_path, storage):
    """Written once: every rank writes into the directory rank 0 named, in the run's storage,
    and reports that name (Ray's NO_UPLOAD); a write that fails removes the directory, so the
    run's storage holds no partial checkpoint. ``remote``: storage on a pyarrow filesystem that is
    not the local one (as S3 or GCS): every rank writes through it, and the failed write's
    directory is removed through it."""
    import pyarrow.fs

    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem()) \
        if storage == "remote" else None
    world = 2
    port = _free_port()
    stores = [dist.TCPStore("127.0.0.1", port, world, r == 0, timedelta(seconds=20),
                            wait_for_workers=False) for r in range(world)]
    reported: dict[int, list] = {r: [] for r in range(world)}
    places: list[str] = []

    def place(name: str):
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        places.append(name)
        return (str(directory), None) if remote is None else (name, remote)

    def report_fn(r):
        def report(metrics, directory, name=None):
            reported[r].append((metrics["step"], directory, name))
        return report

    reps = [Reporter(report_fn(r), rank=r, world=world, max_in_flight=2, timeout_s=20,
                     store=stores[r], key_prefix="p", place=place) for r in range(world)]

    def write(r, step, fail=False):
        def fn(directory: str, filesystem) -> dict:
            assert filesystem is remote
            if remote is None:
                with open(f"{directory}/shard{r}", "w") as f:
                    f.write(str(step))
            else:
                with remote.open_output_stream(f"{directory}/shard{r}") as f:
                    f.write(str(step).encode())
            if fail:
                raise OSError("disk full")
            return {"files": [f"shard{r}"], "bytes": 1}
        return fn

    def train(r):
        def run():
            for step in range(3):
                reps[r].checkpoint({"step": step}, write(r, step))
            reps[r].close()
        return run

    run_ranks([train(0), train(1)])
    assert [s for s, _, _ in reported[0]] == [0, 1, 2]
    for step in range(3):
        (_, d0, n0), (_, d1, n1) = reported[0][step], reported[1][step]
        assert n0 and n0 == n1 and d0 == d1 == (n0 if remote else str(tmp_path / n0)), reported
        assert n0.startswith("checkpoint_")
        assert sorted(p.name for p in (tmp_path / n0).iterdir()) == ["shard0", "shard1"]
    assert len({n for _, _, n in reported[0]}) == 3  # a new directory per checkpoint
    assert not list(tmp_path.glob("ray-train-xla-ckpt-*"))

    # A write that fails: its directory is removed and the error reaches the training function.
    lone = Reporter(report_fn(0), rank=0, world=1, max_in_flight=2, timeout_s=20, place=place)
    lone.checkpoint({"step": 9}, write(0, 9, fail=True))
    with pytest.raises(ReportError, match="disk full"):
        lone.close()
    assert not (tmp_path / places[-1]).exists()
    assert len(list(tmp_path.iterdir())) == 3
