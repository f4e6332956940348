"""Goodput by way of recovery: a run with a failure every 90 s, recovered in place, by a
restart of the group from the memory tier, or from storage only.

Ray Train runs, one after the other, each of at least ``--minutes`` (6) of wall clock: FSDP2
over 2 CPU workers (``TorchNeuronConfig(device="cpu")``, about ``--state-mb`` of model and AdamW
state), a checkpoint to storage every ``--storage-every-s`` seconds, and a worker failure every
``--fail-every-s`` seconds. The run's storage serves reads at 100 MB/s (a pyarrow filesystem
that waits as long as that takes). The runs (``RUNS``):

- ``in_place``: ``memory_every=1``, ``recovery="in_place"``, ``rtx.recoverable(train)``; rank 1
  raises, and every rank recovers in its own process;
- ``killed``: the same config, rank 1's process killed (SIGKILL): the others cannot recover
  without it, and Ray Train restarts the group, from the memory tier;
- ``memory``: ``memory_every=1``, rank 1 raises, Ray Train restarts the group
  (``FailureConfig(max_failures=...)``) and the new one restores from memory;
- ``storage``: the same without the memory tier: it restores from storage.

Each run's goodput is what ``ray-train-xla goodput`` prints for it, with each recovery's kind and
seconds (from the failure to the end of the first step after it).

    python benchmarks/bench_tier_goodput.py            # writes results/tier_goodput.{json,md}
    python benchmarks/bench_tier_goodput.py --only in_place   # one run again, the others kept
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
RUNS = ("in_place", "killed", "memory", "storage")
LABELS = {"in_place": "recovery in place (rank 1 raises)",
          "killed": "recovery in place configured, rank 1 killed (SIGKILL)",
          "memory": "memory tier (memory_every=1), group restart",
          "storage": "storage only, group restart"}


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
    end = config["t0"] + config["minutes"] * 60
    # the same decision on every rank: rank 0's clock (a rank that left the loop alone would
    # leave the other's failure to a restart of the group)
    while bool(rtx.broadcast(torch.tensor([int(time.time() < end)])).item()):
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
                if config["kill"]:
                    os.kill(os.getpid(), 9)
                raise RuntimeError("injected failure")
            if not config["in_place"]:
                time.sleep(30)  # Ray ends the group
            fail_at = float("inf")  # (in place: the next collective fails, and every rank
            # re-enters the function, which counts the failures again)
    rtx.report({"step": step})


def run(name: str, args) -> dict:
    import sys

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if HERE not in sys.path:
        sys.path.insert(0, HERE)

    import ray_train_xla as rtx
    from ray_train_xla import TorchNeuronConfig
    from ray_train_xla.toolkit.observability import goodput
    from ray_train_xla.tools.cli import main as cli

    out = tempfile.mkdtemp(prefix="bench-tier-goodput-")
    storage = tempfile.mkdtemp(prefix="bench-tier-goodput-results-")
    in_place = name in ("in_place", "killed")
    config = TorchNeuronConfig(device="cpu", timeout_s=120,
                               memory_every=None if name == "storage" else 1,
                               recovery="in_place" if in_place else "restart",
                               max_in_place_restarts=20)
    t0 = time.time()
    trainer = TorchTrainer(
        rtx.recoverable(train) if in_place else train,
        train_loop_config={"out": out, "t0": t0 + 20, "minutes": args.minutes,
                           "fail_every_s": args.fail_every_s, "state_mb": args.state_mb,
                           "storage_every_s": args.storage_every_s, "in_place": in_place,
                           "kill": name == "killed"},
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
    recoveries = [goodput.recovery_of(result, i) for i in range(1, len(result.attempts))]
    return {"name": name, "memory_tier": name != "storage", "wall_s": wall,
            "goodput": result.goodput, "buckets_s": dict(result.buckets),
            "restores": [a.restore for a in result.attempts], "recoveries": recoveries,
            "failures": len([f for f in os.listdir(out) if f.startswith("failure")]),
            "printed": printed.getvalue()}


def _name(run: dict) -> str:
    """A run's name (results written before the in-place runs name none)."""
    return run.get("name") or ("memory" if run["memory_tier"] else "storage")


def markdown(r: dict) -> str:
    lines = [
        "# Goodput by way of recovery",
        "",
        f"Runs of {r['minutes']:.0f} minutes on a machine of {r['machine']['cpus']} CPUs: "
        f"FSDP2 over 2 CPU workers, {r['state_mb']:.0f} MB of model and AdamW state, a "
        f"checkpoint to storage every {r['storage_every_s']:.0f} s, a worker failure every "
        f"{r['fail_every_s']:.0f} s, storage read at 100 MB/s "
        "(`benchmarks/bench_tier_goodput.py`). Goodput as `ray-train-xla goodput` prints it; "
        "a recovery's seconds run from the failure to the end of the first step after it "
        "(median [min, max] over the run's recoveries).",
        "",
        "| run | failures | goodput | lost to failures (s) | restart (s) | recovery in place (s) "
        "| recovery, each | restores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in sorted(r["runs"], key=lambda x: RUNS.index(_name(x))):
        restores = ", ".join(f"{x['tier']} {x['seconds']:.2f} s" for x in run["restores"] if x)
        took = sorted(x["seconds"] for x in run.get("recoveries") or [] if x and x["seconds"])
        kinds = sorted({x["kind"] for x in run.get("recoveries") or [] if x})
        each = (f"{', '.join(kinds)}: {took[len(took) // 2]:.1f} s [{took[0]:.1f}, "
                f"{took[-1]:.1f}]" if took else "-")
        lines.append(
            f"| {LABELS[_name(run)]} | {run['failures']} | {run['goodput']:.1%} | "
            f"{run['buckets_s']['lost']:.1f} | {run['buckets_s']['restart']:.1f} | "
            f"{run['buckets_s'].get('recovery', 0.0):.1f} | {each} | {restores or '-'} |")
    lines += ["", "What `ray-train-xla goodput` printed:", ""]
    for run in r["runs"]:
        lines += ["```", run["printed"].rstrip(), "```", ""]
    return "\n".join(lines)


def measure(args) -> dict:
    import ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    kept: dict = {}
    if args.only:  # the other runs as committed (the same settings)
        with open(os.path.join(args.out, "tier_goodput.json")) as f:
            kept = {_name(r): r for r in json.load(f)["runs"]}
    runs = []
    for name in RUNS:
        if args.only and name not in args.only:
            if name in kept:
                runs.append(kept[name])
            continue
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        runs.append(run(name, args))
        print({k: v for k, v in runs[-1].items() if k != "printed"}, flush=True)
    return {"minutes": args.minutes, "fail_every_s": args.fail_every_s,
            "storage_every_s": args.storage_every_s, "state_mb": args.state_mb, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6.0)
    parser.add_argument("--fail-every-s", type=float, default=90.0)
    parser.add_argument("--storage-every-s", type=float, default=30.0)
    parser.add_argument("--state-mb", type=float, default=200.0)
    parser.add_argument("--only", nargs="+", choices=RUNS,
                        help="measure these runs again, the others as committed")
    add_output_arguments(parser)
    return write(parser.parse_args(argv), "tier_goodput", measure, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
