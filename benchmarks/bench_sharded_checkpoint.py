"""Sharded checkpoints: the training stall of a synchronous save against an asynchronous one,
and the bytes each rank writes (sharded) against what one rank writes when it gathers the model.

One Ray node on this machine (``ray.cluster_utils.Cluster``), one SPMD worker with 2 virtual
XLA CPU devices (several SPMD workers on the CPU are refused: each one's mesh would be its own),
an FSDPv2 MLP of at least 100 MB of parameters (plain SGD: the
parameters are the whole state). Each worker times plain steps, then windows of one
``save_checkpoint`` call followed by ``WINDOW`` steps, alternating ``wait=True`` ("sync": the
call returns once the checkpoint is written and reported) and the default ("async": written and
reported by the background reporter), each right after ``WINDOW`` plain steps. The stall of a
window is its time minus that of the plain steps before it; the figure is the median async
stall over the median sync stall (target < 0.5). The time of the ``save_checkpoint`` call
itself is reported too.

Writes ``sharded_checkpoint.json`` and ``sharded_checkpoint.md`` under --out.

    python benchmarks/bench_sharded_checkpoint.py [--quick] [--reps N] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WINDOW = 6


def bench_train(config):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import ray_train_xla as rtx

    hidden, layers, batch = config["hidden"], config["layers"], 16
    torch.manual_seed(0)
    model = rtx.prepare_sharded_model(torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh()) for _ in range(layers)]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    mesh = model._mesh
    x = torch.randn(batch, hidden)

    def step():
        opt.zero_grad()
        model(rtx.shard_batch(x, mesh)).pow(2).mean().backward()
        opt.step()
        torch_xla.sync()

    def steps(n):
        start = time.perf_counter()
        for _ in range(n):
            step()
        xm.wait_device_ops()
        return time.perf_counter() - start

    steps(3)  # compile
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plain, stalls = [], {"sync": [], "async": []}
    calls = {"sync": [], "async": []}
    written = []
    for rep in range(config["reps"]):
        for mode in ("sync", "async"):
            # A plain window right before each checkpoint window: the machine's load drifts, so
            # each stall is measured against its neighbour.
            before = steps(WINDOW)
            plain.append(before / WINDOW)
            start = time.perf_counter()
            out = rtx.save_checkpoint({"model": model.state_dict(), "step": rep}, {"rep": rep},
                                      wait=mode == "sync")
            calls[mode].append(time.perf_counter() - start)
            if out:
                written.append(out["bytes"])
            stalls[mode].append(time.perf_counter() - start + steps(WINDOW) - before)
            time.sleep(config["settle_s"])  # let the previous async write finish before timing again
    record = {
        "rank": rtx.rank(),
        "state_bytes": state_bytes,
        "plain_step_s": statistics.median(plain),
        "stall_s": stalls,
        "save_call_s": calls,
        "sharded_bytes_written": written,
    }
    with open(os.path.join(config["out_dir"], f"rank{rtx.rank()}.json"), "w") as f:
        json.dump(record, f)
    rtx.report({"done": 1})


def run(quick: bool, reps: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    hidden, layers = (512, 4) if quick else (2048, 7)
    out_dir = tempfile.mkdtemp(prefix="rtx-bench-ckpt-")
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=2, resources={"slot": 2}, include_dashboard=False)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}})
        storage = tempfile.mkdtemp(prefix="rtx-bench-ckpt-results-")
        result = TorchTrainer(
            bench_train,
            train_loop_config={"hidden": hidden, "layers": layers, "reps": reps, "out_dir": out_dir,
                               "settle_s": 1.0 if quick else 5.0},
            torch_config=TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=2, timeout_s=300),
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "slot": 2}),
            run_config=RunConfig(storage_path=storage),
        ).fit()
        ckpt = result.checkpoint.path
        files = {f: os.path.getsize(os.path.join(ckpt, f)) for f in sorted(os.listdir(ckpt))}
    finally:
        ray.shutdown()
        cluster.shutdown()
    ranks = []
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            ranks.append(json.load(f))
    sync = statistics.median(s for r in ranks for s in r["stall_s"]["sync"])
    async_ = statistics.median(s for r in ranks for s in r["stall_s"]["async"])
    call_sync = statistics.median(s for r in ranks for s in r["save_call_s"]["sync"])
    call_async = statistics.median(s for r in ranks for s in r["save_call_s"]["async"])
    state = ranks[0]["state_bytes"]
    per_rank = [statistics.median(r["sharded_bytes_written"]) for r in ranks]
    return {
        "quick": quick,
        "reps": reps,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": {"hidden": hidden, "layers": layers, "state_bytes": state},
        "workers": len(ranks),
        "stall_sync_s": sync,
        "stall_async_s": async_,
        "async_over_sync": async_ / sync if sync > 0 else None,
        "save_call_sync_s": call_sync,
        "save_call_async_s": call_async,
        "save_call_async_over_sync": call_async / call_sync,
        "bytes_per_rank_sharded": per_rank,
        "bytes_gathered": state,  # what one rank writes when it gathers the full model
        "sharded_over_gathered": [b / state for b in per_rank],
        "last_checkpoint_files": files,
        "ranks": ranks,
    }


def _ratio(value) -> str:
    return "n/a (no sync stall measured above the noise)" if value is None else f"{value:.2f}"


def to_markdown(res: dict) -> str:
    mb = 1024 * 1024
    lines = [
        "# Sharded checkpoint benchmark",
        "",
        f"FSDPv2 MLP, {res['model']['state_bytes'] / mb:.1f} MB of state, {res['workers']} SPMD workers "
        f"(2 XLA CPU devices each), {res['reps']} repetitions"
        f"{' (quick)' if res['quick'] else ''}; {res['machine']['cpus']} CPU cores.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| stall of a save, sync (s) | {res['stall_sync_s']:.3f} |",
        f"| stall of a save, async (s) | {res['stall_async_s']:.3f} |",
        f"| **async / sync** (target < 0.5) | **{_ratio(res['async_over_sync'])}** |",
        f"| save_checkpoint call, sync / async (s) | {res['save_call_sync_s']:.3f} / "
        f"{res['save_call_async_s']:.3f} (ratio {res['save_call_async_over_sync']:.2f}) |",
        f"| bytes written per rank, sharded (MB) | "
        f"{', '.join(f'{b / mb:.1f}' for b in res['bytes_per_rank_sharded'])} |",
        f"| bytes written by one rank, gathered (MB) | {res['bytes_gathered'] / mb:.1f} |",
        f"| **sharded / gathered per rank** (about 1/{res['workers']}) | "
        f"**{', '.join(f'{r:.2f}' for r in res['sharded_over_gathered'])}** |",
        "",
        "Stall: time of one save_checkpoint call plus the next steps, minus the same number of "
        "plain steps timed just before (the machine is shared: absolute times drift). "
        "One SPMD worker writes every shard here: several SPMD workers on the CPU are refused "
        "(each one's mesh would be its own), so the bytes per rank of a multi-host mesh are "
        "not measured on this machine.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, for the test suite")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    res = run(args.quick, args.reps)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sharded_checkpoint.json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(args.out, "sharded_checkpoint.md"), "w") as f:
        f.write(to_markdown(res))
    print(f"async/sync stall {_ratio(res['async_over_sync'])}; sharded/gathered bytes per rank "
          f"{[round(r, 2) for r in res['sharded_over_gathered']]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
