"""``ray-train-xla goodput``: a run's goodput as a table, its picture (``--png``), its parser
and its command. The reading and the adding up are ``toolkit/observability/goodput.py``'s,
imported when the command runs (the CLI itself loads neither torch nor Ray)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from ray_train_xla.tools.args import EXIT_FAILED, CommandError

if TYPE_CHECKING:
    from ray_train_xla.toolkit.observability.goodput import Goodput

LABELS = {"productive": "productive", "start_up": "start-up", "compilation": "compilation",
          "data_wait": "data wait", "checkpoint_stall": "checkpoint stall",
          "lost": "lost to failures", "restart": "restart", "recovery": "recovery in place",
          "other": "other"}


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 10:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share of the step time, e.g. 0.1")
    return value


# ---- the table and the picture ----------------------------------------------------------------


def format_table(result: Goodput) -> str:
    from ray_train_xla.toolkit.observability.goodput import BUCKETS, recovery_of

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
    lines += [f"{'total':<18}{sum(result.buckets.values()):>10.2f}", "",
              f"goodput {result.goodput:.1%}"]
    if result.mfu is not None:
        lines.append(f"MFU {result.mfu:.1%} over productive time, effective MFU "
                     f"{result.effective_mfu:.1%} (MFU x goodput); model FLOPs from "
                     f"{result.flops_from or 'the workers'}")
    else:
        lines.append(f"MFU: not measured: {result.mfu_missing}")
    lines += ["", f"{'worker group':<14}{'start':>8}{'end':>9}{'workers':>9}{'steps':>8}  outcome"]
    for i, a in enumerate(result.attempts):
        steps = max((w.steps for w in a.workers), default=0)
        restored = (f", restored from {a.restore['tier']} in {a.restore['seconds']:.2f} s"
                    if a.restore else "")
        rec = recovery_of(result, i)
        if rec is not None:
            took = f" in {rec['seconds']:.2f} s" if rec["seconds"] is not None else ""
            restored = (f", began by {RECOVERY_LABELS[rec['kind']]}{took} (the failure to "
                        f"its first step's end){restored}")
        mfu = (f"; MFU {a.mfu:.1%}, effective {a.effective_mfu:.1%}" if a.mfu is not None
               else "")
        lines.append(f"{a.id[:12]:<14}{a.start - result.start:>8.1f}{a.end - result.start:>9.1f}"
                     f"{len(a.workers):>9}{steps:>8}  {a.outcome}{restored}{mfu}")
    return "\n".join([*lines, "", *format_stragglers(result)])


def format_stragglers(result: Goodput) -> list[str]:
    """The stragglers' lines: each rank named, its own time a step, the others' median, the
    excess a step and in all, and the share of the run it cost; a line for each worker group
    whose events are older than per-step own times (its ranks not compared over the same steps)."""
    threshold = f"{result.threshold:.0%}"
    measured = [a for a in result.attempts if a.measured >= 2]
    if not measured:
        return ["stragglers: not measured (it takes 2 or more workers that reach optimizer_step, "
                "reduce_gradients, clip_grad_norm_ or the forward of a prepare_sharded_model model)"]
    older = [f"worker group {a.id[:12]}: events without per-step own times (written by an older "
             "release): each rank's own time is the median of its spans' medians, over the "
             "steps it wrote, not over the same steps" for a in measured if not a.same_steps]
    if not result.stragglers:
        return [f"stragglers: none (in {len(measured)} worker group(s), every rank's median own "
                f"time a step, over the steps every rank measured, is within {threshold} of the "
                "step time of the other ranks' median)", *older]
    lines = [f"stragglers: median own time a step (before the gradient synchronisation), over the "
             f"steps every rank measured, over the other ranks' median by more than {threshold} "
             "of the step time",
             f"{'worker group':<14}{'rank':>5}{'own s':>9}{'others s':>10}{'step s':>9}"
             f"{'excess/step':>13}{'steps':>7}{'excess s':>10}{'of run':>8}"]
    for st in result.stragglers:
        lines.append(f"{st.attempt[:12]:<14}{st.rank:>5}{st.own_s:>9.3f}{st.others_s:>10.3f}"
                     f"{st.step_s:>9.3f}{st.excess_per_step_s:>+13.3f}{st.steps:>7}"
                     f"{st.excess_s:>10.2f}{st.share:>8.1%}")
    return [*lines, *older]


RECOVERY_LABELS = {"in_process": "a recovery in place (same processes)",
                   "group_restart": "a restart of the group (new processes)"}

COLORS = {"productive": "#3a9d3a", "start_up": "#9e9e9e", "compilation": "#d62728",
          "data_wait": "#ff9f1c", "checkpoint_stall": "#7b4fc9", "lost": "#ffb3b3",
          "restart": "#cfcfcf", "recovery": "#8fd3e8", "other": "#e8e8e8"}


def draw(result: Goodput, path: str) -> None:
    """A PNG of the run: one lane per worker rank, time since the run's start on x; steps in
    their buckets, compilations, checkpoints Ray took, failures and restarts marked, stragglers
    named on their lane; with model FLOPs, a panel below of each rank's MFU over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from ray_train_xla.toolkit.observability.goodput import BUCKETS, lost_work_from

    t0 = result.start
    lanes = max(w.rank for a in result.attempts for w in a.workers) + 1
    if result.mfu is not None:
        fig, (ax, mfu_ax) = plt.subplots(2, 1, sharex=True, figsize=(12, 4.2 + 0.6 * lanes),
                                         gridspec_kw={"height_ratios": [2.2 + 0.6 * lanes, 2]})
        draw_mfu(result, mfu_ax)
    else:
        fig, ax = plt.subplots(figsize=(12, 2.2 + 0.6 * lanes))
    height = 0.6

    def bar(y: int, x: float, width: float, **style) -> None:
        ax.broken_barh([(x, width)], (y - height / 2, height), **style)

    previous_end = None
    for i, attempt in enumerate(result.attempts):
        failed = attempt.outcome in ("failed", "stopped")
        begun = "recovery" if attempt.recovery == "in_process" else "restart"
        if previous_end is not None and attempt.start > previous_end:
            ax.axvspan(previous_end - t0, attempt.start - t0, color=COLORS[begun], alpha=0.6,
                       hatch="//", lw=0)
        for w in attempt.workers:
            y = w.rank
            lost_from = lost_work_from(w, attempt.end) if failed else attempt.end
            head_end = attempt.end if w.first_step_end is None else min(w.first_step_end, attempt.end)
            bar(y, attempt.start - t0, head_end - attempt.start,
                color=COLORS[begun if i else "start_up"])
            head = next((sp for sp in w.spans if sp.get("first")), None)
            if head is not None and float(head["t1"]) <= attempt.end:  # the first step's measured
                x = float(head["t1"]) - t0
                for bucket, key in (("checkpoint_stall", "stall_s"), ("data_wait", "data_s"),
                                    ("compilation", "compile_s")):
                    seconds = min(float(head.get(key, 0.0)), x - (attempt.start - t0))
                    if seconds > 0:
                        x -= seconds
                        bar(y, x, seconds, color=COLORS[bucket], lw=0)
            for span in w.spans:
                s0, s1 = float(span["t0"]), min(float(span["t1"]), attempt.end)
                if s1 <= s0 or span.get("first") or s0 >= lost_from:
                    continue
                x, length = s0 - t0, s1 - s0
                parts = [("compilation", span.get("compile_s", 0.0)), ("data_wait", span.get("data_s", 0.0)),
                         ("checkpoint_stall", span.get("stall_s", 0.0))]
                measured = sum(p[1] for p in parts)
                rest = max(0.0, length - measured)
                segments = [("productive" if span.get("steps") else "other", rest), *parts]
                scale = length / max(length, rest + measured)
                for bucket, seconds in segments:
                    if seconds > 0:
                        bar(y, x, seconds * scale, color=COLORS[bucket], lw=0)
                        x += seconds * scale
            if failed and attempt.end > lost_from:
                bar(y, lost_from - t0, attempt.end - lost_from, facecolor=COLORS["lost"],
                    edgecolor="#d62728", hatch="xx", lw=0.5)
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
    slow = {s.rank: s.excess_per_step_s for s in result.stragglers}  # the slowest group's first
    ax.set_yticks(range(lanes), [f"rank {r}" + (f"\nstraggler +{slow[r]:.3g} s/step" if r in slow
                                                else "") for r in range(lanes)])
    ax.set_ylim(lanes - 0.5, -0.7)
    (mfu_ax if result.mfu is not None else ax).set_xlabel(
        "seconds since the first worker group started")
    ax.set_title(f"goodput {result.goodput:.1%} over {result.wall:.1f} s")
    handles = [Patch(color=COLORS[b], label=LABELS[b]) for b in BUCKETS if b != "other"]
    handles += [plt.Line2D([], [], color="black", lw=1.5, label="checkpoint taken"),
                plt.Line2D([], [], marker="v", color=COLORS["compilation"], ls="", label="compiled"),
                plt.Line2D([], [], marker="X", color="#b00000", ls="", label="failure")]
    fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.16 + 0.1 / lanes, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_mfu(result: Goodput, ax) -> None:
    """Each rank's MFU over time (a segment per span of steps, from its model FLOPs a step and
    its peak) and the run's MFU over productive time as a dashed line."""
    t0 = result.start
    for attempt in result.attempts:
        for w in attempt.workers:
            flops, peak = w.header.get("flops_per_step"), w.header.get("peak_tflops")
            if not (flops and peak):
                continue
            for span in w.spans:
                s0, s1 = float(span["t0"]), min(float(span["t1"]), attempt.end)
                if span.get("first") or not span.get("steps") or s1 <= s0:
                    continue
                value = float(flops) * int(span["steps"]) / ((s1 - s0) * float(peak) * 1e12)
                ax.hlines(100 * value, s0 - t0, s1 - t0, color=f"C{w.rank % 10}", lw=2)
    ax.axhline(100 * result.mfu, color="black", ls="--", lw=1,
               label=f"run: MFU {result.mfu:.1%}, effective {result.effective_mfu:.1%}")
    ax.set_ylabel("MFU %")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8, frameon=False)


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
        "checkpoint stall, lost to failures, restart, recovery in place, other; with model "
        "FLOPs (counted where the package prepared the model and loaded the batches, else "
        "configure_timeline(flops_per_step=...)) and a peak the MFU over productive time and "
        "effective MFU (MFU x goodput), without them why not; then one line per worker group "
        "(restarts, recoveries in place and elastic resizes start a new one, each named with "
        "how it began, its seconds and the tier it restored from), and the stragglers: ranks "
        "whose own time a step held the others back. The wall clock starts at fit(). Exits 2 when "
        "RUN_PATH holds no goodput events, 1 when its storage cannot be read or FILE cannot be "
        "written.",
    )
    goodput.add_argument("run_path", metavar="RUN_PATH",
                         help="the run's directory: RunConfig(storage_path=...)/<name>, a local "
                         "path or a URI (s3://..., gs://...)")
    goodput.add_argument("--png", metavar="FILE", default=None,
                         help="also draw the run: one lane per worker, steps in their buckets, "
                         "compilations, checkpoints, failures, restarts and stragglers, and "
                         "each rank's MFU over time (needs matplotlib)")
    goodput.add_argument("--json", action="store_true", help="print the figures as JSON")
    goodput.add_argument("--straggler-threshold", type=_share, default=0.1, metavar="SHARE",
                         help="name a rank a straggler when its median own time a step "
                         "(before the step's gradient synchronisation, over the steps every rank "
                         "measured) exceeds the other ranks' median by more than this share of "
                         "the step time (default 0.1)")
    return goodput


def cmd_goodput(args: argparse.Namespace) -> int:
    from ray_train_xla.toolkit.observability.goodput import GoodputError, goodput_of

    try:
        result = goodput_of(args.run_path, straggler_threshold=args.straggler_threshold)
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
