"""Goodput of a run: productive step time over the run's wall-clock time, and where the rest
went, from the events every worker's step timeline (``toolkit/timeline.py``) wrote into the
run's storage (``goodput/attempt-<id>/rank-<r>.<part>.jsonl``). ``ray-train-xla goodput`` (its
parser and command at the end) prints it and draws the run.

The run's wall clock starts at ``fit()``: when it handed the config to Ray (the config records
the time when Ray pickles it for its controller; runs whose events lack it start at the first
worker group's start, when Ray Train's controller called the backend's ``on_start``), and ends
when the last training function of the last worker group ended. Every second of it falls in one
bucket:

- ``productive``: step time less the three below, from the end of the first step of a worker
  group on;
- ``start_up``: from ``fit()`` (Ray starting its controller and the workers, the backend's set-up)
  to the end of the first group's first step (mostly tracing and first transfers), less its
  compilation and data wait;
- ``compilation``: torch_xla's compile time (native stacks: Dynamo's), wherever it happened;
- ``data_wait``: time the training thread waited for a batch of the toolkit's loaders;
- ``checkpoint_stall``: time it was blocked in ``save_checkpoint``, ``report``, ``flush_reports``;
- ``lost``: work lost to failures: a failed worker group's time after its last checkpoint that
  Ray took (the one the next group resumes from), until the failure; all of its time after the
  first step when it had none;
- ``restart``: from a failure to the end of the next group's first step, less that step's
  compilation and data wait (restarts and elastic resizes alike);
- ``other``: the rest: between a worker's last step and its end (evaluation, final writes),
  between checkpoints and the next step, and a worker that ended before its group's last one.

A worker group failed when a training function raised (its end is the earliest failure), or
when it stopped while its functions ran: Ray shut it down (an elastic resize; its end is when
the first worker was told), or its workers stopped writing (killed: its end is then their last
write, known to within ``storage_interval_s``). Each group's buckets are the
mean over its workers: they step together.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ray_train_xla.tools.args import EXIT_FAILED, CommandError

BUCKETS = ("productive", "start_up", "compilation", "data_wait", "checkpoint_stall", "lost",
           "restart", "other")
LABELS = {
    "productive": "productive",
    "start_up": "start-up",
    "compilation": "compilation",
    "data_wait": "data wait",
    "checkpoint_stall": "checkpoint stall",
    "lost": "lost to failures",
    "restart": "restart",
    "other": "other",
}


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

    @property
    def group_start(self) -> float:
        return float(self.header.get("group_start") or self.header.get("begin") or 0.0)

    @property
    def run_start(self) -> float:
        """When fit() handed the config to Ray (0.0 in events written before it was kept)."""
        return float(self.header.get("run_start") or 0.0)

    @property
    def first_step_end(self) -> float | None:
        for span in self.spans:
            if span.get("first"):
                return float(span["t1"])
        return None

    @property
    def steps(self) -> int:
        return sum(int(s.get("steps", 0)) for s in self.spans)


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

    @property
    def restore(self) -> dict[str, Any] | None:
        """Where this group's state came from (memory or storage) and the slowest worker's
        time, when it restored one (the memory tier's workers say so)."""
        found = [r for w in self.workers for r in w.restores]
        if not found:
            return None
        tiers = sorted({str(r["tier"]) for r in found})
        return {"tier": "+".join(tiers), "seconds": max(float(r["seconds"] or 0) for r in found)}


@dataclass
class Goodput:
    run: str
    start: float
    end: float
    attempts: list[Attempt]
    buckets: dict[str, float]

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
            "attempts": [{"id": a.id, "start": a.start, "end": a.end, "outcome": a.outcome,
                          "workers": len(a.workers), "steps": max((w.steps for w in a.workers),
                                                                  default=0),
                          "lost_from": a.lost_from, "buckets_s": dict(a.buckets),
                          "restore": a.restore}
                         for a in self.attempts],
        }


# ---- reading ----------------------------------------------------------------------------------


def parse_worker(attempt: str, rank: int, lines: list[str]) -> Worker:
    """A worker from its files' lines (parts concatenated in order)."""
    worker = Worker(attempt=attempt, rank=rank, header={})
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a part being written
        kind = event.get("kind")
        t = event.get("t", event.get("t1"))
        if isinstance(t, (int, float)):
            worker.last_seen = max(worker.last_seen, float(t))
        if kind == "worker":
            worker.header = event
            worker.last_seen = max(worker.last_seen, float(event.get("begin", 0.0)))
        elif kind == "span":
            worker.spans.append(event)
        elif kind == "checkpoint":
            worker.checkpoints.append(float(event["t"]))
        elif kind == "commit":
            worker.commits.append(float(event["t"]))
        elif kind == "compile":
            worker.compiles.append((float(event["t"]), float(event["compile_s"])))
        elif kind == "restore":
            worker.restores.append({"tier": event.get("tier"), "seconds": event.get("seconds")})
        elif kind == "memory_kept":
            worker.memory_kept.append(float(event["t"]))
        elif kind == "end":
            worker.end = event
    worker.spans.sort(key=lambda s: s["t0"])
    return worker


def read_run(storage: Any) -> list[Worker]:
    """Every worker of every worker group of the run at ``storage`` (a ``RunStorage``)."""
    files = [f for f in storage.list("goodput", recursive=True) if f.endswith(".jsonl")]
    grouped: dict[tuple[str, int], list[tuple[int, str]]] = defaultdict(list)
    for path in files:
        parts = path.split("/")
        if len(parts) != 3 or not parts[1].startswith("attempt-") or not parts[2].startswith("rank-"):
            continue
        name = parts[2][len("rank-"):-len(".jsonl")]
        rank_text, _, part_text = name.partition(".")
        try:
            grouped[(parts[1][len("attempt-"):], int(rank_text))].append((int(part_text or 0), path))
        except ValueError:
            continue
    workers = []
    for (attempt, rank), parts in sorted(grouped.items()):
        lines: list[str] = []
        for _, path in sorted(parts):
            data = storage.read_bytes(path)
            if data is not None:
                lines.extend(data.decode(errors="replace").splitlines())
        workers.append(parse_worker(attempt, rank, lines))
    return workers


# ---- the arithmetic ---------------------------------------------------------------------------


def _attempts(workers: list[Worker]) -> list[Attempt]:
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
    if attempts:
        # The run's clock starts at fit() (when it handed the config to Ray), where the workers
        # know it: Ray's controller and the first workers starting are the first group's start-up.
        first = attempts[0]
        known = [w.run_start for w in first.workers if 0.0 < w.run_start <= first.start]
        if known:
            first.start = min(known)
    if attempts and attempts[-1].outcome == "stopped" and all(w.end is None for w in attempts[-1].workers):
        last = attempts[-1]
        last.outcome = "running"  # nothing after it: still going (or the run was killed)
        last.end = max(w.last_seen for w in last.workers)
    return attempts


def _lost_from(worker: Worker, end: float, memory: bool = False) -> float:
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
                   restarted: bool, memory: bool = False) -> dict[str, float]:
    """One worker's seconds of ``[start, end]`` (its group's) by bucket; ``failed``: the group
    failed (lost work); ``restarted``: a later group than the first (start-up is restart);
    ``memory``: the next group restored from the memory tier (``_lost_from``).

    ``[start, head]`` (to the end of the first step) is start-up (or restart) less what was
    measured in it; ``[head, lost_from]`` is the worker's spans, each its measured buckets and
    the rest productive (other in a span without a step end), and what no span covers is other;
    ``[lost_from, end]`` is lost (a failed group only)."""
    out = dict.fromkeys(BUCKETS, 0.0)
    lost_from = _lost_from(worker, end, memory) if failed else end
    first = worker.first_step_end
    head = max(start, min(first if first is not None else end, lost_from))
    startup_key = "restart" if restarted else "start_up"
    out[startup_key] = head - start
    covered = 0.0
    for span in worker.spans:
        t0, t1 = float(span["t0"]), float(span["t1"])
        length = t1 - t0
        if length <= 0:
            continue
        data, compile_s, stall = (float(span.get("data_s", 0.0)), float(span.get("compile_s", 0.0)),
                                  float(span.get("stall_s", 0.0)))
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
        out[startup_key] -= moved if t1 <= head else 0.0
        out["data_wait"] += data * scale
        out["compilation"] += compile_s * scale
        out["checkpoint_stall"] += stall * scale
    out["other"] += max(0.0, (lost_from - head) - covered)  # not written: a worker that ended early
    if failed:
        out["lost"] = end - lost_from
    return out


def compute(workers: list[Worker], run: str = "") -> Goodput:
    """The run's goodput from its workers' events."""
    if not workers:
        raise GoodputError("no goodput events: the run has no goodput/ directory (was it run "
                           "with this package's backend and a RunConfig storage_path?)")
    attempts = _attempts(workers)
    totals = dict.fromkeys(BUCKETS, 0.0)
    previous_end = None
    for i, attempt in enumerate(attempts):
        if previous_end is not None and attempt.start > previous_end:
            totals["restart"] += attempt.start - previous_end  # the failure to the next start
        failed = attempt.outcome in ("failed", "stopped")
        following = attempts[i + 1].restore if i + 1 < len(attempts) else None
        memory = bool(following and following["tier"] == "memory")
        per_worker = [worker_buckets(w, attempt.start, attempt.end, failed, i > 0, memory)
                      for w in attempt.workers]
        attempt.buckets = {b: sum(p[b] for p in per_worker) / len(per_worker) for b in BUCKETS}
        if failed:
            attempt.lost_from = sum(_lost_from(w, attempt.end, memory)
                                    for w in attempt.workers) / len(attempt.workers)
        for b in BUCKETS:
            totals[b] += attempt.buckets[b]
        previous_end = attempt.end if previous_end is None else max(previous_end, attempt.end)
    return Goodput(run=run, start=attempts[0].start, end=max(a.end for a in attempts),
                   attempts=attempts, buckets=totals)


def goodput_of(run_path: str) -> Goodput:
    """The goodput of the run at ``run_path`` (a local path or a URI of its storage)."""
    from ray_train_xla.toolkit.run_storage import RunStorage

    storage = RunStorage.at(run_path)
    return compute(read_run(storage), run=run_path)


# ---- the table and the picture ----------------------------------------------------------------


def format_table(result: Goodput) -> str:
    wall = result.wall
    workers = max(len(a.workers) for a in result.attempts)
    lines = [
        f"run {result.run}: {wall:.1f} s of wall clock from fit(), "
        f"{len(result.attempts)} worker group(s), up to {workers} worker(s)",
        "",
        f"{'bucket':<18}{'seconds':>10}{'share':>9}",
    ]
    for b in BUCKETS:
        share = result.buckets[b] / wall if wall > 0 else 0.0
        lines.append(f"{LABELS[b]:<18}{result.buckets[b]:>10.2f}{share:>8.1%}")
    lines.append(f"{'total':<18}{sum(result.buckets.values()):>10.2f}")
    lines.append("")
    lines.append(f"goodput {result.goodput:.1%}")
    lines.append("")
    lines.append(f"{'worker group':<14}{'start':>8}{'end':>9}{'workers':>9}{'steps':>8}  outcome")
    for a in result.attempts:
        steps = max((w.steps for w in a.workers), default=0)
        restore = a.restore
        restored = f", restored from {restore['tier']} in {restore['seconds']:.2f} s" \
            if restore else ""
        lines.append(f"{a.id[:12]:<14}{a.start - result.start:>8.1f}{a.end - result.start:>9.1f}"
                     f"{len(a.workers):>9}{steps:>8}  {a.outcome}{restored}")
    return "\n".join(lines)


COLORS = {"productive": "#3a9d3a", "start_up": "#9e9e9e", "compilation": "#d62728",
          "data_wait": "#ff9f1c", "checkpoint_stall": "#7b4fc9", "lost": "#ffb3b3",
          "restart": "#cfcfcf", "other": "#e8e8e8"}


def draw(result: Goodput, path: str) -> None:
    """A PNG of the run: one lane per worker rank, time since the run's start on x; steps in
    their buckets, compilations, checkpoints Ray took, failures and restarts marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = result.start
    lanes = max(w.rank for a in result.attempts for w in a.workers) + 1
    fig, ax = plt.subplots(figsize=(12, 2.2 + 0.6 * lanes))
    height = 0.6
    previous_end = None
    for i, attempt in enumerate(result.attempts):
        failed = attempt.outcome in ("failed", "stopped")
        if previous_end is not None and attempt.start > previous_end:
            ax.axvspan(previous_end - t0, attempt.start - t0, color=COLORS["restart"], alpha=0.6,
                       hatch="//", lw=0)
        for w in attempt.workers:
            y = w.rank
            first = w.first_step_end
            lost_from = _lost_from(w, attempt.end) if failed else attempt.end
            head_end = min(first if first is not None else attempt.end, attempt.end)
            ax.broken_barh([(attempt.start - t0, head_end - attempt.start)], (y - height / 2, height),
                           color=COLORS["restart" if i else "start_up"])
            head = next((sp for sp in w.spans if sp.get("first")), None)
            if head is not None and float(head["t1"]) <= attempt.end:  # the first step's measured
                x = float(head["t1"]) - t0
                for bucket, key in (("checkpoint_stall", "stall_s"), ("data_wait", "data_s"),
                                    ("compilation", "compile_s")):
                    seconds = min(float(head.get(key, 0.0)), x - (attempt.start - t0))
                    if seconds > 0:
                        x -= seconds
                        ax.broken_barh([(x, seconds)], (y - height / 2, height),
                                       color=COLORS[bucket], lw=0)
            for span in w.spans:
                s0, s1 = float(span["t0"]), min(float(span["t1"]), attempt.end)
                if s1 <= s0 or span.get("first") or s0 >= lost_from:
                    continue
                x = s0 - t0
                length = s1 - s0
                parts = [("compilation", span.get("compile_s", 0.0)), ("data_wait", span.get("data_s", 0.0)),
                         ("checkpoint_stall", span.get("stall_s", 0.0))]
                measured = sum(p[1] for p in parts)
                rest = max(0.0, length - measured)
                segments = [("productive" if span.get("steps") else "other", rest), *parts]
                scale = length / max(length, rest + measured)
                for bucket, seconds in segments:
                    if seconds > 0:
                        ax.broken_barh([(x, seconds * scale)], (y - height / 2, height),
                                       color=COLORS[bucket], lw=0)
                        x += seconds * scale
            if failed and attempt.end > lost_from:
                ax.broken_barh([(lost_from - t0, attempt.end - lost_from)], (y - height / 2, height),
                               facecolor=COLORS["lost"], edgecolor="#d62728", hatch="xx", lw=0.5)
            for t, _ in w.compiles:
                if t <= attempt.end:
                    ax.plot(t - t0, y - height / 2 - 0.1, marker="v", color=COLORS["compilation"],
                            ms=5, ls="")
            for t in w.checkpoints[:len(w.commits)]:
                if t <= attempt.end:
                    ax.plot([t - t0, t - t0], [y - height / 2 - 0.08, y + height / 2 + 0.08],
                            color="black", lw=1.5)
            if failed:
                ax.plot(attempt.end - t0, y, marker="X", color="#b00000", ms=11, ls="")
        previous_end = attempt.end if previous_end is None else max(previous_end, attempt.end)
    ax.set_yticks(range(lanes), [f"rank {r}" for r in range(lanes)])
    ax.set_ylim(lanes - 0.5, -0.7)
    ax.set_xlabel("seconds since the first worker group started")
    ax.set_title(f"goodput {result.goodput:.1%} over {result.wall:.1f} s")
    handles = [Patch(color=COLORS[b], label=LABELS[b]) for b in BUCKETS if b != "other"]
    handles += [plt.Line2D([], [], color="black", lw=1.5, label="checkpoint taken"),
                plt.Line2D([], [], marker="v", color=COLORS["compilation"], ls="", label="compiled"),
                plt.Line2D([], [], marker="X", color="#b00000", ls="", label="failure")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.16 + 0.1 / lanes, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ``ray-train-xla goodput``: its parser and its command.
def add_parser(sub) -> argparse.ArgumentParser:
    """``goodput``: where a run's time went, from its storage."""
    goodput = sub.add_parser(
        "goodput",
        help="print a run's goodput (productive step time over wall-clock time) and where the "
        "rest went; --png draws it",
        description="Read the goodput events every worker's step timeline wrote into the run's "
        "storage (RUN_PATH/goodput/, written by runs of this package's backend) and print the "
        "run's wall-clock time by bucket: productive, start-up, compilation, data wait, "
        "checkpoint stall, lost to failures, restart, other; then one line per worker group "
        "(restarts and elastic resizes start a new one). The wall clock starts when the first "
        "worker group started. Exits 2 when RUN_PATH holds no goodput events, 1 when its "
        "storage cannot be read or FILE cannot be written.",
    )
    goodput.add_argument("run_path", metavar="RUN_PATH",
                         help="the run's directory: RunConfig(storage_path=...)/<name>, a local "
                         "path or a URI (s3://..., gs://...)")
    goodput.add_argument("--png", metavar="FILE", default=None,
                         help="also draw the run: one lane per worker, steps in their buckets, "
                         "compilations, checkpoints, failures and restarts (needs matplotlib)")
    goodput.add_argument("--json", action="store_true", help="print the figures as JSON")
    return goodput


def cmd_goodput(args: argparse.Namespace) -> int:
    try:
        result = goodput_of(args.run_path)
    except GoodputError as exc:
        raise CommandError(f"{args.run_path}: {exc}") from exc
    except OSError as exc:
        raise CommandError(f"{args.run_path}: cannot read the run's storage: {exc}",
                           EXIT_FAILED) from exc
    if args.png is not None:
        try:
            draw(result, args.png)
        except ImportError as exc:
            raise CommandError(f"--png needs matplotlib (pip install matplotlib): {exc}",
                               EXIT_FAILED) from exc
        except OSError as exc:
            raise CommandError(f"cannot write {args.png}: {exc}", EXIT_FAILED) from exc
    if args.json:
        out = result.to_json()
        if args.png is not None:
            out["png"] = args.png
        print(json.dumps(out))
    else:
        print(format_table(result))
        if args.png is not None:
            print(f"\nwrote {args.png}")
    return 0
