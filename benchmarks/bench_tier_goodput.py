"""Goodput with the memory tier against storage only: a run with a failure every 90 s.

Two Ray Train runs, one after the other, each of at least ``--minutes`` (6) of wall clock: FSDP2
over 2 CPU workers (``TorchNeuronConfig(device="cpu")``, about ``--state-mb`` of model and AdamW
state), a checkpoint to storage every ``--storage-every-s`` seconds, and a worker failure every
``--fail-every-s`` seconds (rank 1 raises; ``FailureConfig(max_failures=...)`` restarts the
group). The run's storage serves reads at 100 MB/s (a pyarrow filesystem that waits as long as
that takes). One run with ``memory_every=1`` (``keep_in_memory`` every step: the loop never
waits for it), one without. Each run's goodput is what ``ray-train-xla goodput`` prints for it.

    python benchmarks/bench_tier_goodput.py            # writes results/tier_goodput.{json,md}
    python benchmarks/bench_tier_goodput.py --only memory   # one run again, the other kept
    python benchmarks/bench_tier_goodput.py --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_memory_tier import slow_filesystem  # noqa: E402
from figures import add_output_arguments, write  # noqa: E402

MB = 1e6


def train(config):
    import torch
    from torch.distributed.fsdp import fully_shard

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import memory_tier

    torch.manual_seed(0)
    width = 1024
    layers = max(1, round(config["state_mb"] * MB / (3 * 4 * (width * width + width))))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    fully_shard(model)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-4)
    extra = rtx.load_checkpoint(model, opt)
    step = int(extra["step"]) if extra else 0
    failures = len([f for f in os.listdir(config["out"]) if f.startswith("failure")])
    fail_at = config["t0"] + config["fail_every_s"] * (failures + 1)
    last_save = time.time()
    x = torch.randn(64, width)
    tier = memory_tier()
    while time.time() < config["t0"] + config["minutes"] * 60:
        step += 1
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        if tier is not None:
            rtx.keep_in_memory(state, step)
        # the same decision on every rank: rank 0's clock
        save = rtx.broadcast(torch.tensor([int(time.time() - last_save >= config["storage_every_s"])]))
        if bool(save.item()):
            rtx.save_checkpoint(state, {"step": step})
            last_save = time.time()
        fail = rtx.broadcast(torch.tensor([int(time.time() >= fail_at)]))
        if bool(fail.item()):
            if rtx.rank() == 1:
                with open(os.path.join(config["out"], f"failure{failures}"), "w") as f:
                    f.write(str(step))
                raise RuntimeError("injected failure")
            time.sleep(30)  # Ray ends the group
    rtx.report({"step": step})


def run(memory: bool, args) -> dict:
    import sys

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if HERE not in sys.path:
        sys.path.insert(0, HERE)

    from ray_train_xla import TorchNeuronConfig
    from ray_train_xla.toolkit.observability import goodput
    from ray_train_xla.tools.cli import main as cli

    out = tempfile.mkdtemp(prefix="bench-tier-goodput-")
    storage = tempfile.mkdtemp(prefix="bench-tier-goodput-results-")
    name = "memory" if memory else "storage"
    config = TorchNeuronConfig(device="cpu", timeout_s=120, memory_every=1 if memory else None)
    t0 = time.time()
    trainer = TorchTrainer(
        train,
        train_loop_config={"out": out, "t0": t0 + 20, "minutes": args.minutes,
                           "fail_every_s": args.fail_every_s, "state_mb": args.state_mb,
                           "storage_every_s": args.storage_every_s},
        torch_config=config, scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage, name=name,
                             storage_filesystem=slow_filesystem(100 * MB),
                             failure_config=FailureConfig(max_failures=20)))
    trainer.fit()
    wall = time.time() - t0
    result = goodput.goodput_of(os.path.join(storage, name))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli(["goodput", os.path.join(storage, name)])
    ray.shutdown()
    return {"memory_tier": memory, "wall_s": wall, "goodput": result.goodput,
            "buckets_s": dict(result.buckets),
            "restores": [a.restore for a in result.attempts],
            "failures": len([f for f in os.listdir(out) if f.startswith("failure")]),
            "printed": printed.getvalue()}


def markdown(r: dict) -> str:
    lines = [
        "# Goodput with the memory tier against storage only",
        "",
        f"Two runs of {r['minutes']:.0f} minutes on a machine of {r['machine']['cpus']} CPUs: "
        f"FSDP2 over 2 CPU workers, {r['state_mb']:.0f} MB of model and AdamW state, a "
        f"checkpoint to storage every {r['storage_every_s']:.0f} s, a worker failure every "
        f"{r['fail_every_s']:.0f} s, storage read at 100 MB/s "
        "(`benchmarks/bench_tier_goodput.py`). Goodput as `ray-train-xla goodput` prints it.",
        "",
        "| run | failures | goodput | lost to failures (s) | restart (s) | restores |",
        "|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        restores = ", ".join(f"{x['tier']} {x['seconds']:.2f} s" for x in run["restores"] if x)
        lines.append(
            f"| {'memory tier (memory_every=1)' if run['memory_tier'] else 'storage only'} | "
            f"{run['failures']} | {run['goodput']:.1%} | {run['buckets_s']['lost']:.1f} | "
            f"{run['buckets_s']['restart']:.1f} | {restores or '-'} |")
    lines += ["", "What `ray-train-xla goodput` printed:", ""]
    for run in r["runs"]:
        lines += ["```", run["printed"].rstrip(), "```", ""]
    return "\n".join(lines)


def measure(args) -> dict:
    import ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    kept: dict = {}
    if args.only:  # the other run as committed (the same settings)
        with open(os.path.join(args.out, "tier_goodput.json")) as f:
            kept = {r["memory_tier"]: r for r in json.load(f)["runs"]}
    runs = []
    for memory in (True, False):
        if args.only and args.only != ("memory" if memory else "storage"):
            runs.append(kept[memory])
            continue
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        runs.append(run(memory, args))
        print({k: v for k, v in runs[-1].items() if k != "printed"}, flush=True)
    return {"minutes": args.minutes, "fail_every_s": args.fail_every_s,
            "storage_every_s": args.storage_every_s, "state_mb": args.state_mb, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--fail-every-s", type=float, default=90.0)
    parser.add_argument("--storage-every-s", type=float, default=30.0)
    parser.add_argument("--state-mb", type=float, default=200.0)
    parser.add_argument("--only", choices=("memory", "storage"),
                        help="measure this run again, the other as committed")
    add_output_arguments(parser)
    return write(parser.parse_args(argv), "tier_goodput", measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
