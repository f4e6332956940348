"""Stragglers named by ``ray-train-xla goodput`` and by rank 0's live metric: a slow rank
against its known delay, and a control with no slow rank (what the method finds where there is
nothing to find).

Ray Train fits on 2 CPU workers (``TorchXLAConfig(device="cpu")``, gloo between them) of the
examples' MLP, its model FLOPs counted with ``count_flops`` and the peak taken from the CPU's
matmul probe (what a CPU worker's timeline uses). In each fit rank 1 sleeps ``delay`` seconds
before every ``optimizer_step`` (``--delays``, 0 first: the control); every rank's step still
ends together (the all-reduce waits for it). ``--jitter J``: every step is also J seconds longer
on every rank, or not, at random (batches of two lengths, the same length on every rank in a
step, as with length-bucketed batches): own times that vary from step to step, the same on
every rank; written to ``straggler_jitter.*``. For each fit: the ranks named, the excess a step
against the delay, and the run's ``goodput`` output (MFU, effective MFU, stragglers). Live: a
thread of rank 0 reads the run's events as they stand every ``storage_interval_s`` (1 s), as
its timeline does for ``ray_train_xla_straggler_excess_seconds``, and keeps the ranks named
(``Timeline.stragglers``) and rank 1's median own time less rank 0's from the same read; the
figure is the 90% bootstrap interval of the median of those reads (``figures.interval``).

Writes ``straggler.json`` and ``straggler.md`` under ``--out``.

    python benchmarks/bench_straggler.py [--steps 300] [--delays 0 0.005 0.02] [--jitter 0.02]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time

from figures import interval

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "src")]

STORAGE_INTERVAL_S = 1.0


def watch(stop, reads: list) -> None:
    """(Rank 0, a thread) every ``STORAGE_INTERVAL_S``, what its live metric would read from the
    events as they stand: the ranks named and their excess, and rank 1's median own time less
    rank 0's (``goodput.own_times`` over the newest files, as ``live_stragglers`` reads them)."""
    from ray_train_xla.toolkit.observability import goodput, timeline
    from ray_train_xla.toolkit.run_storage import RunStorage

    tl, storage = timeline.active(), RunStorage.of_worker()
    under = tl.path(0).rsplit("/", 1)[0]
    while not stop.wait(STORAGE_INTERVAL_S):
        own = goodput.own_times(goodput.read_run(storage, under, newest=True),
                                time.time() - timeline.STRAGGLER_WINDOW_S)
        if len(own) == 2:
            reads.append({"named": tl.stragglers(), "diff_s": own[1][0] - own[0][0],
                          "steps": [own[0][2], own[1][2]]})


def loop(config: dict) -> None:
    import torch

    import ray_train_xla as rtx

    torch.manual_seed(0)
    features, hidden, batch = 64, 512, 64

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, 1))

    x, y = torch.randn(batch, features), torch.randn(batch, 1)
    flops = rtx.count_flops(lambda: torch.nn.functional.mse_loss(mlp()(x), y).backward())
    rtx.configure_timeline(samples_per_step=batch, flops_per_step=flops, interval_s=1.0,
                           storage_interval_s=STORAGE_INTERVAL_S)
    model = rtx.prepare_model(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xb, yb = x.to(rtx.get_device()), y.to(rtx.get_device())
    lengths = random.Random(0)  # the same draws on every rank
    stop, reads = threading.Event(), []
    watcher = threading.Thread(target=watch, args=(stop, reads), daemon=True)
    if rtx.rank() == 0:
        watcher.start()
    for _ in range(config["steps"]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        if lengths.random() < 0.5 and config["jitter"]:
            time.sleep(config["jitter"])
        if rtx.rank() == 1 and config["delay"]:
            time.sleep(config["delay"])
        rtx.optimizer_step(opt)
    if rtx.rank() == 0:
        stop.set()
        watcher.join()
        with open(config["live"], "w") as f:
            json.dump(reads, f)


def run(delay: float, steps: int, storage: str, jitter: float = 0.0) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig
    from ray_train_xla.toolkit.observability.goodput import goodput_of, own_times
    from ray_train_xla.tools.goodput import format_table

    name = f"delay-{delay:g}"
    live = os.path.join(storage, f"{name}.live.json")
    t0 = time.perf_counter()
    TorchTrainer(loop, train_loop_config={"delay": delay, "steps": steps, "live": live,
                                                   "jitter": jitter},
                 torch_config=TorchXLAConfig(device="cpu", timeout_s=120),
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=storage, name=name)).fit()
    fit_s = time.perf_counter() - t0
    result = goodput_of(os.path.join(storage, name))
    group = result.attempts[-1]
    own = own_times(group.workers)  # rank: (median own time a step, step time, steps)
    with open(live) as f:
        reads = json.load(f)
    diffs = [r["diff_s"] for r in reads]
    named = [r["named"] for r in reads if r["named"]]
    return {"delay_s": delay, "fit_s": fit_s, "ranks_measured": group.measured,
            "live": {"reads": len(reads), "diff_s_median": statistics.median(diffs) if diffs else None,
                     "diff_s_interval": interval(diffs) if diffs else None,
                     "diff_s_range": [min(diffs), max(diffs)] if diffs else None,
                     "named_reads": len(named),
                     "named_excess_s": {rank: [n[rank] for n in named if rank in n]
                                        for rank in sorted({k for n in named for k in n})}},
            "own_s": {str(r): v[0] for r, v in own.items()},
            "step_s": {str(r): v[1] for r, v in own.items()},
            "rank1_minus_rank0_s": own[1][0] - own[0][0] if len(own) == 2 else None,
            "named": [s.to_json() for s in group.stragglers], "mfu": result.mfu,
            "effective_mfu": result.effective_mfu, "goodput": result.goodput,
            "table": format_table(result)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.005, 0.02])
    parser.add_argument("--jitter", type=float, default=0.0)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    name = "straggler_jitter" if args.jitter else "straggler"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="rtx-bench-straggler-")
    try:
        runs = [run(d, args.steps, storage, args.jitter) for d in args.delays]
    finally:
        ray.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"steps": args.steps, "jitter_s": args.jitter, "cpus": os.cpu_count(),
                   "runs": runs}, f, indent=2)
        f.write("\n")
    rows = []
    for r in runs:
        named = ", ".join(f"rank {s['rank']}: +{s['excess_per_step_s'] * 1000:.1f} ms a step "
                          f"({(s['excess_per_step_s'] - r['delay_s']) * 1000:+.1f} ms off the delay), "
                          f"{s['excess_s']:.2f} s, {s['share']:.1%} of the run"
                          for s in r["named"]) or "none"
        step = r["step_s"].get("0")
        diff = r["rank1_minus_rank0_s"]
        rows.append(f"| {r['delay_s'] * 1000:g} ms{' (control)' if not r['delay_s'] else ''} | "
                    f"{r['ranks_measured']} | "
                    f"{'' if diff is None else f'{diff * 1000:+.1f} ms'} | {named} | "
                    f"{'' if step is None else f'{step * 1000:.1f} ms'} | "
                    f"{r['mfu'] or 0:.2%} / {r['effective_mfu'] or 0:.2%} |")
    live_rows = []
    for r in runs:
        live = r["live"]
        named = "; ".join(f"rank {rank}: {len(v)} reads, +{min(v) * 1000:.1f} to "
                          f"+{max(v) * 1000:.1f} ms" for rank, v in live["named_excess_s"].items())
        ms = (lambda v: f"{v * 1000:+.1f}")  # noqa: E731
        diff = ("" if live["diff_s_median"] is None else
                f"{ms(live['diff_s_median'])} ms [{ms(live['diff_s_interval'][0])}, "
                f"{ms(live['diff_s_interval'][1])}] (reads from {ms(live['diff_s_range'][0])} to "
                f"{ms(live['diff_s_range'][1])})")
        live_rows.append(f"| {r['delay_s'] * 1000:g} ms{' (control)' if not r['delay_s'] else ''} | "
                         f"{live['reads']} | {diff} | {live['named_reads']}: {named or 'none'} |")
    threshold = 0.1 * (runs[0]["step_s"].get("0") or 0.0)
    jittered = (f"; every step is {args.jitter * 1000:g} ms longer on every rank, or not, at "
                "random (batches of two lengths, the same on every rank in a step)"
                if args.jitter else "")
    last = runs[-1]
    md = f"""# Stragglers: a slow rank named, against its known delay

Command: `python benchmarks/bench_straggler.py --steps {args.steps} --delays \
{' '.join(f'{d:g}' for d in args.delays)}{f' --jitter {args.jitter:g}' if args.jitter else ''}`. \
Ray Train on 2 CPU workers
(`TorchXLAConfig(device="cpu")`, gloo), {os.cpu_count()} CPU cores; the examples' kind of MLP
(64 -> 512 -> 512 -> 1, batch 64), model FLOPs by `count_flops`, the peak from the CPU's matmul
probe{jittered}. Rank 1 sleeps the delay before every `optimizer_step`; the first fit has none (the
control: the difference it finds between the ranks is the method's noise; 10% of the step
time, the threshold, is {threshold * 1000:.1f} ms in the control). Every rank's median own time
is taken over the steps every rank measured.

`ray-train-xla goodput`, after each fit:

| delay | ranks measured | own time a step, rank 1 - rank 0 (medians) | \
named (excess a step, its error, in all, share of the run) | step time | MFU / effective MFU |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Live, during each fit: rank 0 read every rank's newest events every {STORAGE_INTERVAL_S:g} s as
its `ray_train_xla_straggler_excess_seconds` does (the files lag each other by up to that):

| delay | reads | rank 1 - rank 0, median of the reads [90% interval] | \
reads that named a rank: the excess named |
|---|---|---|---|
{chr(10).join(live_rows)}

The run with the longest delay, as `ray-train-xla goodput` prints it:

```text
{last['table'].replace(storage + '/', '')}
```
"""
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
