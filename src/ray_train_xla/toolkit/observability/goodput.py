"""Goodput of a run: productive step time over the run's wall-clock time, and where the rest
went, from the events every worker's step timeline (``timeline.py``) wrote into the run's
storage (``goodput/attempt-<id>/rank-<r>.<part>.jsonl``). ``ray-train-xla goodput``
(``tools/goodput.py``) prints it and draws the run; ``docs/observability.md`` describes the
buckets, MFU over productive time and the stragglers.

The run's wall clock starts at ``fit()`` (the workers' ``run_start``; else at the first worker
group's start) and ends when the last training function of the last worker group ended; every
second of it falls in one of ``BUCKETS`` (``worker_buckets``). A worker group failed when a
training function raised (its end is the earliest failure), or when it stopped while its
functions ran: Ray shut it down (an elastic resize; its end is when the first worker was told),
or its workers stopped writing (killed: its end is their last write, known to within
``storage_interval_s``). Each group's buckets are the mean over its workers: they step together.

A rank is a straggler when its median own time a step (``timeline.py``) exceeds the median of
the other ranks' by more than ``threshold`` (10%) of the group's step time (medians: a single
hiccup names no rank); that excess times its steps is what it cost every rank. Every rank's
median is taken over the same steps: those every measured rank has an own time for (each span
keeps the own time of each of its steps), so neither where a rank's spans split nor how far
its file lags behind the others' moves the figure. Events written before spans kept each
step's own time hold one median a span: there a rank's median is the median of its spans'
medians weighted by their steps, over whatever steps it wrote (``Attempt.same_steps`` False).
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

BUCKETS = ("productive", "start_up", "compilation", "data_wait", "checkpoint_stall", "lost",
           "restart", "recovery", "other")
# How a worker group after the first began: a recovery in place ("in_process": the same
# processes, ``startup/recovery.py``; its start-up is the "recovery" bucket) or Ray Train's
# restart of the group ("group_restart": new processes; "restart").
RECOVERY_KINDS = ("in_process", "group_restart")


# goodput/attempt-<id>/rank-<r>.<part>.jsonl
_EVENT_FILE = re.compile(r"[^/]*/attempt-([^/]*)/rank-(\d+)(?:\.(\d+))?\.jsonl")


class GoodputError(Exception):
    """The run's goodput events cannot be read (none there, or unreadable)."""


@dataclass
class Worker:
    """One worker of one worker group, as its events say."""

    attempt: str
    rank: int
    header: dict[str, Any]
    spans: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[float] = field(default_factory=list)  # save_checkpoint returned
    commits: list[float] = field(default_factory=list)  # Ray took the oldest in flight
    compiles: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds)
    restores: list[dict[str, Any]] = field(default_factory=list)  # tier (memory, storage), seconds
    memory_kept: list[float] = field(default_factory=list)  # snapshots the memory tier completed
    end: dict[str, Any] | None = None
    last_seen: float = 0.0
    productive_steps: float = 0.0  # steps in its productive time (``worker_buckets``)

    @property
    def group_start(self) -> float:
        return float(self.header.get("group_start") or self.header.get("begin") or 0.0)

    @property
    def run_start(self) -> float:
        """When fit() handed the config to Ray (0.0 in events written before it was kept)."""
        return float(self.header.get("run_start") or 0.0)

    @property
    def first_step_end(self) -> float | None:
        return next((float(s["t1"]) for s in self.spans if s.get("first")), None)

    @property
    def steps(self) -> int:
        return sum(int(s.get("steps", 0)) for s in self.spans)


@dataclass
class Straggler:
    """A rank whose own time a step exceeds the other ranks' median by more than the threshold."""

    attempt: str
    rank: int
    own_s: float  # its own time a step (median)
    others_s: float  # the median of the other ranks' own time a step
    step_s: float  # the group's step time (median over ranks)
    steps: int  # the steps compared
    share: float = 0.0  # of the run's wall clock, ``excess_s`` (set by ``compute``)
    same_steps: bool = True  # False: from per-span medians (events without per-step own times)

    @property
    def excess_per_step_s(self) -> float:
        return self.own_s - self.others_s

    @property
    def excess_s(self) -> float:
        """The seconds every rank of the group waited for this one."""
        return self.excess_per_step_s * self.steps

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "rank": self.rank, "own_s": self.own_s,
                "others_s": self.others_s, "step_s": self.step_s, "steps": self.steps,
                "excess_per_step_s": self.excess_per_step_s, "excess_s": self.excess_s,
                "share": self.share, "same_steps": self.same_steps}


@dataclass
class Attempt:
    """One worker group: its start, end, outcome, workers and buckets (mean over workers)."""

    id: str
    start: float
    end: float
    outcome: str  # "finished", "failed", "stopped" (shut down while running, or killed), "running"
    workers: list[Worker]
    buckets: dict[str, float] = field(default_factory=dict)
    lost_from: float | None = None  # mean over workers: where lost work starts
    mfu: float | None = None  # over its productive time (``mfu``), None without model FLOPs
    stragglers: list[Straggler] = field(default_factory=list)
    measured: int = 0  # ranks whose own time was measured (stragglers need 2)
    same_steps: bool = True  # ranks compared over the same steps (False: older events)

    @property
    def goodput(self) -> float:
        """Its productive time over its own wall clock."""
        wall = self.end - self.start
        return self.buckets.get("productive", 0.0) / wall if wall > 0 else 0.0

    @property
    def effective_mfu(self) -> float | None:
        return None if self.mfu is None else self.mfu * self.goodput

    @property
    def recovery(self) -> str:
        """How this group began after a failure: "in_process" when its workers say so (a
        generation of a recovery in place), else "group_restart"."""
        return ("in_process" if any(w.header.get("recovery") == "in_process"
                                    for w in self.workers) else "group_restart")

    @property
    def restore(self) -> dict[str, Any] | None:
        """Where this group's state came from (memory or storage) and the slowest worker's
        time, when it restored one (the memory tier's workers say so)."""
        found = [r for w in self.workers for r in w.restores]
        if not found:
            return None
        return {"tier": "+".join(sorted({str(r["tier"]) for r in found})),
                "seconds": max(float(r["seconds"] or 0) for r in found)}


@dataclass
class Goodput:
    run: str
    start: float
    end: float
    attempts: list[Attempt]
    buckets: dict[str, float]
    mfu: float | None = None  # over the run's productive time, None without model FLOPs
    threshold: float = 0.1  # of the step time, over which a rank is a straggler
    flops_from: str = ""  # where the workers' model FLOPs came from (their rules)
    mfu_missing: str | None = None  # why there is no MFU, naming the call that adds it

    @property
    def stragglers(self) -> list[Straggler]:
        return [s for a in self.attempts for s in a.stragglers]

    @property
    def effective_mfu(self) -> float | None:
        """MFU x goodput: the share of the devices' peak the run turned into training over its
        whole wall clock."""
        return None if self.mfu is None else self.mfu * self.goodput

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.wall if self.wall > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run, "start": self.start, "end": self.end, "wall_s": self.wall,
            "goodput": self.goodput, "buckets_s": dict(self.buckets),
            "mfu": self.mfu, "effective_mfu": self.effective_mfu,
            "flops_from": self.flops_from, "mfu_missing": self.mfu_missing,
            "straggler_threshold": self.threshold,
            "stragglers": [s.to_json() for s in self.stragglers],
            "attempts": [{"id": a.id, "start": a.start, "end": a.end, "outcome": a.outcome,
                          "workers": len(a.workers), "steps": max((w.steps for w in a.workers),
                                                                  default=0),
                          "lost_from": a.lost_from, "buckets_s": dict(a.buckets),
                          "restore": a.restore, "recovery": recovery_of(self, i),
                          "mfu": a.mfu, "effective_mfu": a.effective_mfu,
                          "ranks_measured": a.measured, "stragglers_same_steps": a.same_steps,
                          "stragglers": [s.to_json() for s in a.stragglers]}
                         for i, a in enumerate(self.attempts)],
        }


def recovery_of(result: Goodput, i: int) -> dict[str, Any] | None:
    """How worker group ``i`` recovered from the failure of the one before (None for the
    first): its kind (``RECOVERY_KINDS``), the seconds from the failure to the end of its first
    step (the mean over its workers), and the tier its state came from."""
    if i == 0:
        return None
    attempt, before = result.attempts[i], result.attempts[i - 1]
    heads = [w.first_step_end for w in attempt.workers if w.first_step_end is not None]
    seconds = (sum(heads) / len(heads) - before.end) if heads else None
    restore = attempt.restore
    return {"kind": attempt.recovery, "seconds": seconds,
            "tier": restore["tier"] if restore else None}


# ---- reading ----------------------------------------------------------------------------------


def parse_worker(attempt: str, rank: int, lines: list[str]) -> Worker:
    """A worker from its files' lines (parts concatenated in order)."""
    worker = Worker(attempt=attempt, rank=rank, header={})
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a part being written, or an empty one
        if not isinstance(event, dict):
            continue  # JSON, but not an event
        kind = event.get("kind")
        t = event.get("t", event.get("t1"))
        if isinstance(t, (int, float)):
            worker.last_seen = max(worker.last_seen, float(t))
        if kind == "worker":
            worker.header = event
            worker.last_seen = max(worker.last_seen, float(event.get("begin", 0.0)))
        elif kind == "span":
            worker.spans.append(event)
        elif kind in ("checkpoint", "commit", "memory_kept"):
            times = {"checkpoint": worker.checkpoints, "commit": worker.commits,
                     "memory_kept": worker.memory_kept}
            times[kind].append(float(event["t"]))
        elif kind == "compile":
            worker.compiles.append((float(event["t"]), float(event["compile_s"])))
        elif kind == "restore":
            worker.restores.append({"tier": event.get("tier"), "seconds": event.get("seconds")})
        elif kind == "end":
            worker.end = event
    worker.spans.sort(key=lambda s: s["t0"])
    return worker


def read_run(storage: Any, under: str = "goodput", newest: bool = False) -> list[Worker]:
    """Every worker of every worker group of the run at ``storage`` (a ``RunStorage``) whose
    events are under ``under``; ``newest``: from the newest part of each worker's files only."""
    files: dict[tuple[str, int], list[tuple[int, str]]] = defaultdict(list)  # (part, path)
    for path in storage.list(under, recursive=True):
        found = _EVENT_FILE.fullmatch(path)
        if found:
            files[(found[1], int(found[2]))].append((int(found[3] or 0), path))
    workers = []
    for (attempt, rank), parts in sorted(files.items()):
        parts.sort()
        lines: list[str] = []
        for _, path in parts[-1:] if newest else parts:
            data = storage.read_bytes(path)
            if data is not None:
                lines.extend(data.decode(errors="replace").splitlines())
        workers.append(parse_worker(attempt, rank, lines))
    return workers


# ---- the arithmetic ---------------------------------------------------------------------------


def _attempts(workers: list[Worker]) -> list[Attempt]:
    """The worker groups of ``workers`` (at least one), by their start."""
    by_attempt: dict[str, list[Worker]] = defaultdict(list)
    for w in workers:
        by_attempt[w.attempt].append(w)
    attempts = []
    for attempt_id, group in by_attempt.items():
        start = min(w.group_start for w in group)
        failures = [float(w.end["t"]) for w in group if w.end and w.end.get("failed")]
        ended = [w for w in group if w.end is not None and not w.end.get("stopped")]
        if failures:
            outcome, end = "failed", min(failures)
        elif len(ended) == len(group):
            outcome, end = "finished", max(float(w.end["t"]) for w in group)
        else:  # stopped by Ray while running (a resize), killed, or still running
            outcome = "stopped"
            end = min(w.last_seen for w in group if w not in ended)
        attempts.append(Attempt(attempt_id, start, max(end, start), outcome,
                                sorted(group, key=lambda w: w.rank)))
    attempts.sort(key=lambda a: a.start)
    first, last = attempts[0], attempts[-1]
    # The run's clock starts at fit() (when it handed the config to Ray), where the workers know
    # it: Ray's controller and the first workers starting are the first group's start-up.
    known = [w.run_start for w in first.workers if 0.0 < w.run_start <= first.start]
    if known:
        first.start = min(known)
    if last.outcome == "stopped" and all(w.end is None for w in last.workers):
        last.outcome = "running"  # nothing after it: still going (or the run was killed)
        last.end = max(w.last_seen for w in last.workers)
    return attempts


def lost_work_from(worker: Worker, end: float, memory: bool = False) -> float:
    """Where a failed group's worker starts losing work: the last checkpoint Ray took before
    ``end`` (the i-th commit is the i-th checkpoint: the reporter takes them in order), or, when
    the next group restored from the memory tier (``memory``), the last snapshot the tier
    completed if later; else the end of its first step; ``end`` (nothing lost) when it never
    finished a step."""
    committed = [t for t in worker.checkpoints[:len(worker.commits)] if t <= end]
    if memory:
        committed = sorted(committed + [t for t in worker.memory_kept if t <= end])
    if committed:
        return committed[-1]
    first = worker.first_step_end
    return first if first is not None and first <= end else end


def worker_buckets(worker: Worker, start: float, end: float, failed: bool,
                   restarted: bool | str, memory: bool = False) -> dict[str, float]:
    """One worker's seconds of ``[start, end]`` (its group's) by bucket; ``failed``: the group
    failed (lost work); ``restarted``: a later group than the first (start-up is restart, or the
    bucket it names: "recovery");
    ``memory``: the next group restored from the memory tier (``lost_work_from``).

    ``[start, head]`` (to the end of the first step) is start-up (or restart) less what was
    measured in it; ``[head, lost_from]`` is the worker's spans, each its measured buckets and
    the rest productive (other in a span without a step end), and what no span covers is other;
    ``[lost_from, end]`` is lost (a failed group only)."""
    out = dict.fromkeys(BUCKETS, 0.0)
    lost_from = lost_work_from(worker, end, memory) if failed else end
    first = worker.first_step_end
    head = max(start, min(first if first is not None else end, lost_from))
    startup_key = restarted if isinstance(restarted, str) else \
        "restart" if restarted else "start_up"
    out[startup_key] = head - start
    covered = steps = 0.0
    for span in worker.spans:
        t0, t1 = float(span["t0"]), float(span["t1"])
        length = t1 - t0
        if length <= 0:
            continue
        data, compile_s, stall = (float(span.get(k, 0.0)) for k in ("data_s", "compile_s", "stall_s"))
        measured = data + compile_s + stall
        if t1 <= head:  # in the head: only what was measured leaves start-up
            moved = min(measured, out[startup_key])
            scale = moved / measured if measured else 0.0
        else:
            lo, hi = max(t0, head), min(t1, lost_from)
            if hi <= lo:
                continue
            part = (hi - lo) / length  # a span cut by the head or by lost work: its share
            covered += hi - lo
            scale = min(part, (hi - lo) / measured) if measured else 0.0
            moved = measured * scale
            out["productive" if span.get("steps") else "other"] += (hi - lo) - moved
            steps += int(span.get("steps", 0)) * part
        out[startup_key] -= moved if t1 <= head else 0.0
        out["data_wait"] += data * scale
        out["compilation"] += compile_s * scale
        out["checkpoint_stall"] += stall * scale
    worker.productive_steps = steps
    out["other"] += max(0.0, (lost_from - head) - covered)  # not written: a worker that ended early
    if failed:
        out["lost"] = end - lost_from
    return out


def compute(workers: list[Worker], run: str = "", straggler_threshold: float = 0.1) -> Goodput:
    """The run's goodput from its workers' events; ``straggler_threshold``: the share of the
    step time by which a rank's own time must exceed the others' to be named."""
    if not workers:
        raise GoodputError("no goodput events: the run has no goodput/ directory (was it run "
                           "with this package's backend and a RunConfig storage_path?)")
    attempts = _attempts(workers)
    totals = dict.fromkeys(BUCKETS, 0.0)
    per_worker_of: list[dict[str, float]] = []
    previous_end = None
    for i, attempt in enumerate(attempts):
        begun = ("recovery" if attempt.recovery == "in_process" else "restart") if i else False
        if previous_end is not None and attempt.start > previous_end:
            totals[begun] += attempt.start - previous_end  # the failure to the next start
        failed = attempt.outcome in ("failed", "stopped")
        following = attempts[i + 1].restore if i + 1 < len(attempts) else None
        memory = bool(following and following["tier"] == "memory")
        per_worker = [worker_buckets(w, attempt.start, attempt.end, failed, begun, memory)
                      for w in attempt.workers]
        attempt.buckets = {b: sum(p[b] for p in per_worker) / len(per_worker) for b in BUCKETS}
        per_worker_of += per_worker
        if failed:
            attempt.lost_from = sum(lost_work_from(w, attempt.end, memory)
                                    for w in attempt.workers) / len(attempt.workers)
        attempt.mfu = mfu(attempt.workers, per_worker)
        attempt.stragglers, attempt.measured, attempt.same_steps = stragglers(
            attempt.workers, straggler_threshold)
        for b in BUCKETS:
            totals[b] += attempt.buckets[b]
        previous_end = attempt.end if previous_end is None else max(previous_end, attempt.end)
    every = [w for a in attempts for w in a.workers]
    result = Goodput(run=run, start=attempts[0].start, end=max(a.end for a in attempts),
                     attempts=attempts, buckets=totals, mfu=mfu(every, per_worker_of),
                     threshold=straggler_threshold,
                     flops_from=", ".join(sorted({str(w.header["flops_from"]) for w in every
                                                  if w.header.get("flops_from")})))
    if result.mfu is None:
        result.mfu_missing = mfu_missing(every)
    for s in result.stragglers:
        s.share = s.excess_s / result.wall if result.wall > 0 else 0.0
    return result


def mfu(workers: list[Worker], buckets: list[dict[str, float]]) -> float | None:
    """Model FLOPs utilisation over productive time: the model FLOPs of the steps in the
    workers' productive time (``flops_per_step`` of their timelines, ``configure_timeline``)
    over those seconds at each worker's peak (``peak_tflops``). None when no worker gave both."""
    done = capacity = 0.0
    for worker, own in zip(workers, buckets):
        flops, peak = worker.header.get("flops_per_step"), worker.header.get("peak_tflops")
        if flops and peak and own["productive"] > 0:
            done += worker.productive_steps * float(flops)
            capacity += own["productive"] * float(peak) * 1e12
    return done / capacity if capacity else None


def mfu_missing(workers: list[Worker]) -> str:
    """Why no worker gave MFU: the reason most of them wrote (``mfu_missing`` of their
    timelines, which names the call that adds it) and how many did."""
    reasons: dict[str, int] = defaultdict(int)
    for worker in workers:
        if worker.header.get("mfu_missing"):
            reasons[str(worker.header["mfu_missing"])] += 1
    if not reasons:  # events written before the workers said
        return ("no worker gave model FLOPs a step and a peak: add "
                "rtx.configure_timeline(flops_per_step=..., peak_tflops=...)")
    reason, count = max(reasons.items(), key=lambda item: item[1])
    return f"{reason} ({count} of {len(workers)} workers)"


def goodput_of(run_path: str, straggler_threshold: float = 0.1) -> Goodput:
    """The goodput of the run at ``run_path`` (a local path or a URI of its storage)."""
    from ray_train_xla.toolkit.run_storage import RunStorage

    storage = RunStorage.at(run_path)
    return compute(read_run(storage), run=run_path, straggler_threshold=straggler_threshold)


# ---- stragglers -------------------------------------------------------------------------------


def own_times(workers: list[Worker], since: float = 0.0,
              last_steps: int | None = None) -> dict[int, tuple[float, float, int]]:
    """Each measured rank's (median own time a step, step time, steps compared), over its spans
    after its first step that end at ``since`` or later, and of those steps the last
    ``last_steps`` that every rank measured (the module docstring says how)."""
    return _own_times(workers, since, last_steps)[0]


def _row(spans: list[dict[str, Any]]) -> tuple[int, list[int | None]]:
    """(index of the first step, the own time of each step from there in microseconds, None
    where not measured) from spans with per-step own times."""
    first = min(int(s["own_step"]) for s in spans)
    row: list[int | None] = [None] * (max(int(s["own_step"]) + len(s["own_us"]) for s in spans)
                                      - first)
    for s in spans:
        at = int(s["own_step"]) - first
        row[at:at + len(s["own_us"])] = s["own_us"]
    return first, row


def _own_times(workers: list[Worker], since: float, last_steps: int | None = None
               ) -> tuple[dict[int, tuple[float, float, int]], bool]:
    """``own_times`` and whether the ranks were compared over the same steps (False: some
    rank's events hold per-span medians only)."""
    rows: dict[int, tuple[int, list[int | None]]] = {}  # rank: ``_row``
    older: dict[int, tuple[float, int]] = {}  # rank: (weighted median of span medians, steps)
    step_s: dict[int, float] = {}
    for w in workers:
        spans = [s for s in w.spans if not s.get("first") and float(s["t1"]) >= since
                 and (s.get("own_us") or s.get("own_steps"))]
        steps = sum(int(s.get("steps", 0)) for s in spans)
        if not spans or not steps:
            continue
        step_s[w.rank] = sum(float(s["t1"]) - float(s["t0"]) for s in spans) / steps
        if all(s.get("own_us") for s in spans):
            rows[w.rank] = _row(spans)
            continue
        medians = sorted((float(s["own_median_s"]), int(s["own_steps"])) for s in spans
                         if s.get("own_steps"))
        n = sum(c for _, c in medians)
        seen = itertools.accumulate(c for _, c in medians)
        older[w.rank] = next(v for (v, _), upto in zip(medians, seen) if 2 * upto >= n), n
    out = {r: (median, step_s[r], n) for r, (median, n) in older.items()}
    if older or not rows:
        return {**out, **{r: (statistics.median(v for v in row if v is not None) * 1e-6,
                              step_s[r], len(row) - row.count(None))
                          for r, (_, row) in rows.items()}}, not older
    # The same steps: the range every rank's row covers, less the steps some rank did not measure.
    lo, hi = max(f for f, _ in rows.values()), min(f + len(row) for f, row in rows.values())
    lo = max(lo, hi - last_steps) if last_steps else lo
    if hi <= lo:  # no step that every rank measured
        return {}, True
    same = {r: row[lo - f:hi - f] for r, (f, row) in rows.items()}
    gaps: set[int] = set()
    for row in same.values():
        at = -1
        for _ in range(row.count(None)):
            at = row.index(None, at + 1)
            gaps.add(at)
    if gaps:
        same = {r: [v for i, v in enumerate(row) if i not in gaps] for r, row in same.items()}
    return {r: (statistics.median(row) * 1e-6, step_s[r], len(row))
            for r, row in same.items() if row}, True


def stragglers(workers: list[Worker], threshold: float = 0.1, since: float = 0.0,
               last_steps: int | None = None) -> tuple[list[Straggler], int, bool]:
    """The stragglers of one worker group (the module docstring says how), slowest first, the
    number of ranks measured (none can be named below 2) and whether they were compared over
    the same steps (``own_times`` says which)."""
    measured, same = _own_times(workers, since, last_steps)
    if len(measured) < 2:
        return [], len(measured), same
    attempt = workers[0].attempt
    step_s = statistics.median(v[1] for v in measured.values())
    found = []
    for rank, (own, _, n) in measured.items():
        others = statistics.median(v[0] for r, v in measured.items() if r != rank)
        if own - others > threshold * step_s:
            found.append(Straggler(attempt, rank, own, others, step_s, n, same_steps=same))
    return sorted(found, key=lambda s: -s.excess_s), len(measured), same


def live_stragglers(storage: Any, under: str, since: float, threshold: float = 0.1,
                    last_steps: int | None = None) -> list[Straggler]:
    """The stragglers of a running worker group (rank 0's Ray metric) from the newest event file
    of each rank under ``under`` (``goodput/attempt-<id>``), over the spans ending at ``since``
    on and the last ``last_steps`` steps that every rank has written: a file that lags behind
    the others' names no rank."""
    return stragglers(read_run(storage, under, newest=True), threshold, since, last_steps)[0]
