"""Stragglers named by ``ray-train-xla goodput``: a slow rank against its known delay, and a
control with no slow rank (what the method finds where there is nothing to find).

Ray Train fits on 2 CPU workers (``TorchXLAConfig(device="cpu")``, gloo between them) of the
examples' MLP, its model FLOPs counted with ``count_flops`` and the peak taken from the CPU's
matmul probe (what a CPU worker's timeline uses). In each fit rank 1 sleeps ``delay`` seconds
before every ``optimizer_step`` (``--delays``, 0 first: the control); every rank's step still
ends together (the all-reduce waits for it). For each fit: the ranks named, the excess a step
against the delay, and the run's ``goodput`` output (MFU, effective MFU, stragglers).

Writes ``straggler.json`` and ``straggler.md`` under ``--out``.

    python benchmarks/bench_straggler.py [--steps 60] [--delays 0 0.005 0.02] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "src")]


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
                           storage_interval_s=2.0)
    model = rtx.prepare_model(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xb, yb = x.to(rtx.get_device()), y.to(rtx.get_device())
    for _ in range(config["steps"]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        if rtx.rank() == 1 and config["delay"]:
            time.sleep(config["delay"])
        rtx.optimizer_step(opt)


def run(delay: float, steps: int, storage: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig
    from ray_train_xla.toolkit.observability.goodput import goodput_of, own_times
    from ray_train_xla.tools.goodput import format_table

    name = f"delay-{delay:g}"
    t0 = time.perf_counter()
    TorchTrainer(loop, train_loop_config={"delay": delay, "steps": steps},
                 torch_config=TorchXLAConfig(device="cpu", timeout_s=120),
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=storage, name=name)).fit()
    fit_s = time.perf_counter() - t0
    result = goodput_of(os.path.join(storage, name))
    group = result.attempts[-1]
    own = own_times(group.workers)  # rank: (median own time a step, step time, steps)
    return {"delay_s": delay, "fit_s": fit_s, "ranks_measured": group.measured,
            "own_s": {str(r): v[0] for r, v in own.items()},
            "step_s": {str(r): v[1] for r, v in own.items()},
            "rank1_minus_rank0_s": own[1][0] - own[0][0] if len(own) == 2 else None,
            "named": [s.to_json() for s in group.stragglers], "mfu": result.mfu,
            "effective_mfu": result.effective_mfu, "goodput": result.goodput,
            "table": format_table(result)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.005, 0.02])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    storage = tempfile.mkdtemp(prefix="rtx-bench-straggler-")
    try:
        runs = [run(d, args.steps, storage) for d in args.delays]
    finally:
        ray.shutdown()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "straggler.json"), "w") as f:
        json.dump({"steps": args.steps, "cpus": os.cpu_count(), "runs": runs}, f, indent=2)
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
    last = runs[-1]
    md = f"""# Stragglers: a slow rank named, against its known delay

Command: `python benchmarks/bench_straggler.py --steps {args.steps} --delays \
{' '.join(f'{d:g}' for d in args.delays)}`. Ray Train on 2 CPU workers
(`TorchXLAConfig(device="cpu")`, gloo), {os.cpu_count()} CPU cores; the examples' kind of MLP
(64 -> 512 -> 512 -> 1, batch 64), model FLOPs by `count_flops`, the peak from the CPU's matmul
probe. Rank 1 sleeps the delay before every `optimizer_step`; the first fit has none (the
control: the difference it finds between the ranks is the method's noise; 10% of the step
time, the threshold, is about 3 ms here).

| delay | ranks measured | own time a step, rank 1 - rank 0 (medians) | \
named (excess a step, its error, in all, share of the run) | step time | MFU / effective MFU |
|---|---|---|---|---|---|
{chr(10).join(rows)}

The run with the longest delay, as `ray-train-xla goodput` prints it:

```text
{last['table'].replace(storage + '/', '')}
```
"""
    with open(os.path.join(args.out, "straggler.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
