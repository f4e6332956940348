"""The step timeline's events and the goodput arithmetic, without Ray: timelines driven by a
fake clock write a run of two worker groups (a failure after a checkpoint, a restart) into a
run directory; the reader, the buckets, the CLI table and the PNG are checked against the
times the test chose. The same path under Ray, against a wall-clock audit, is in
``test_goodput_ray.py``."""

from __future__ import annotations

import json

import pytest

from ray_train_xla.toolkit import timeline as tl_mod
from ray_train_xla.toolkit.run_storage import RunStorage
from ray_train_xla.toolkit.timeline import Timeline
from ray_train_xla.tools import goodput
from ray_train_xla.tools.cli import main


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
                  run_start=run_start, compile_reader=compiles.reader(), clock=clock)
    return tl, clock, compiles


def _step(tl, clock, at: float, data: float = 0.0, compile_s: float = 0.0, compiles=None) -> None:
    tl.data_s += data
    if compile_s:
        compiles.compile(compile_s)
    clock.t = at
    tl.on_step(0)


def write_run(run_dir, fail_at=(107.8, 107.6), run_start=0.0) -> None:
    """Two workers, two groups: group A (start 100) fails after a checkpoint at 105.3; group B
    (start 109) restarts and finishes at 114. ``run_start``: when fit() handed the config to Ray
    (0.0: events without it)."""
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
        clock.t = fail_at[rank]
        tl.end(failed=True, error="RuntimeError: injected")
    for rank in (0, 1):
        tl, clock, compiles = _worker(storage, "B", rank, 109.0, 110.0)
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


def test_files_are_parts_and_a_torn_line_is_skipped(tmp_path, monkeypatch):
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
    result = goodput.goodput_of(str(tmp_path))
    assert result.attempts[0].workers[0].steps == 7
    assert result.buckets["productive"] == pytest.approx(6.0)


def test_report_metrics_are_the_steps_since_the_last_call():
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
    finally:
        tl_mod._settings["samples_per_step"] = None
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
