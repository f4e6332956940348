"""The step timeline's cost against the MLP step, side by side in one process.

Two measurements, no Ray:

- **per step, exactly**: what the timeline adds to one step on the training thread, timed over
  many calls: the step hook at ``step_done`` (clock, compile counter, buffer append), the
  arrival at the step's gradient synchronisation (``events.arrived``: a clock read, for the
  stragglers) and the loader's wrapper (two clock reads and a look at the batch's first tensor,
  its tokens or rows, for the model FLOPs), with the timeline on, less the same calls with it
  off, on the example's batch;
- **side by side**: the example's MLP (``examples/train_mlp.py``: ``prepare_data_loader``,
  ``prepare_model``, ``optimizer_step``) on the XLA CPU device, rounds with the timeline on and
  off alternating in the same process (its background thread running, every 0.5 s here rather
  than 5 s, to be seen, with TFLOP/s and MFU on: the model FLOPs the timeline counts itself and
  the CPU's probed peak), steps/s per round.

The target is a cost of at most 1% of the MLP step. Writes ``timeline.json`` and ``timeline.md``.

    python benchmarks/bench_timeline.py [--rounds 8] [--steps 400] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src", "ray_train_xla", "tools", "examples"))


def hook_cost_us(calls: int) -> dict:
    """Microseconds the timeline adds per step: the step hook and the loader wrapper, with the
    timeline on, less the same with it off (the median of 7 alternating runs each)."""
    import torch

    from ray_train_xla.toolkit import data, events, steps
    from ray_train_xla.toolkit.observability import timeline

    batch = (torch.zeros(32, 8), torch.zeros(32, 1))  # the example's batch (32 rows of 8)
    batches = [batch] * calls

    def run() -> float:
        t0 = time.perf_counter()
        for _ in data._timed(batches):
            events.arrived()
            steps.step_done()
        return (time.perf_counter() - t0) / calls * 1e6

    def plain() -> float:
        t0 = time.perf_counter()
        for _ in iter(batches):
            events.arrived()
            steps.step_done()
        return (time.perf_counter() - t0) / calls * 1e6

    timeline.begin()
    try:
        run()  # the first reads of torch_xla's counters initialise them: not a step's cost
    finally:
        timeline.end()
    off, on = [], []
    for _ in range(7):  # alternating: the machine's load drifts
        off.append(plain())
        timeline.begin()
        try:
            on.append(run())
        finally:
            timeline.end()
    return {"on_us": statistics.median(on), "off_us": statistics.median(off),
            "cost_us": statistics.median(on) - statistics.median(off)}


def mlp_rounds(rounds: int, steps: int) -> dict:
    import torch
    import torch_xla.core.xla_model as xm
    from train_mlp import default_config

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.observability import timeline

    config = default_config()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["samples"], config["features"], generator=g)
    y = torch.sin(x).sum(1, keepdim=True)
    loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=config["batch_size"], shuffle=True))
    model = rtx.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(config["features"], config["hidden"]), torch.nn.ReLU(),
        torch.nn.Linear(config["hidden"], 1)))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])

    def run(n: int) -> float:
        done = 0
        xm.wait_device_ops()
        t0 = time.perf_counter()
        while done < n:
            for xb, yb in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                rtx.optimizer_step(opt)
                done += 1
                if done == n:
                    break
        xm.wait_device_ops()
        return n / (time.perf_counter() - t0)

    run(50)  # compile and warm up
    from ray_train_xla.toolkit.observability.flops import cpu_peak_tflops

    peak = cpu_peak_tflops()  # the CPU's matmul probe, as a CPU worker's timeline takes it
    # The model FLOPs: the timeline counts them itself (the model prepare_model prepared, 6 x
    # its trainable parameters a sample of prepare_data_loader's batches).
    timeline.configure_timeline(interval_s=0.5, peak_tflops=peak)
    on, off = [], []
    for i in range(rounds):
        for kind in (("on", "off") if i % 2 else ("off", "on")):
            if kind == "on":
                timeline.begin()
                try:
                    on.append(run(steps))
                    tl_metrics = timeline.report_metrics()
                finally:
                    timeline.end()
            else:
                off.append(run(steps))
    ratios = [a / b for a, b in zip(on, off)]
    return {"steps_per_s_on": on, "steps_per_s_off": off, "ratio_on_over_off": ratios,
            "median_on": statistics.median(on), "median_off": statistics.median(off),
            "median_ratio": statistics.median(ratios), "best_ratio": max(on) / max(off),
            "ms_per_step_off": 1000 / statistics.median(off),
            "last_timeline_metrics": tl_metrics,
            "flops_per_step": tl_metrics.get("timeline/flops_per_step"), "peak_tflops": peak,
            "batch_size": config["batch_size"],
            "hidden": config["hidden"], "features": config["features"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")

    hook = hook_cost_us(args.calls)
    mlp = mlp_rounds(args.rounds, args.steps)
    step_us = mlp["ms_per_step_off"] * 1000
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rounds": args.rounds, "steps_per_round": args.steps, "calls": args.calls,
        "hook": hook, "mlp": mlp,
        "cost_share_of_step": hook["cost_us"] / step_us,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    lo, hi = min(mlp["ratio_on_over_off"]), max(mlp["ratio_on_over_off"])
    md = f"""# Step timeline: its cost against the MLP step

Command: `python benchmarks/bench_timeline.py --rounds {args.rounds} --steps {args.steps}`. One
process, no Ray, XLA CPU device; {result['machine']['cpus']} CPU cores.

| figure | value |
|---|---|
| timeline's cost per step, on the training thread (us) | {hook['cost_us']:.2f} |
| (step hook, arrival and loader wrapper: on {hook['on_us']:.2f} us, \
off {hook['off_us']:.2f} us, per call) | |
| MLP step, timeline off (ms) | {mlp['ms_per_step_off']:.3f} |
| **cost / MLP step** (target <= 1%) | **{result['cost_share_of_step']:.3%}** |
| MLP steps/s, timeline on / off (median of {args.rounds} alternating rounds) | \
{mlp['median_on']:.1f} / {mlp['median_off']:.1f} |
| on / off per round, median [min-max] | {mlp['median_ratio']:.3f} [{lo:.3f}-{hi:.3f}] |
| fastest round on / fastest round off | {mlp['best_ratio']:.3f} |
| the last round's `timeline/tflops_per_s`, `timeline/mfu` \
({mlp['flops_per_step']:.4g} FLOPs a step, counted by the timeline: \
{mlp['last_timeline_metrics'].get('timeline/flops_from')}; the CPU probe's peak \
{mlp['peak_tflops']:.3g} TFLOP/s) | \
{mlp['last_timeline_metrics'].get('timeline/tflops_per_s', 0):.3g}, \
{mlp['last_timeline_metrics'].get('timeline/mfu', 0):.3%} |

The first figure is exact: what the step hook (`step_done`: wall clock, compile counter,
buffer append), the arrival at the gradient synchronisation (`events.arrived`: a clock read)
and the loader wrapper (two clock reads, and the tokens or rows of the batch's first tensor) add
per step, over {args.calls:,} calls of the example's batch. TFLOP/s and MFU add nothing else on
the step: they are computed where `metrics()` and the background thread read the window. The
rounds run the example's MLP (`prepare_data_loader`, `prepare_model`, `optimizer_step`) with the
timeline on and off in turn, with the model FLOPs it counts and a peak, its background thread
waking every 0.5 s (5 s by default); on a shared 2-core machine their spread is wider than the
cost measured above (the fastest rounds, the least disturbed, compare best).
"""
    with open(os.path.join(args.out, "timeline.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
