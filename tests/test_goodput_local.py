"""The step timeline's events and the goodput arithmetic, without Ray: timelines driven by a
fake clock write a run of two worker groups (a failure after a checkpoint, a restart) into a
run directory; the reader, the buckets, the CLI table and the PNG are checked against the
times the test chose. The same path under Ray, against a wall-clock audit, is in
``test_goodput_ray.py``. Then the steps of loops that call a plain ``optimizer.step()``, seen
through torch's optimizer hook, each counted once (``toolkit/steps.py``)."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest
import torch

from ray_train_xla.toolkit import runtime as rt_mod
from ray_train_xla.toolkit import steps
from ray_train_xla.toolkit.observability import goodput
from ray_train_xla.toolkit.observability import timeline as tl_mod
from ray_train_xla.toolkit.observability.flops import NO_MODEL
from ray_train_xla.toolkit.observability.timeline import Timeline
from ray_train_xla.toolkit.run_storage import RunStorage
from ray_train_xla.toolkit.runtime import TimelineOptions, runtime
from ray_train_xla.tools.cli import main
from ray_train_xla.tools.goodput import format_table

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Compiles:
    """A compile counter and total, as torch_xla's, that the test moves."""

    def __init__(self) -> None:
        self.count, self.total = 0.0, 0.0

    def compile(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds

    def reader(self):
        return (lambda: self.count), (lambda: self.total)


def _worker(storage, attempt: str, rank: int, group_start: float, begin: float,
            run_start: float = 0.0):
    clock, compiles = Clock(begin), Compiles()
    tl = Timeline(attempt=attempt, rank=rank, world=2, group_start=group_start, storage=storage,
                  run_start=run_start, compile_reader=compiles.reader(), clock=clock,
                  options=lambda: runtime().options(TimelineOptions))
    return tl, clock, compiles


def _step(tl, clock, at: float, data: float = 0.0, compile_s: float = 0.0, compiles=None) -> None:
    tl.data_s += data
    if compile_s:
        compiles.compile(compile_s)
    clock.t = at
    tl.on_step(0)


def write_run(run_dir, fail_at=(107.8, 107.6), run_start=0.0, memory=None) -> None:
    """Two workers, two groups: group A (start 100) fails after a checkpoint at 105.3; group B
    (start 109) restarts and finishes at 114. ``run_start``: when fit() handed the config to Ray
    (0.0: events without it). ``memory``: group A's memory tier also completed the snapshot of
    107.3, and group B restored from that tier (``"memory"``) or from storage."""
    storage = RunStorage.at(str(run_dir))
    for rank in (0, 1):
        tl, clock, compiles = _worker(storage, "A", rank, 100.0, 101.0, run_start)
        _step(tl, clock, 103.0, data=0.5, compile_s=1.0, compiles=compiles)  # first step
        _step(tl, clock, 104.0, data=0.2)
        _step(tl, clock, 105.0, data=0.2)
        tl.stall_s += 0.3
        clock.t = 105.3
        tl.checkpoint_saved(3)
        clock.t = 105.5
        tl.checkpoint_committed()
        _step(tl, clock, 106.3, data=0.2)
        _step(tl, clock, 107.3, data=0.2)
        if memory:
            tl.memory_kept(107.3)
        clock.t = fail_at[rank]
        tl.end(failed=True, error="RuntimeError: injected")
    for rank in (0, 1):
        tl, clock, compiles = _worker(storage, "B", rank, 109.0, 110.0)
        if memory:
            tl.restored(memory, 0.4)
        _step(tl, clock, 111.5, data=0.1, compile_s=0.8, compiles=compiles)
        _step(tl, clock, 112.5, data=0.1)
        _step(tl, clock, 113.5, data=0.1)
        tl.stall_s += 0.2  # flush_reports at the end
        clock.t = 114.0
        tl.end()


EXPECTED = {
    # Group A ends at its earliest failure, 107.6; lost work from the checkpoint at 105.3.
    "start_up": 3.0 - 0.5 - 1.0,
    "compilation": 1.0 + 0.8,
    "data_wait": 0.5 + 0.4 + 0.1 + 0.2,
    "checkpoint_stall": 0.3 + 0.2,
    "productive": (2.3 - 0.7) + (2.0 - 0.2),
    "lost": 107.6 - 105.3,
    "restart": (109.0 - 107.6) + (111.5 - 109.0 - 0.9),
    "other": 0.3,
}


def test_buckets_of_a_run_with_a_failure_and_a_restart(tmp_path):
    write_run(tmp_path)
    result = goodput.goodput_of(str(tmp_path))
    assert [a.id for a in result.attempts] == ["A", "B"]
    assert [a.outcome for a in result.attempts] == ["failed", "finished"]
    assert result.wall == pytest.approx(14.0)
    for bucket, seconds in EXPECTED.items():
        assert result.buckets[bucket] == pytest.approx(seconds, abs=1e-9), bucket
    assert sum(result.buckets.values()) == pytest.approx(result.wall)
    assert result.goodput == pytest.approx(EXPECTED["productive"] / 14.0)


def test_mfu_over_productive_time_and_effective_mfu_of_a_run_with_a_failure(tmp_path):
    """Each worker did 4 productive steps (2 per group: group A's after its checkpoint were
    lost, each group's first is start-up or restart) in 3.4 productive seconds (1.6 + 1.8)."""
    flops, peak = 3e12, 2.0
    rt_mod.begin()
    try:
        tl_mod.configure_timeline(flops_per_step=flops, peak_tflops=peak)
        write_run(tmp_path)
    finally:
        rt_mod.end()
    result = goodput.goodput_of(str(tmp_path))
    assert result.mfu == pytest.approx(4 * flops / (3.4 * peak * 1e12))
    assert result.effective_mfu == pytest.approx(result.mfu * result.goodput)
    assert result.effective_mfu == pytest.approx(4 * flops / (3.4 * peak * 1e12) * 3.4 / 14.0)
    a, b = result.attempts
    assert a.mfu == pytest.approx(2 * flops / (1.6 * peak * 1e12))
    assert b.mfu == pytest.approx(2 * flops / (1.8 * peak * 1e12))
    assert b.effective_mfu == pytest.approx(b.mfu * 1.8 / 5.0)
    table = format_table(result)
    assert f"MFU {result.mfu:.1%} over productive time, effective MFU {result.effective_mfu:.1%}" \
        f" (MFU x goodput); model FLOPs from configure_timeline" in table, table
    data = result.to_json()
    assert data["mfu"] == result.mfu and data["attempts"][0]["mfu"] == a.mfu
    assert data["mfu_missing"] is None
    # Without model FLOPs (no model the package prepared, no configure_timeline): no MFU, and
    # the table says why, naming the call that adds it.
    write_run(tmp_path / "plain")
    plain = goodput.goodput_of(str(tmp_path / "plain"))
    assert plain.mfu is None and plain.effective_mfu is None
    why = f"no model FLOPs a step: {NO_MODEL} (4 of 4 workers)"
    assert "add rtx.configure_timeline(flops_per_step=...)" in why
    assert f"MFU: not measured: {why}" in format_table(plain).splitlines()
    assert plain.to_json()["mfu_missing"] == why


def write_straggled_run(run_dir, late=(0.0, 0.0, 0.05), steps=6, arrive=True,
                        noise=False) -> float:
    """One group of 3 workers whose steps end together every 0.2 s (synchronous collectives):
    rank r arrives at the step's gradient synchronisation ``late[r]`` after the others (0.1 s
    into the step), and a checkpoint stall of 0.07 s in step 3 on rank 1 that is not its own
    time. ``noise``: rank 0 is 0.15 s late once (a hiccup: its mean would name it), and rank
    2 0.09 s late in a step that compiled. Returns the run's wall clock."""
    storage = RunStorage.at(str(run_dir))
    rt_mod.begin()
    try:
        tl_mod.configure_timeline(flops_per_step=4e11, peak_tflops=10.0)
        for rank in range(3):
            tl, clock, compiles = _worker(storage, "A", rank, 100.0, 100.0)
            tl.world = 3
            for i in range(steps):
                start = 100.0 + 0.2 * i
                if i == 3 and rank == 1:
                    tl.stall_s += 0.07
                extra = 0.07 if i == 3 and rank == 1 else 0.0
                if noise and (rank, i) == (0, 4):
                    extra = 0.15
                if noise and (rank, i) == (2, 2):
                    extra = 0.09
                    compiles.compile(0.09)
                clock.t = start + 0.1 + late[rank] + extra
                if arrive:
                    tl.arrived()
                    tl.arrived()  # a second collective in the step: the first arrival counts
                clock.t = start + 0.2
                tl.on_step(i + 1)
            tl.end()
    finally:
        rt_mod.end()
    return 0.2 * steps


def test_a_rank_that_arrives_late_is_named_with_its_excess_and_none_otherwise(tmp_path, capsys):
    wall = write_straggled_run(tmp_path / "slow")
    result = goodput.goodput_of(str(tmp_path / "slow"))
    assert result.attempts[0].measured == 3
    [straggler] = result.stragglers
    assert straggler.rank == 2 and straggler.steps == 5  # the first step is start-up
    assert straggler.excess_per_step_s == pytest.approx(0.05)
    assert straggler.others_s == pytest.approx(0.1) and straggler.step_s == pytest.approx(0.2)
    assert straggler.excess_s == pytest.approx(0.25)
    assert straggler.share == pytest.approx(0.25 / wall)
    table = format_table(result)
    assert "stragglers: median own time a step" in table and "+0.050" in table, table
    data = result.to_json()
    assert [s["rank"] for s in data["stragglers"]] == [2]
    assert data["attempts"][0]["stragglers"][0]["excess_s"] == pytest.approx(0.25)
    # What rank 0's timeline names for the Ray metric, from the same files.
    storage = RunStorage.at(str(tmp_path / "slow"))
    live = goodput.live_stragglers(storage, "goodput/attempt-A", since=0.0)
    assert [(s.rank, round(s.excess_per_step_s, 9)) for s in live] == [(2, 0.05)]
    assert goodput.live_stragglers(storage, "goodput/attempt-A", since=200.0) == []
    # A higher threshold names none; so does a run whose ranks arrive within it.
    assert main(["goodput", str(tmp_path / "slow"), "--straggler-threshold", "0.3"]) == 0
    assert "stragglers: none (in 1 worker group(s)" in capsys.readouterr().out
    write_straggled_run(tmp_path / "even", late=(0.0, 0.01, 0.0), noise=True)
    even = goodput.goodput_of(str(tmp_path / "even"))
    assert even.stragglers == [] and even.attempts[0].measured == 3
    # (the step rank 2 compiled is left out of every rank's own time: the ranks are compared
    # over the same steps; rank 0's hiccup is one step)
    assert [n for _, _, n in goodput.own_times(even.attempts[0].workers).values()] == [4, 4, 4]
    # Ranks that never reach a synchronisation the timeline sees: not measured, and said.
    write_straggled_run(tmp_path / "unseen", arrive=False)
    unseen = goodput.goodput_of(str(tmp_path / "unseen"))
    assert unseen.attempts[0].measured == 0
    assert "stragglers: not measured" in format_table(unseen)
    # The PNG names the straggler's lane and draws MFU over time (model FLOPs given).
    png = tmp_path / "slow.png"
    assert main(["goodput", str(tmp_path / "slow"), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["goodput", str(tmp_path / "slow"), "--straggler-threshold", "0"]) == 2


def write_own_times(run_dir, own: dict, spans: dict | None = None, written: dict | None = None,
                    step_s: float = 0.3):
    """One running group whose steps end together every ``step_s``: rank r reaches the step's
    gradient synchronisation ``own[r][i]`` into step i + 1. ``spans[r]``: the sizes of rank r's
    spans after its first step (where its background thread drained; default: one span);
    ``written[r]``: the steps in rank r's file (its file behind the others'; default: all).
    Returns the run's storage."""
    storage = RunStorage.at(str(run_dir))
    for rank, times in own.items():
        tl, clock, _ = _worker(storage, "A", rank, 100.0, 100.0)
        tl.world = len(own)
        ends = list(itertools.accumulate([1, *(spans or {}).get(rank, [])]))
        for i, value in enumerate(times[:(written or {}).get(rank, len(times))]):
            clock.t = 100.0 + step_s * i + value
            tl.arrived()
            clock.t = 100.0 + step_s * (i + 1)
            tl.on_step(i + 1)
            if i + 1 in ends:  # its background thread's run
                with tl._lock:
                    tl._drain()
                    tl._write(force=True)
        with tl._lock:  # what its last write left in the run's storage (no end yet)
            tl._drain()
            tl._write(force=True)
    return storage


def _split(rng: random.Random, steps: int) -> list[int]:
    """Spans of 1 to 5 steps covering ``steps`` steps, at random."""
    sizes: list[int] = []
    while sum(sizes) < steps:
        sizes.append(rng.randint(1, 5))
    return sizes


def test_ranks_with_the_same_step_times_name_nobody_however_their_spans_split(tmp_path):
    """Noisy own times (about 0.05 or 0.15 s at random, as with batches of two lengths, in
    steps of 0.3 s: the threshold is 0.03 s), the same on both ranks, drained into spans of 1
    to 5 steps that split differently on each rank."""
    rng = random.Random(0)
    times = [rng.choice([0.05, 0.15]) + 0.01 * rng.random() for _ in range(40)]
    for trial in range(20):
        run = tmp_path / f"split-{trial}"
        write_own_times(run, {0: times, 1: times}, spans={r: _split(rng, 39) for r in (0, 1)})
        result = goodput.goodput_of(str(run))
        assert result.attempts[0].measured == 2
        assert result.stragglers == [], (trial, result.stragglers)
        own = goodput.own_times(result.attempts[0].workers)
        assert own[0][0] == own[1][0] and own[0][2] == own[1][2] == 39, own


def test_a_rank_whose_file_lags_names_nobody_in_the_live_metric(tmp_path):
    """The same own times on both ranks, slower in a warm-up (0.15 s for 20 steps, then 0.05
    s); rank 1's file is 15 steps behind rank 0's (written up to step 25 of 40)."""
    times = [0.15] * 20 + [0.05] * 20
    storage = write_own_times(tmp_path, {0: times, 1: times}, written={1: 25})
    assert goodput.live_stragglers(storage, "goodput/attempt-A", since=0.0) == []
    [worker_0, worker_1] = goodput.read_run(storage, "goodput/attempt-A", newest=True)
    assert worker_0.steps == 40 and worker_1.steps == 25
    own = goodput.own_times([worker_0, worker_1])  # over steps 2 to 25, which both wrote
    assert own[0][0] == own[1][0] == pytest.approx(0.15) and own[0][2] == own[1][2] == 24
    own = goodput.own_times([worker_0, worker_1], last_steps=10)  # steps 16 to 25
    assert own[0][0] == own[1][0] == pytest.approx(0.1) and own[0][2] == own[1][2] == 10
    # What rank 0's timeline sets its Ray metric from, 12 s into the run.
    tl, _, _ = _worker(storage, "A", 0, 100.0, 112.0)
    assert tl.stragglers() == {}
    # No step that both measured (rank 1's 2 to 25, rank 0's moved to 30 to 68): none compared.
    for span in worker_0.spans:
        span["own_step"] = span.get("own_step", 0) + 28
    assert goodput.own_times([worker_0, worker_1]) == {}


def test_a_slowed_rank_is_named_with_its_delay_from_lagging_files_and_any_span_split(tmp_path,
                                                                                   monkeypatch):
    """Rank 2 reaches the synchronisation 0.05 s after its own work in every step; every rank's
    work is 0.15 s in a warm-up of 20 steps, then 0.05 s, with its own noise of +-0.01 s. Live:
    rank 2's file is 15 steps behind; offline: every file complete, spans split at random."""
    rng = random.Random(1)
    delay = 0.05
    own = {r: [(0.15 if i < 20 else 0.05) + rng.uniform(-0.01, 0.01) + (delay if r == 2 else 0)
               for i in range(40)] for r in range(3)}
    storage = write_own_times(tmp_path / "live", own, written={2: 25})
    [live] = goodput.live_stragglers(storage, "goodput/attempt-A", since=0.0)
    assert live.rank == 2 and live.steps == 24
    assert live.excess_per_step_s == pytest.approx(delay, abs=0.2 * delay), live
    tl, _, _ = _worker(storage, "A", 0, 100.0, 112.0)
    assert tl.stragglers() == {2: live.excess_per_step_s}
    monkeypatch.setattr(tl_mod, "STRAGGLER_WINDOW_STEPS", 5)  # its metric's last steps
    [last] = goodput.live_stragglers(storage, "goodput/attempt-A", since=0.0, last_steps=5)
    assert last.steps == 5 and tl.stragglers() == {2: last.excess_per_step_s}
    write_own_times(tmp_path / "run", own, spans={r: _split(rng, 39) for r in range(3)})
    [named] = goodput.goodput_of(str(tmp_path / "run")).stragglers
    assert named.rank == 2 and named.steps == 39
    assert named.excess_per_step_s == pytest.approx(delay, abs=0.2 * delay), named


def test_events_without_per_step_own_times_still_name_stragglers_and_say_how(tmp_path):
    """Files written before spans kept each step's own time (one median a span): each rank's
    own time is the median of its spans' medians weighted by their steps, as then, and the
    output says the ranks were not compared over the same steps."""
    def span(t0, steps, median, first=False):
        return {"kind": "span", "t0": t0, "t1": t0 + 0.2 * steps, "steps": steps,
                "data_s": 0.0, "stall_s": 0.0, "compile_s": 0.0, "own_s": median * steps,
                "own_steps": steps, "own_median_s": median, **({"first": True} if first else {})}
    for rank, medians in ((0, (0.1, 0.1, 0.3)), (1, (0.2, 0.3, 0.2))):
        lines = [{"kind": "worker", "attempt": "A", "rank": rank, "world": 2,
                  "group_start": 100.0, "begin": 100.0}, span(100.0, 1, 0.5, first=True),
                 span(100.2, 3, medians[0]), span(100.8, 1, medians[1]),
                 span(101.0, 1, medians[2]), {"kind": "end", "t": 101.2, "failed": False}]
        path = tmp_path / "goodput" / "attempt-A" / f"rank-{rank}.0000.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    result = goodput.goodput_of(str(tmp_path))
    [slow] = result.stragglers
    # rank 0: 0.1 for 4 steps of 5; rank 1: 0.2 for 4 steps of 5
    assert slow.rank == 1 and slow.excess_per_step_s == pytest.approx(0.1) and slow.steps == 5
    assert not slow.same_steps and not result.attempts[0].same_steps
    assert "worker group A: events without per-step own times" in format_table(result)
    assert result.to_json()["attempts"][0]["stragglers_same_steps"] is False
    # Files of this release: compared over the same steps, and said nothing of.
    write_straggled_run(tmp_path / "new")
    new = goodput.goodput_of(str(tmp_path / "new"))
    assert new.attempts[0].same_steps and "older release" not in format_table(new)


@pytest.mark.parametrize("tier", ["memory", "storage"])
def test_work_kept_by_the_memory_tier_is_lost_only_when_storage_served_the_restore(tmp_path, tier):
    """Group A's memory tier kept the step of 107.3: restored from memory, only 107.3 -> 107.6
    is lost; restored from storage (the tier's copies gone), from the checkpoint at 105.3."""
    write_run(tmp_path, memory=tier)
    result = goodput.goodput_of(str(tmp_path))
    lost = 107.6 - (107.3 if tier == "memory" else 105.3)
    assert result.buckets["lost"] == pytest.approx(lost, abs=1e-9)
    assert sum(result.buckets.values()) == pytest.approx(result.wall)
    assert result.attempts[1].restore == {"tier": tier, "seconds": 0.4}
    assert f"restored from {tier} in 0.40 s" in format_table(result)


def test_the_clock_starts_at_fit_where_the_workers_know_it(tmp_path):
    """fit() handed the config to Ray at 96: Ray's controller and workers starting (96 to the
    group's start at 100) are start-up; restarted groups keep their own starts."""
    write_run(tmp_path, run_start=96.0)
    result = goodput.goodput_of(str(tmp_path))
    assert result.start == 96.0 and result.wall == pytest.approx(18.0)
    assert result.buckets["start_up"] == pytest.approx(EXPECTED["start_up"] + 4.0)
    assert result.buckets["restart"] == pytest.approx(EXPECTED["restart"])
    assert sum(result.buckets.values()) == pytest.approx(result.wall)


def test_lost_work_without_a_checkpoint_starts_after_the_first_step(tmp_path):
    storage = RunStorage.at(str(tmp_path))
    tl, clock, compiles = _worker(storage, "A", 0, 0.5, 1.0)
    _step(tl, clock, 2.0)
    _step(tl, clock, 3.0)
    tl.stall_s += 0.1
    clock.t = 3.1
    tl.checkpoint_saved(2)  # never taken by Ray: not a checkpoint to resume from
    _step(tl, clock, 4.0)
    clock.t = 4.5
    tl.end(failed=True)
    result = goodput.goodput_of(str(tmp_path))
    assert result.buckets["start_up"] == pytest.approx(1.5)
    assert result.buckets["lost"] == pytest.approx(2.5)
    assert result.buckets["productive"] == 0.0


def test_a_group_stopped_without_an_end_ends_at_its_last_write(tmp_path):
    """A resize (or a killed worker) leaves no end event: the group ends at its workers' last
    write, and what followed its last checkpoint is lost."""
    storage = RunStorage.at(str(tmp_path))
    tl, clock, _ = _worker(storage, "A", 0, 0.0, 0.5)
    _step(tl, clock, 1.0)
    _step(tl, clock, 2.0)
    with tl._lock:
        tl._drain()
        tl._write(force=True)  # the background write: its heartbeat is at the clock, 2.0
    tl2, clock2, _ = _worker(storage, "B", 0, 5.0, 5.5)
    _step(tl2, clock2, 6.0)
    clock2.t = 7.0
    tl2.end()
    result = goodput.goodput_of(str(tmp_path))
    assert [a.outcome for a in result.attempts] == ["stopped", "finished"]
    assert result.attempts[0].end == pytest.approx(2.0)
    assert result.buckets["lost"] == pytest.approx(1.0)
    assert result.buckets["restart"] == pytest.approx(3.0 + 1.0)


def test_a_group_shut_down_while_running_ends_when_it_was_told(tmp_path):
    storage = RunStorage.at(str(tmp_path))
    tl, clock, _ = _worker(storage, "A", 0, 0.0, 0.5)
    _step(tl, clock, 1.0)
    tl.stall_s += 0.1
    clock.t = 1.5
    tl.checkpoint_saved(1)
    tl.checkpoint_committed()
    _step(tl, clock, 2.0)
    clock.t = 2.5
    tl.end(stopped=True)  # shutdown_worker: Ray resizes the run
    tl2, clock2, _ = _worker(storage, "B", 0, 3.0, 3.5)
    _step(tl2, clock2, 4.0)
    clock2.t = 4.0
    tl2.end()
    result = goodput.goodput_of(str(tmp_path))
    assert [a.outcome for a in result.attempts] == ["stopped", "finished"]
    assert result.attempts[0].end == pytest.approx(2.5)
    assert result.buckets["lost"] == pytest.approx(1.0)
    assert result.buckets["checkpoint_stall"] == pytest.approx(0.1)
    assert result.buckets["restart"] == pytest.approx(0.5 + 1.0)
    assert sum(result.buckets.values()) == pytest.approx(result.wall) == pytest.approx(3.5)


def test_files_are_parts_and_a_torn_or_foreign_line_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(tl_mod, "PART_LINES", 3)
    storage = RunStorage.at(str(tmp_path))
    tl, clock, _ = _worker(storage, "A", 0, 0.0, 0.0)
    for i in range(1, 8):
        _step(tl, clock, float(i))
        with tl._lock:
            tl._drain()
            tl._write(force=True)
    clock.t = 8.0
    tl.end()
    files = storage.list("goodput", recursive=True)
    assert len(files) > 2 and all(f.startswith("goodput/attempt-A/rank-0.") for f in files)
    with open(tmp_path / files[0], "a") as f:
        f.write('{"kind": "span", "t0": ')  # torn
    with open(tmp_path / files[1], "a") as f:
        f.write('\n[1, 2]\n7\n')  # JSON, but no event
    result = goodput.goodput_of(str(tmp_path))
    assert result.attempts[0].workers[0].steps == 7
    assert result.buckets["productive"] == pytest.approx(6.0)


def test_a_part_is_bounded_in_bytes_and_own_times_are_read_across_parts(tmp_path, monkeypatch):
    """Spans hold each step's own time, so a part is bounded in bytes as well as in lines."""
    monkeypatch.setattr(tl_mod, "PART_BYTES", 1000)
    times = [0.1 + 0.001 * (i % 7) for i in range(301)]
    storage = write_own_times(tmp_path, {0: times, 1: times}, spans={0: [50] * 6, 1: [30] * 10})
    files = storage.list("goodput", recursive=True)
    assert len([f for f in files if "/rank-0." in f]) > 2, files
    assert all(len(storage.read_bytes(f)) < 1000 + 600 for f in files)  # a line over, at most
    own = goodput.own_times(goodput.goodput_of(str(tmp_path)).attempts[0].workers)
    assert own[0] == own[1] and own[0][2] == 300
    # What a step costs in the events (docs/observability.md): at 1 step/ms, own times of
    # 0.6 to 0.9 ms, a span of 5000 steps (a 5-second interval) is about 4 bytes a step.
    rng = random.Random(0)
    write_own_times(tmp_path / "fast", {0: [0.0006 + 0.0003 * rng.random() for _ in range(5001)]},
                    step_s=0.001)
    [part] = RunStorage.at(str(tmp_path / "fast")).list("goodput", recursive=True)
    span = max((tmp_path / "fast" / part).read_text().splitlines(), key=len)  # steps 2 to 5001
    assert 5000 * 4 <= len(span) <= 5000 * 4 + 400, len(span)


def test_report_metrics_are_the_steps_since_the_last_call():
    rt_mod.begin()  # a training function's runtime: configure_timeline's options are its own
    tl, clock, compiles = _worker(None, "A", 0, 0.0, 0.0)
    tl_mod.configure_timeline(samples_per_step=32)
    try:
        _step(tl, clock, 1.0, data=0.25, compile_s=0.5, compiles=compiles)
        _step(tl, clock, 1.5, data=0.25)
        tl.stall_s += 0.5
        clock.t = 2.0
        tl.checkpoint_saved(2)
        _step(tl, clock, 2.5)
        out = tl.report_metrics()
        assert out["timeline/steps"] == 3
        assert out["timeline/step_time_s"] == pytest.approx(2.5 / 3)
        assert out["timeline/data_wait_s"] == pytest.approx(0.5 / 3)
        assert out["timeline/checkpoint_stall_s"] == pytest.approx(0.5 / 3)
        assert out["timeline/compile_s"] == pytest.approx(0.5 / 3)
        assert out["timeline/samples_per_s"] == pytest.approx(32 / (2.5 / 3))
        assert tl.report_metrics() == {}
        # Another caller's window: every step since the start, not taken by the first caller.
        assert tl.report_metrics(caller="other")["timeline/steps"] == 3
    finally:
        rt_mod.end()
    with pytest.raises(ValueError, match="samples_per_step"):
        tl_mod.configure_timeline(samples_per_step=0)


def test_cli_prints_the_table_and_draws_the_png(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    png = tmp_path / "run.png"
    assert main(["goodput", str(run), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "lost to failures" in out and "restart" in out
    assert f"goodput {EXPECTED['productive'] / 14.0:.1%}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["goodput", str(run), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["wall_s"] == pytest.approx(14.0)
    assert data["buckets_s"]["lost"] == pytest.approx(EXPECTED["lost"])
    assert [a["outcome"] for a in data["attempts"]] == ["failed", "finished"]
    assert main(["goodput", str(tmp_path / "nothing")]) == 2
    assert "no goodput events" in capsys.readouterr().err


class FlakyStorage:
    """A run's storage whose first ``failures`` writes fail (an object store that is down)."""

    def __init__(self, inner, failures: int) -> None:
        self.inner, self.failures, self.calls = inner, failures, 0

    def write_bytes(self, path, data) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError("storage unavailable (test)")
        self.inner.write_bytes(path, data)


def test_a_failing_storage_is_warned_once_retried_and_loses_no_event(tmp_path, caplog):
    """The timeline is observation: a write that fails never fails the training function; it is
    warned once, and the events wait for the next write (none lost, in order)."""
    storage = FlakyStorage(RunStorage.at(str(tmp_path)), failures=2)
    tl, clock, compiles = _worker(storage, "A", 0, 100.0, 101.0)
    _step(tl, clock, 102.0)
    with tl._lock:
        tl._drain()
        tl._write(force=True)  # fails: warned
        tl._write(force=True)  # fails again: not warned again
    _step(tl, clock, 103.0)
    _step(tl, clock, 104.0)
    clock.t = 104.5
    tl.end()  # the third write succeeds, with everything
    warnings = [r for r in caplog.records if "cannot write goodput events" in r.getMessage()]
    assert len(warnings) == 1 and storage.calls == 3
    (worker,) = goodput.read_run(RunStorage.at(str(tmp_path)))
    spans = [(float(s["t0"]), float(s["t1"]), s["steps"]) for s in worker.spans]
    # Every step once, in order, no gap: 101 -> 102 (the first), 102 -> 104 (two), the tail.
    assert spans == [(101.0, 102.0, 1), (102.0, 104.0, 2), (104.0, 104.5, 0)], spans
    assert worker.end is not None and worker.end["failed"] is False


def test_a_timeline_behind_keeps_a_bounded_buffer_and_says_how_much_it_dropped(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(tl_mod, "BUFFER_RECORDS", 4)
    storage = RunStorage.at(str(tmp_path))
    tl, clock, compiles = _worker(storage, "A", 0, 100.0, 101.0)
    for i in range(10):  # the background thread never ran: the buffer holds the newest 4
        _step(tl, clock, 102.0 + i)
        assert len(tl._buf) <= 4
    clock.t = 112.5
    tl.end()
    lines = [json.loads(line) for part in storage.list("goodput", recursive=True)
             for line in storage.read_bytes(part).decode().splitlines()]
    dropped = [line for line in lines if line.get("kind") == "dropped"]
    assert len(dropped) == 1 and dropped[0]["records"] >= 6


# ---- steps ended by a plain optimizer.step(): torch's global optimizer hook (steps.py) --------


@pytest.fixture
def hooked():
    """The step count's optimizer hook, installed as the backend does at the function's start."""
    steps.reset()
    assert steps.install_optimizer_hook()
    yield
    steps.uninstall_optimizer_hook()
    steps.reset()


def _opt(kind=torch.optim.SGD, **kw):
    p = torch.nn.Parameter(torch.zeros(3))
    return p, kind([p], lr=0.1, **kw)


def _grad(*params) -> None:
    for p in params:
        p.grad = torch.ones_like(p)


def test_a_plain_optimizer_step_loop_counts_every_step_and_its_time(tmp_path, hooked, monkeypatch):
    """The loop of the sharded paths (no optimizer_step, no step_done): every opt.step() ends a
    step; the productive time and the data wait goodput reads match the loop's own clock within
    1% of the wall time; the data wait is only the time in the loader's next(), not the work (or
    a sync) between two steps."""
    from ray_train_xla.toolkit.data import _timed

    n, data_s, compute_s, after_s = 30, 0.004, 0.008, 0.004  # 0.5 s: 1% is 5 ms of noise
    storage = RunStorage.at(str(tmp_path))
    tl = Timeline(attempt="A", rank=0, world=1, storage=storage)
    monkeypatch.setattr(runtime(), "timeline", tl)  # where the loader's data wait goes
    steps.add_step_hook(tl.on_step)

    def batches():
        for _ in range(n):
            time.sleep(data_s)
            yield torch.randn(8, 4)

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own_data, ends = [], []
    it = _timed(batches())
    while True:
        t0 = time.time()
        try:
            x = next(it)
        except StopIteration:
            break
        own_data.append(time.time() - t0)
        with torch.no_grad():  # (no autograd on the CPU here: the XLA tests after these need it)
            model.weight.grad = (x.T @ model(x)).T / len(x)
            model.bias.grad = model(x).mean(0)
        time.sleep(compute_s)
        opt.step()
        ends.append(time.time())
        time.sleep(after_s)  # a torch_xla.sync() after the step: the next step's time
    tl.end()
    assert steps.steps_done() == n
    result = goodput.goodput_of(str(tmp_path))
    (worker,) = result.attempts[0].workers
    assert worker.steps == n
    own_productive = sum(ends[i] - ends[i - 1] - own_data[i] for i in range(1, n))
    tolerance = 0.01 * result.wall
    assert result.buckets["productive"] == pytest.approx(own_productive, abs=tolerance)
    assert result.buckets["data_wait"] == pytest.approx(sum(own_data), abs=tolerance)
    assert result.buckets["data_wait"] < 0.5 * (ends[-1] - ends[0])  # the batches' wait only
    assert sum(result.buckets.values()) == pytest.approx(result.wall)


def test_optimizer_step_counts_once_with_the_hook(hooked):
    import ray_train_xla as rtx

    seen = []
    steps.add_step_hook(seen.append)
    p, opt = _opt(momentum=0.9)
    q, other = _opt()
    for _ in range(4):
        _grad(p, q)
        rtx.optimizer_step(opt, sync=False)
        other.step()  # a second optimizer stepped plainly: the loop marks its own steps
    assert seen == [1, 2, 3, 4] and steps.steps_done() == 4


def test_step_done_after_a_plain_step_counts_once_and_then_marks_the_steps(hooked):
    """The first opt.step() ends step 1 (the hook); the step_done() right after it marks
    nothing more; from then on steps end at step_done(), where the loop marks them."""
    where, phase = [], ["?"]
    steps.add_step_hook(lambda n: where.append((n, phase[0])))
    p, opt = _opt()
    for _ in range(4):
        _grad(p)
        phase[0] = "step"
        opt.step()
        phase[0] = "done"
        assert steps.step_done() == steps.steps_done()
    assert where == [(1, "step"), (2, "done"), (3, "done"), (4, "done")]
    # step_done() before the step: counted there, the step() after it counts nothing.
    steps.reset()
    steps.install_optimizer_hook()
    for _ in range(3):
        steps.step_done()
        _grad(p)
        opt.step()
    assert steps.steps_done() == 3


def test_several_optimizers_count_the_steps_of_the_first_one_stepped(hooked):
    """A GAN's two optimizers (or parameter groups split over two): one step per step() of the
    lead, the first stepped; a wrapper that is itself a hooked optimizer, Ray's
    prepare_optimizer wrapper, a scheduler's patched step() and the state priming of a
    checkpoint load count nothing more; when the lead goes quiet, the other takes over."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    d_p, d_opt = _opt(torch.optim.Adam)
    g_p, g_opt = _opt(torch.optim.Adam)
    primed = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    _init_optim_state(primed)  # set_optimizer_state_dict's priming step(): not a step
    assert primed.state and steps.steps_done() == 0
    torch.optim.lr_scheduler.StepLR(d_opt, step_size=1)
    for _ in range(3):
        _grad(d_p, g_p)
        d_opt.step()
        g_opt.step()
    assert steps.steps_done() == 3
    for _ in range(3):  # the discriminator frozen: the generator becomes the lead
        _grad(g_p)
        g_opt.step()
    assert steps.steps_done() == 3 + 3  # (it stepped after the lead's last step: then twice)

    class Outer(torch.optim.Optimizer):  # a hooked wrapper (as ZeroRedundancyOptimizer)
        def __init__(self, inner):
            super().__init__(inner.param_groups[0]["params"], {})
            self.inner = inner

        def step(self, closure=None):
            return self.inner.step(closure)

    steps.reset()
    steps.install_optimizer_hook()
    outer = Outer(g_opt)
    for _ in range(3):
        _grad(g_p)
        outer.step()
    assert steps.steps_done() == 3
    from ray.train.torch.train_loop_utils import _WrappedOptimizer  # prepare_optimizer's

    wrapped = _WrappedOptimizer(g_opt)
    for _ in range(2):
        _grad(g_p)
        wrapped.step()
    assert steps.steps_done() == 5
    steps.uninstall_optimizer_hook()
    g_opt.step()
    assert steps.steps_done() == 5 and not steps.optimizer_hook_installed()


def test_an_error_in_the_hook_is_warned_once_and_never_reaches_the_step(hooked, caplog):
    def broken(n):
        raise RuntimeError("broken step hook (test)")

    steps.add_step_hook(broken)
    p, opt = _opt()
    for _ in range(3):
        _grad(p)
        opt.step()  # does not raise
    assert p.detach().tolist() == pytest.approx([-0.3] * 3)  # every step() did its work
    warnings = [r for r in caplog.records if "optimizer hook failed" in r.getMessage()]
    assert len(warnings) == 1 and "broken step hook" in warnings[0].getMessage()
    assert steps.steps_done() == 3


def test_the_training_function_wrapper_hooks_the_optimizers_then_unhooks_them():
    """As Ray Train runs a training function in our configs' ``train_func_context``
    (``startup/train_function.py``): the hook is on while it runs, its plain steps reach the
    timeline, and it is off when it returns or raises; each function counts its own steps."""
    from ray_train_xla.startup.train_function import training_function

    steps.reset()
    seen = {}

    def train(fail=False):
        assert steps.optimizer_hook_installed()
        p, opt = _opt()
        for _ in range(3):
            _grad(p)
            opt.step()
        seen["timeline"] = tl_mod.active().report_metrics().get("timeline/steps")
        seen["steps"] = steps.steps_done()  # this training function's own count
        if fail:
            raise RuntimeError("injected (test)")

    try:
        with training_function():
            train()
        assert seen["timeline"] == 3 and not steps.optimizer_hook_installed()
        with pytest.raises(RuntimeError, match="injected"), training_function():
            train(fail=True)
        assert seen["timeline"] == 3 and not steps.optimizer_hook_installed()
        assert seen["steps"] == 3 and tl_mod.active() is None
    finally:
        steps.uninstall_optimizer_hook()
        steps.reset()
