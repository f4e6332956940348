"""The CPU development mode's all_reduce against plain gloo, side by side (``ray-train-xla
check``'s bandwidth step on the CPU).

One Ray Train fit of 2 workers under ``TorchXLAConfig(device="cpu")``, the development mode:
the default process group (``xla_host``) carries XLA tensors by copying them to the host, running
gloo, and copying the result back. In the same workers, a plain gloo group all-reduces CPU
tensors of the same size. For every size from 1 KiB to 256 MiB, the two sides alternate over
``--reps`` rounds; each round times ``check_steps.iterations(size)`` all-reduces after one
untimed one (what the check does). Reported: the median time, algbw and busbw as nccl-tests
define them (``check_report.bus_bandwidth``), and the ratio of the development mode's busbw to
gloo's. The target: at least 0.8 from 1 MiB up. Where the difference goes: rank 0 also times,
at every size and with the other rank idle, the three steps the development mode adds around
gloo: the device-to-host transfer (after the graph runs), the host-to-device transfer of the
result, and the graph that copies it into the tensor in place.

Writes ``collectives.json`` and ``collectives.md`` under ``--out``.

    python benchmarks/bench_collectives.py [--reps 3] [--max-bytes 268435456] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "src")]

TARGET = 0.8
TARGET_FROM = 1 << 20


def timed(all_reduce, tensor, reps: int, wait) -> float:
    """Seconds per all-reduce of ``tensor``: the mean of ``reps`` after one untimed one."""
    all_reduce(tensor)
    wait()
    start = time.perf_counter()
    for _ in range(reps):
        all_reduce(tensor)
    wait()
    return (time.perf_counter() - start) / reps


def bridge_steps(tensor, reps: int, wait) -> dict:
    """Seconds of each step the development mode adds to a gloo all_reduce of ``tensor``."""
    import torch

    import ray_train_xla as rtx

    host = tensor.detach().to("cpu", copy=True)
    out = {}
    for name, step in (
        ("to_host_s", lambda: tensor.detach().to("cpu", copy=True)),
        ("to_device_s", lambda: host.to(tensor.device)),
    ):
        out[name] = [timed(lambda _t, step=step: step(), None, reps, wait)]
    result = host.to(tensor.device)

    def copy_in(_t):
        with torch.no_grad():
            tensor.copy_(result)
        rtx.sync()

    out["copy_in_s"] = [timed(copy_in, None, reps, wait)]
    return out


def bench_loop(config: dict) -> None:
    """On every worker: both sides at every size, alternating, ``reps`` rounds."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import ray_train_xla as rtx
    from ray_train_xla.tools.check_steps import iterations

    device = rtx.get_device()
    gloo = distributed_c10d.new_group(backend="gloo")  # torch's own (every rank)
    rows = []

    def devmode(t):
        dist.all_reduce(t)
        rtx.sync()

    def plain(t):
        dist.all_reduce(t, group=gloo)

    def xla_wait():
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    size = config["min_bytes"]
    while size <= config["max_bytes"]:
        n = size // 4
        on_device = torch.ones(n, dtype=torch.float32).to(device)
        on_host = torch.ones(n, dtype=torch.float32)
        times = {"devmode": [], "gloo": []}
        for _ in range(config["reps"]):
            dist.barrier(group=gloo)
            times["devmode"].append(timed(devmode, on_device, iterations(size), xla_wait))
            dist.barrier(group=gloo)
            times["gloo"].append(timed(plain, on_host, iterations(size), lambda: None))
        row = {"bytes": size, **times}
        dist.barrier(group=gloo)
        if rtx.rank() == 0:
            row.update(bridge_steps(on_device, iterations(size), xla_wait))
        dist.barrier(group=gloo)
        rows.append(row)
        del on_device, on_host
        size *= 2
    if rtx.rank() == 0:
        with open(config["out_file"], "w") as f:
            json.dump(rows, f)


def run(reps: int, min_bytes: int, max_bytes: int) -> list[dict]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.json")
        ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
        try:
            TorchTrainer(
                bench_loop,
                train_loop_config={"reps": reps, "min_bytes": min_bytes, "max_bytes": max_bytes,
                                   "out_file": out_file},
                torch_config=TorchXLAConfig(device="cpu", timeout_s=600),
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(storage_path=tmp, name="bench_collectives"),
            ).fit()
        finally:
            ray.shutdown()
        with open(out_file) as f:
            return json.load(f)


def summarise(raw: list[dict], ranks: int = 2) -> list[dict]:
    from ray_train_xla.tools.check_report import bus_bandwidth

    out = []
    for r in raw:
        row = {"bytes": r["bytes"]}
        for side in ("devmode", "gloo"):
            t = statistics.median(r[side])
            row[f"{side}_s"] = t
            row[f"{side}_s_all"] = r[side]
            row[f"{side}_busbw"] = bus_bandwidth("all_reduce", r["bytes"], t, ranks)[1]
        row["ratio"] = row["devmode_busbw"] / row["gloo_busbw"]
        for step in ("to_host_s", "to_device_s", "copy_in_s"):
            row[step] = statistics.median(r[step]) if step in r else None
        out.append(row)
    return out


def write(rows: list[dict], out_dir: str, reps: int) -> None:
    import platform

    import torch

    met = [r for r in rows if r["bytes"] >= TARGET_FROM]
    worst = min(met, key=lambda r: r["ratio"]) if met else None
    load = os.getloadavg()[0]
    doc = {"rows": rows, "reps": reps, "target": TARGET, "target_from_bytes": TARGET_FROM,
           "worst_from_target": worst, "met": all(r["ratio"] >= TARGET for r in met),
           "load_at_start": load, "cpus": os.cpu_count(), "torch": torch.__version__,
           "python": platform.python_version()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "collectives.json"), "w") as f:
        json.dump(doc, f, indent=1)
    lines = [
        "# Development mode all_reduce against plain gloo (CPU, 2 workers)", "",
        f"Median of {reps} alternating rounds per size; busbw as nccl-tests define it "
        "(all_reduce: algbw x 2(n-1)/n). Development mode: XLA tensors through the `xla_host` "
        "process group (device -> host copy, gloo, host -> device copy). gloo: CPU tensors "
        f"through a plain gloo group of the same workers. {os.cpu_count()} CPUs, load "
        f"{load:.2f} at the start.", "",
        f"Target: ratio >= {TARGET} from {TARGET_FROM >> 20} MiB up: "
        + ("met." if doc["met"] else
           f"not met (worst {worst['ratio']:.2f} at {worst['bytes']} B)." if worst else "n/a."),
        "",
        "Where the difference goes: rank 0's own time (the other rank idle) for each step the "
        "development mode adds around gloo: the device-to-host transfer, the host-to-device "
        "transfer of the result, and the in-place copy graph.", "",
        "| size | devmode (us) | gloo (us) | devmode busbw (GB/s) | gloo busbw (GB/s) | ratio "
        "| to host (us) | to device (us) | copy in (us) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        size = r["bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(f"| {label} | {r['devmode_s'] * 1e6:.0f} | {r['gloo_s'] * 1e6:.0f} | "
                     f"{r['devmode_busbw']:.3f} | {r['gloo_busbw']:.3f} | {r['ratio']:.2f} | "
                     + " | ".join("-" if r[k] is None else f"{r[k] * 1e6:.0f}"
                                  for k in ("to_host_s", "to_device_s", "copy_in_s")) + " |")
    with open(os.path.join(out_dir, "collectives.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-bytes", type=int, default=1 << 10)
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    rows = summarise(run(args.reps, args.min_bytes, args.max_bytes))
    write(rows, args.out, args.reps)
    print(open(os.path.join(args.out, "collectives.md")).read())


if __name__ == "__main__":
    main()
