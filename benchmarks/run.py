"""Benchmarks of ray-train-xla against the alternatives, side by side, ratios reported.

Four figures, each measured in one run with A and B alternating over several repetitions; the
median of each side and the ratio A/B are reported (on a noisy, shared machine the ratios are
what to compare, not the absolute times):

1. startup     TorchTrainer.fit() wall time of a one-step XLA training function: our
               TorchXLAConfig(device="cpu"), TorchConfig(backend="gloo"), and Ray's own
               ray.train.torch.xla.TorchXLAConfig (1 worker; its error is recorded if it fails).
2. throughput  steps/s of the example MLP, and of a heavier MLP (a step about 10x longer): the
               toolkit as the example uses it (prepare_data_loader, prepare_model,
               optimizer_step and metrics() every step, save_checkpoint every N steps) in a
               1-worker Ray fit, against a bare torch_xla loop in one process without Ray,
               and against the same bare loop inside the Ray worker (timed after warm-up,
               inside the loop); plus where a step's host time goes (step_profile).
3. recompile   XLA compilations over 3 epochs with a ragged last batch: prepare_data_loader
               against a naive DataLoader loop (in-process, no Ray).
4. grad_sync   optimizer_step with 2 CPU workers on a ~10M-parameter MLP, split into compute
               and communication: bucketed gradients against one bucket per parameter.

Writes results.json, results.md and ratios.png under --out and prints one line per figure.

    python benchmarks/run.py [--quick] [--reps N] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PER_PARAMETER_MB = 1e-9  # a bucket size smaller than any tensor: one bucket per parameter
# What a child process (--task, run by in_subprocess) can measure.
TASKS = ("quick_bare", "throughput_bare", "throughput_bare_mp", "profile_step", "recompile_ours",
         "recompile_naive")


def log(message: str) -> None:
    print(message, flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------------------------
# Training functions (module level: Ray workers run them).
# --------------------------------------------------------------------------------------------


def one_step(config: dict) -> None:
    """One tiny training step on the XLA device: the same function for every startup config."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # the gloo baseline plans no XLA environment
    import torch
    import torch_xla

    device = torch_xla.device()
    model = torch.nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4, device=device)).sum().backward()
    opt.step()
    torch_xla.sync()


def mlp_config(quick: bool) -> dict:
    """The example's MLP and batch (examples/train_mlp.py), and how many steps to time."""
    from train_mlp import default_config

    config = default_config()
    config.update({"warmup": 20, "steps": 300 if quick else 2000})
    return config


def make_mlp(config: dict):
    """The MLP of examples/train_mlp.py (features -> hidden -> 1), with ``depth`` more
    hidden -> hidden layers for the heavier variant."""
    import torch

    hidden = [torch.nn.Linear(config["hidden"], config["hidden"]) for _ in range(config.get("depth", 0))]
    return torch.nn.Sequential(
        torch.nn.Linear(config["features"], config["hidden"]),
        torch.nn.ReLU(),
        *[m for layer in hidden for m in (layer, torch.nn.ReLU())],
        torch.nn.Linear(config["hidden"], 1),
    )


def mlp_data(config: dict, samples: int | None = None):
    """The example's synthetic regression data as a TensorDataset."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = samples or config["samples"]
    x = torch.randn(n, config["features"], generator=g)
    w = torch.randn(config["features"], 1, generator=g)
    y = torch.sin(x) @ w + 0.01 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def timed_steps(batches: Callable, model, opt, step: Callable, warmup: int, steps: int) -> dict:
    """Run ``warmup`` then ``steps`` training steps over repeated epochs of ``batches()``;
    time the last ``steps`` inside the loop (device work waited for at both ends)."""
    import torch
    import torch_xla.core.xla_model as xm

    done, t0 = 0, None
    while done < warmup + steps:
        for xb, yb in batches():
            if done == warmup:
                xm.wait_device_ops()
                t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            step(opt)
            done += 1
            if done == warmup + steps:
                break
    xm.wait_device_ops()
    seconds = time.perf_counter() - t0
    return {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds}


def throughput_ours(config: dict) -> dict:
    """The MLP with the toolkit as the example uses it: prepare_data_loader, prepare_model,
    optimizer_step and metrics() every step, save_checkpoint (which reports to Ray) every
    ``report_every`` steps. Returns steps/s and the median time of a save_checkpoint call."""
    import torch

    import ray_train_xla as rtx

    loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(
        mlp_data(config), batch_size=config["batch_size"], shuffle=True))
    model = rtx.prepare_model(make_mlp(config))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    done, saves = [0], []

    def step(o):
        rtx.optimizer_step(o)
        done[0] += 1
        metrics = rtx.metrics(done[0])
        if done[0] % config["report_every"] == 0:
            t = time.perf_counter()
            rtx.save_checkpoint({"model": model.state_dict(), "optimizer": o.state_dict(),
                                 "step": done[0]}, {"step": done[0], **metrics})
            saves.append(time.perf_counter() - t)

    result = timed_steps(lambda: iter(loader), model, opt, step, config["warmup"], config["steps"])
    result["saves"] = len(saves)
    result["save_ms_median"] = 1000 * statistics.median(saves) if saves else None
    return result


def throughput_in_ray(config: dict) -> None:
    """On a Ray Train worker: the bare loop (same process, same Ray) then the toolkit's loop;
    with --quick, for each model of ``config["models"]`` in turn."""
    if "models" in config:
        for model, model_config in config["models"].items():
            out = {"bare_in_ray": throughput_bare(model_config),
                   "ours": throughput_ours(model_config)}
            with open(os.path.join(config["out_dir"], f"throughput_{model}.json"), "w") as f:
                json.dump(out, f)
        return
    out = {"bare_in_ray": throughput_bare(config), "ours": throughput_ours(config)}
    with open(os.path.join(config["out_dir"], "throughput.json"), "w") as f:
        json.dump(out, f)


def profile_step(config: dict) -> dict:
    """Where a step's host time goes (one process, no Ray), in microseconds per step: the bare
    loop's parts against the toolkit's (batch to device, forward and backward traced,
    gradient averaging, optimizer update, graph cut and execution, metrics)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import ray_train_xla as rtx
    from ray_train_xla.toolkit import optim

    device = torch_xla.device()
    data = mlp_data(config)
    n = config["steps"]

    def run(kind: str) -> dict:
        torch.manual_seed(0)
        model = make_mlp(config).to(device) if kind == "bare" else rtx.prepare_model(make_mlp(config))
        opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
        if kind == "bare":
            loader = torch.utils.data.DataLoader(data, batch_size=config["batch_size"],
                                                 shuffle=True, drop_last=True)
            batches = lambda: ((x.to(device), y.to(device)) for x, y in loader)  # noqa: E731
        else:
            prepared = rtx.prepare_data_loader(torch.utils.data.DataLoader(
                data, batch_size=config["batch_size"], shuffle=True))
            batches = lambda: iter(prepared)  # noqa: E731
        parts = dict.fromkeys(("batch", "forward_backward", "reduce", "update", "sync", "metrics"), 0.0)
        steps, it = 0, batches()
        xm.wait_device_ops()
        while steps < config["warmup"] + n:
            if steps == config["warmup"]:
                parts = dict.fromkeys(parts, 0.0)
                xm.wait_device_ops()
            t0 = time.perf_counter()
            try:
                xb, yb = next(it)
            except StopIteration:
                it = batches()
                continue
            t1 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            t2 = time.perf_counter()
            if kind == "ours":
                optim.reduce_gradients(opt)
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            torch_xla.sync()
            t5 = time.perf_counter()
            if kind == "ours":
                rtx.metrics(steps + 1)
            t6 = time.perf_counter()
            for key, a, b in (("batch", t0, t1), ("forward_backward", t1, t2), ("reduce", t2, t3),
                              ("update", t3, t4), ("sync", t4, t5), ("metrics", t5, t6)):
                parts[key] += b - a
            steps += 1
        xm.wait_device_ops()
        return {k: 1e6 * v / n for k, v in parts.items()}

    bare, ours = run("bare"), run("ours")
    return {"bare_us": bare, "ours_us": ours, "steps": n}


def throughput_bare(config: dict, loader_kind: str = "to") -> dict:
    """The same MLP, data and batch in a bare torch_xla loop (one process, no Ray); batches
    moved with ``.to(device)`` or (``loader_kind="mp"``) torch_xla's ``MpDeviceLoader``, the
    background loader that prepare_data_loader uses."""
    import torch
    import torch_xla
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    device = torch_xla.device()
    loader = torch.utils.data.DataLoader(
        mlp_data(config), batch_size=config["batch_size"], shuffle=True, drop_last=True)
    model = make_mlp(config).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)

    def batches():
        if loader_kind == "mp":
            yield from MpDeviceLoader(loader, device)
            return
        for xb, yb in loader:
            yield xb.to(device), yb.to(device)

    def step(o):
        o.step()
        torch_xla.sync()

    return timed_steps(batches, model, opt, step, config["warmup"], config["steps"])


def recompile_count(config: dict, mode: str) -> dict:
    """Compilations over 3 epochs with a ragged last batch: ``ours`` (prepare_data_loader) or
    ``naive`` (the DataLoader as is, batches moved with ``.to(device)``). In-process, no Ray."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    import ray_train_xla as rtx

    def compiles() -> tuple[int, int]:
        data = met.metric_data("CompileTime")
        return (int(data[0]) if data else 0, int(met.counter_value("UncachedCompile") or 0))

    device = torch_xla.device()
    dataset = mlp_data(config, samples=config["ragged_samples"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=config["batch_size"], shuffle=True)
    if mode == "ours":
        batches = rtx.prepare_data_loader(loader)
    else:
        class Naive:  # every epoch: the DataLoader's batches, the last one short
            def __iter__(self):
                return ((xb.to(device), yb.to(device)) for xb, yb in loader)

        batches = Naive()
    model = make_mlp(config).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    start, at_warmup, step = compiles(), None, 0
    for _ in range(config["epochs"]):
        for xb, yb in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            torch_xla.sync()
            step += 1
            if step == config["warmup_steps"]:
                at_warmup = compiles()
    end = compiles()
    return {
        "mode": mode, "steps": step, "epochs": config["epochs"],
        "compiles": end[0] - start[0], "uncached_compiles": end[1] - start[1],
        "compiles_after_warmup": end[0] - at_warmup[0],
    }


def grad_sync_loop(config: dict) -> None:
    """2 CPU workers, a ~10M-parameter MLP: time per step split into compute (forward and
    backward), communication (gradient reduction inside optimizer_step: flatten, device-to-host
    copy, gloo all-reduce, copy back) and the rest of optimizer_step (the update), alternating
    bucketed and per-parameter reduction. Also runs benchmarks/bench_optimizer_step.py's loop
    for its end-to-end time and host transfers per step."""
    import bench_optimizer_step
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    import ray_train_xla as rtx
    from ray_train_xla.toolkit import optim

    buckets = [config["bucket_mb"], PER_PARAMETER_MB]
    bench_optimizer_step.bench_loop({**config, "bucket_mbs": buckets})  # writes bench.json

    timers = {"comm": 0.0, "allreduce": 0.0}
    reduce_gradients, all_reduce = optim.reduce_gradients, dist.all_reduce

    def timed_reduce(*args, **kwargs):
        xm.wait_device_ops()
        t = time.perf_counter()
        reduce_gradients(*args, **kwargs)
        xm.wait_device_ops()
        timers["comm"] += time.perf_counter() - t

    def timed_all_reduce(*args, **kwargs):
        t = time.perf_counter()
        result = all_reduce(*args, **kwargs)
        timers["allreduce"] += time.perf_counter() - t
        return result

    layers = []
    for _ in range(config["layers"]):
        layers += [torch.nn.Linear(config["width"], config["width"]), torch.nn.Tanh()]
    model = rtx.prepare_model(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(config["batch"], config["width"]).to(rtx.get_device())

    def steps(bucket_mb: float, n: int) -> dict:
        timers.update(comm=0.0, allreduce=0.0)
        compute = total = 0.0
        for _ in range(n):
            xm.wait_device_ops()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            torch_xla.sync()
            xm.wait_device_ops()
            t1 = time.perf_counter()
            rtx.optimizer_step(opt, bucket_mb=bucket_mb)
            xm.wait_device_ops()
            compute += t1 - t0
            total += time.perf_counter() - t0
        ms = 1000 / n
        return {"step_ms": total * ms, "compute_ms": compute * ms, "comm_ms": timers["comm"] * ms,
                "allreduce_ms": timers["allreduce"] * ms,
                "update_ms": (total - compute - timers["comm"]) * ms}

    optim.reduce_gradients, dist.all_reduce = timed_reduce, timed_all_reduce
    try:
        for b in buckets:
            steps(b, config["warmup"])  # compile every graph of both variants
        reps = []
        for rep in range(config["reps"]):
            for b in buckets:
                reps.append({"rep": rep, "bucket_mb": b, **steps(b, config["steps"])})
    finally:
        optim.reduce_gradients, dist.all_reduce = reduce_gradients, all_reduce
    if rtx.rank() == 0:
        with open(os.path.join(config["out_dir"], "bench.json")) as f:
            end_to_end = json.load(f)
        with open(os.path.join(config["out_dir"], "grad_sync.json"), "w") as f:
            json.dump({"reps": reps, "bench_optimizer_step": end_to_end,
                       "params": sum(p.numel() for p in model.parameters()),
                       "param_tensors": len(list(model.parameters()))}, f)


# --------------------------------------------------------------------------------------------
# Driver side.
# --------------------------------------------------------------------------------------------


def fit(train_fn: Callable, torch_config, workers: int, config: dict, tmp: str) -> float:
    """One TorchTrainer.fit(); returns its wall time in seconds."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_fn, train_loop_config=config, torch_config=torch_config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=os.path.join(tmp, "ray_results")),
    )
    t = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - t


def in_subprocess(task: str, config: dict) -> dict:
    """Run ``task`` of this file in a fresh Python process without Ray; return its JSON."""
    return in_subprocesses({task: config})[task]


def in_subprocesses(tasks: dict[str, dict]) -> dict[str, dict]:
    """Run each task of ``tasks`` (name -> config) in a fresh Python process without Ray, all at
    once; return each one's JSON."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    procs = {task: subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--task", task, "--task-config",
         json.dumps(config)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) for task, config in tasks.items()}
    results = {}
    for task, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{task} failed:\n{stderr[-3000:]}")
        results[task] = json.loads(stdout.strip().splitlines()[-1])
    return results


def row(name: str, a: str, b: str, unit: str, a_values: list, b_values: list, target: str,
        met: bool | None, ratio: float | None = None, **extra: Any) -> dict:
    a_med, b_med = median(a_values), median(b_values)
    if ratio is None and a_med is not None and b_med:
        ratio = a_med / b_med
    return {"figure": name, "a": a, "b": b, "unit": unit, "a_median": a_med, "b_median": b_med,
            "ratio": ratio, "a_values": a_values, "b_values": b_values, "target": target,
            "target_met": met, **extra}


# Ray's TorchXLAConfig runs `pkill -f xrt_run_server` on the machine at start and shutdown:
# the full benchmark measures it, the quick run (part of the test suite) leaves it out.
RAY_XLA_SKIPPED = ("not run in --quick mode: Ray's TorchXLAConfig runs `pkill -f xrt_run_server` "
                   "on the machine, which would stop other jobs' processes")


def bench_startup(reps: int, worker_counts: list[int], tmp: str, with_ray_xla: bool = True
                  ) -> list[dict]:
    from ray.train.torch import TorchConfig
    from ray.train.torch.xla import TorchXLAConfig as RayTorchXLAConfig

    from ray_train_xla import TorchXLAConfig

    configs = {
        "ours": lambda: TorchXLAConfig(device="cpu", timeout_s=120),
        "gloo": lambda: TorchConfig(backend="gloo"),
        "ray_xla": lambda: RayTorchXLAConfig(),
    }
    times: dict[tuple[str, int], list[float]] = {}
    errors: dict[tuple[str, int], str] = {}
    if not with_ray_xla:
        errors[("ray_xla", 1)] = RAY_XLA_SKIPPED
    for rep in range(reps):
        for workers in worker_counts:
            for name, make in configs.items():
                key = (name, workers)
                if name == "ray_xla" and (workers != 1 or key in errors):
                    continue
                try:
                    seconds = fit(one_step, make(), workers, {}, tmp)
                except Exception as e:  # Ray's config may not work here: record why
                    errors[key] = f"{type(e).__name__}: {e}".strip()[:800]
                    log(f"  startup rep {rep + 1}/{reps} {workers}w {name:8s} FAILED: "
                        f"{errors[key].splitlines()[0][:160]}")
                    continue
                times.setdefault(key, []).append(seconds)
                log(f"  startup rep {rep + 1}/{reps} {workers}w {name:8s} {seconds:6.1f} s")
    rows = []
    for workers in worker_counts:
        gloo = times.get(("gloo", workers), [])
        for name in ("ours", "ray_xla"):
            if name == "ray_xla" and workers != 1:
                continue
            a = times.get((name, workers), [])
            r = row(f"startup_{workers}w_{name}", f"{name} fit() {workers} worker(s)",
                    f"gloo fit() {workers} worker(s)", "s", a, gloo,
                    "ratio < 1.05" if name == "ours" else "none (reference)", None)
            if name == "ours" and r["ratio"] is not None:
                r["target_met"] = r["ratio"] < 1.05
            if (name, workers) in errors:
                r["error"] = errors[(name, workers)]
            rows.append(r)
    return rows


# The heavier model of the throughput figure: a step about 10x the MLP's on this machine.
HEAVY = {"hidden": 512, "depth": 2, "batch_size": 128}
# Steps between reports: Ray Train V2 takes a report when its controller polls the workers
# (every 2 s), and ray.train.report blocks until the previous one was taken, so a loop that
# reports more often waits for Ray, whatever the helpers cost. About 2.5 s of steps here.
REPORT_EVERY = {"mlp": 600, "heavy": 60}


def throughput_config(model: str, quick: bool) -> dict:
    """The MLP (``model="mlp"``) or the heavier MLP, reporting every REPORT_EVERY steps (a
    tenth of it with --quick) and timing 3 reports' worth of steps."""
    config = mlp_config(quick)
    if model == "heavy":
        config.update(HEAVY)
    every = REPORT_EVERY[model] // (10 if quick else 1)
    config.update(report_every=every, steps=3 * every, warmup=20)
    return config


def throughput_rep(model: str, config: dict, tmp: str) -> dict:
    """One repetition: a 1-worker fit (the bare loop in Ray, then the toolkit's loop), then the
    bare loop (and, for the MLP, the bare loop with MpDeviceLoader) in a fresh process."""
    from ray_train_xla import TorchXLAConfig

    out_dir = tempfile.mkdtemp(dir=tmp)
    fit(throughput_in_ray, TorchXLAConfig(device="cpu", timeout_s=120), 1,
        {**config, "out_dir": out_dir}, tmp)
    with open(os.path.join(out_dir, "throughput.json")) as f:
        got = json.load(f)
    got["bare"] = in_subprocess("throughput_bare", config)
    if model == "mlp":
        got["bare_mp"] = in_subprocess("throughput_bare_mp", config)
    return got


def throughput_quick(configs: dict, profile_config: dict, tmp: str) -> tuple[dict, dict]:
    """--quick: one repetition of both models in one 1-worker fit, and every bare loop and the
    step profile in one fresh process (the same measurements, fewer process starts)."""
    from ray_train_xla import TorchXLAConfig

    out_dir = tempfile.mkdtemp(dir=tmp)
    fit(throughput_in_ray, TorchXLAConfig(device="cpu", timeout_s=120), 1,
        {"models": configs, "out_dir": out_dir}, tmp)
    bare = in_subprocess("quick_bare", {"models": configs, "profile": profile_config})
    runs = {}
    for model in configs:
        with open(os.path.join(out_dir, f"throughput_{model}.json")) as f:
            got = json.load(f)
        got["bare"] = bare["bare"][model]
        if model == "mlp":
            got["bare_mp"] = bare["bare_mp"]
        runs[model] = [got]
    return runs, bare["profile"]


def bench_throughput(reps: int, quick: bool, tmp: str) -> list[dict]:
    configs = {model: throughput_config(model, quick) for model in ("mlp", "heavy")}
    profile_config = {**mlp_config(quick), "warmup": 20, "steps": 300 if quick else 2000}
    if quick:
        runs, profile = throughput_quick(configs, profile_config, tmp)
    else:
        runs = {model: [] for model in configs}
    rows = []
    for model, config in configs.items():
        every = config["report_every"]
        ours, bare_ray, bare, bare_mp, save_ms, saves = [], [], [], [], [], 0
        for rep in range(reps):
            if not quick:
                runs[model].append(throughput_rep(model, config, tmp))
            got = runs[model][rep]
            ours.append(got["ours"]["steps_per_s"])
            bare_ray.append(got["bare_in_ray"]["steps_per_s"])
            saves += got["ours"]["saves"]
            if got["ours"]["save_ms_median"] is not None:
                save_ms.append(got["ours"]["save_ms_median"])
            bare.append(got["bare"]["steps_per_s"])
            if model == "mlp":
                bare_mp.append(got["bare_mp"]["steps_per_s"])
            log(f"  throughput {model} rep {rep + 1}/{reps} ours {ours[-1]:7.1f} steps/s, "
                f"bare in Ray {bare_ray[-1]:7.1f}, bare {bare[-1]:7.1f}"
                + (f", bare with MpDeviceLoader {bare_mp[-1]:7.1f}" if bare_mp else ""))
        sizes = {"steps_timed": config["steps"], "warmup": config["warmup"],
                 "batch_size": config["batch_size"], "hidden": config["hidden"],
                 "depth": config.get("depth", 0), "report_every": every,
                 "checkpoints_in_timed_steps": saves, "save_checkpoint_ms_median": median(save_ms)}
        target = 0.98 if model == "mlp" else 0.99
        name = "throughput" if model == "mlp" else "throughput_heavy"
        what = "MLP" if model == "mlp" else "heavier MLP"
        # Retired: helpers in a 1-thread Ray worker against a bare loop in a 2-thread process does
        # not measure the helpers (bench_reporting.py); kept in results.json, left out of the chart.
        r = row(name, f"helpers in Ray (1 worker), {what}", f"bare torch_xla loop, {what}",
                "steps/s", ours, bare, f"none (retired; was ratio >= {target})", None, **sizes)
        r["retired"] = True
        rows.append(r)
        rows.append(row(name + "_in_ray", f"helpers in Ray, {what}",
                        f"bare loop in the same Ray worker, {what}", "steps/s", ours, bare_ray,
                        "none (the helpers' own cost)", None))
        if model == "mlp":
            rows.append(row("throughput_mp_loader", "bare loop, MpDeviceLoader",
                            "bare loop, .to(device)", "steps/s", bare_mp, bare, "none (reference)",
                            None, **sizes))
    rows[0]["step_ratio_heavy_over_mlp"] = (rows[0]["b_median"] / rows[3]["b_median"]
                                            if rows[3]["b_median"] else None)
    if not quick:
        profile = in_subprocess("profile_step", profile_config)
    rows.append(row("step_profile", "helpers, host us/step", "bare loop, host us/step", "us/step",
                    [sum(profile["ours_us"].values())], [sum(profile["bare_us"].values())],
                    "none (breakdown)", None, breakdown=profile))
    return rows


def bench_recompile(quick: bool) -> list[dict]:
    config = {**mlp_config(quick), "ragged_samples": 500, "epochs": 3, "warmup_steps": 3}
    results = {}
    if quick:  # both fresh processes at once (compilations are counted, not timed)
        done = in_subprocesses({"recompile_" + mode: config for mode in ("ours", "naive")})
    for mode in ("ours", "naive"):
        results[mode] = done["recompile_" + mode] if quick else in_subprocess("recompile_" + mode, config)
        res = results[mode]
        log(f"  recompile {mode:5s} {res['compiles']} compilations in {res['steps']} steps, "
            f"{res['compiles_after_warmup']} after warm-up")
    ours, naive = results["ours"], results["naive"]
    r = row("recompile", "prepare_data_loader", "naive DataLoader", "compilations",
            [ours["compiles"]], [naive["compiles"]], "0 compilations after warm-up (ours)",
            ours["compiles_after_warmup"] == 0, details=results,
            a_after_warmup=ours["compiles_after_warmup"],
            b_after_warmup=naive["compiles_after_warmup"])
    return [r]


def bench_grad_sync(reps: int, quick: bool, tmp: str) -> list[dict]:
    from ray_train_xla import TorchXLAConfig

    size = {"layers": 8, "width": 256, "steps": 3} if quick else \
        {"layers": 38, "width": 512, "steps": 5}
    out_dir = tempfile.mkdtemp(dir=tmp)
    config = {**size, "batch": 16, "warmup": 2, "reps": reps, "bucket_mb": 25.0,
              "out_dir": out_dir}
    seconds = fit(grad_sync_loop, TorchXLAConfig(device="cpu", timeout_s=300), 2, config, tmp)
    with open(os.path.join(out_dir, "grad_sync.json")) as f:
        data = json.load(f)
    for rec in data["reps"]:
        kind = "bucketed" if rec["bucket_mb"] != PER_PARAMETER_MB else "per-param"
        log(f"  grad_sync rep {rec['rep'] + 1}/{reps} {kind:9s} step {rec['step_ms']:7.1f} ms "
            f"(compute {rec['compute_ms']:.1f}, comm {rec['comm_ms']:.1f}, "
            f"update {rec['update_ms']:.1f})")
    bucketed = [r for r in data["reps"] if r["bucket_mb"] != PER_PARAMETER_MB]
    per_param = [r for r in data["reps"] if r["bucket_mb"] == PER_PARAMETER_MB]
    split = {
        side: {k: median([r[k] for r in recs]) for k in
               ("step_ms", "compute_ms", "comm_ms", "allreduce_ms", "update_ms")}
        for side, recs in (("bucketed", bucketed), ("per_param", per_param))
    }
    common = {"params": data["params"], "param_tensors": data["param_tensors"], "workers": 2,
              "fit_seconds": seconds, "bench_optimizer_step": data["bench_optimizer_step"]}
    step = row("grad_sync_step", "bucketed (25 MB)", "one bucket per parameter", "ms/step",
               [r["step_ms"] for r in bucketed], [r["step_ms"] for r in per_param],
               "ratio < 1 (bucketing pays)", None, split=split, **common)
    step["target_met"] = step["ratio"] < 1
    comm = row("grad_sync_comm", "bucketed (25 MB)", "one bucket per parameter", "ms/step",
               [r["comm_ms"] for r in bucketed], [r["comm_ms"] for r in per_param],
               "ratio < 1", None)
    comm["target_met"] = comm["ratio"] < 1
    return [step, comm]


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def write_results(results: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    m = results["machine"]
    lines = [
        f"# Benchmark results ({'quick' if results['quick'] else 'full'} run)",
        "",
        f"{results['date']}, {m['platform']}, {m['cpus']} CPUs, Python {m['python']}, "
        f"torch {m['torch']}, torch_xla {m['torch_xla']}, ray {m['ray']}; "
        f"{results['reps']} repetition(s), A and B alternating.",
        "",
        "| figure | A | B | unit | A median | B median | ratio A/B | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        a_med = fmt(r["a_median"]) if "error" not in r else "error: " + \
            r["error"].splitlines()[0][:80].replace("|", "/")
        met = {True: "yes", False: "no", None: "-"}[r["target_met"]]
        figure = r["figure"] + (" (retired)" if r.get("retired") else "")
        lines.append(f"| {figure} | {r['a']} | {r['b']} | {r['unit']} | {a_med} | "
                     f"{fmt(r['b_median'])} | {fmt(r['ratio'])} | {r['target']} | {met} |")
    for r in results["rows"]:
        if "split" in r:
            lines += ["", f"Gradient synchronisation, {r['params'] / 1e6:.1f}M parameters in "
                      f"{r['param_tensors']} tensors, 2 CPU workers (median ms per step):", "",
                      "| reduction | step | compute (fwd+bwd) | communication | of which gloo "
                      "all-reduce | update |", "|---|---|---|---|---|---|"]
            for side, s in r["split"].items():
                lines.append(f"| {side} | {fmt(s['step_ms'])} | {fmt(s['compute_ms'])} | "
                             f"{fmt(s['comm_ms'])} | {fmt(s['allreduce_ms'])} | "
                             f"{fmt(s['update_ms'])} |")
        if r["figure"] == "step_profile":
            b = r["breakdown"]
            lines += ["", f"Host time per step of the MLP, one process, {b['steps']} steps "
                      "(microseconds; `sync` includes waiting for the step's execution):", "",
                      "| part | bare loop | helpers |", "|---|---|---|"]
            for part in b["bare_us"]:
                lines.append(f"| {part} | {b['bare_us'][part]:.1f} | {b['ours_us'][part]:.1f} |")
        if r["figure"] == "throughput":
            lines += ["", f"Throughput: checkpoint every {r['report_every']} steps "
                      f"({r['checkpoints_in_timed_steps']} in the timed steps, median "
                      f"save_checkpoint {fmt(r['save_checkpoint_ms_median'])} ms); the heavier "
                      f"model's step is {fmt(r['step_ratio_heavy_over_mlp'])}x the MLP's."]
        if r["figure"] == "recompile":
            lines += ["", f"Recompilation: after warm-up (3 steps), prepare_data_loader compiled "
                      f"{r['a_after_warmup']} graph(s), the naive loop {r['b_after_warmup']}."]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(results["rows"], os.path.join(out, "ratios.png"))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["ratio"] is not None and not r.get("retired")]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(shown) + 1.5))
    names = [r["figure"] for r in shown]
    colors = [{True: "tab:green", False: "tab:red", None: "tab:gray"}[r["target_met"]]
              for r in shown]
    ax.barh(names, [r["ratio"] for r in shown], color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    for i, r in enumerate(shown):
        ax.text(r["ratio"], i, f" {r['ratio']:.3g}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("ratio A/B (green: target met, red: missed, gray: no target)")
    ax.set_title("ray-train-xla benchmarks: ratio of medians")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def versions() -> dict:
    import ray
    import torch

    try:
        from importlib.metadata import version

        xla = version("torch_xla")
    except Exception:
        xla = "?"
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_xla": xla,
            "ray": ray.__version__}


def summary_line(r: dict) -> str:
    if "error" in r and r["a_median"] is None:
        return f"{r['figure']}: {r['a']} failed ({r['error'].splitlines()[0][:100]}); ratio -"
    return (f"{r['figure']}: {r['a']} {fmt(r['a_median'])} vs {r['b']} {fmt(r['b_median'])} "
            f"{r['unit']} (target {r['target']}: "
            f"{ {True: 'met', False: 'missed', None: '-'}[r['target_met']]}); "
            f"ratio {fmt(r['ratio'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one repetition, 1 worker for startup, small sizes, both "
                        "throughput models in one fit and their bare loops in one process, "
                        "fresh processes run at once (about a minute)")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions per figure (default 3, or 1 with --quick)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"),
                        help="directory for results.json, results.md and ratios.png")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset of: startup,throughput,recompile,grad_sync")
    parser.add_argument("--task", choices=TASKS, help=argparse.SUPPRESS)
    parser.add_argument("--task-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path[:0] = [HERE, os.path.join(ROOT, "examples")]

    if args.task:  # a child process: one in-process measurement, JSON on the last line
        config = json.loads(args.task_config)
        if args.task == "quick_bare":  # --quick: every bare loop, then the profile
            models = config["models"]
            print(json.dumps({
                "bare": {model: throughput_bare(c) for model, c in models.items()},
                "bare_mp": throughput_bare(models["mlp"], "mp"),
                "profile": profile_step(config["profile"]),
            }))
        elif args.task in ("throughput_bare", "throughput_bare_mp"):
            print(json.dumps(throughput_bare(config, "mp" if args.task.endswith("_mp") else "to")))
        elif args.task == "profile_step":
            print(json.dumps(profile_step(config)))
        else:  # recompile_ours, recompile_naive (argparse refused any other task)
            print(json.dumps(recompile_count(config, args.task.removeprefix("recompile_"))))
        return

    reps = args.reps or (1 if args.quick else 3)
    if reps < 1:
        parser.error("--reps must be >= 1")
    figures = ["startup", "throughput", "recompile", "grad_sync"]
    only = args.only.split(",") if args.only else figures
    if set(only) - set(figures):
        parser.error(f"--only: unknown figure(s) {sorted(set(only) - set(figures))}")
    # Workers import the training functions' helpers from benchmarks/ and examples/.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(ROOT, "examples")] + [p for p in [os.environ.get("PYTHONPATH")] if p])

    import ray

    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                               "quick": args.quick, "reps": reps, "machine": versions(),
                               "rows": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rtx-bench-") as tmp:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            for figure in only:
                log(f"[{time.perf_counter() - started:6.0f} s] {figure} ...")
                if figure == "startup":
                    rows = bench_startup(reps, [1] if args.quick else [1, 2], tmp,
                                         with_ray_xla=not args.quick)
                elif figure == "throughput":
                    rows = bench_throughput(reps, args.quick, tmp)
                elif figure == "recompile":
                    rows = bench_recompile(args.quick)
                else:
                    rows = bench_grad_sync(reps, args.quick, tmp)
                results["rows"] += [{**r, "group": figure} for r in rows]
        finally:
            ray.shutdown()
    results["seconds"] = time.perf_counter() - started
    previous = os.path.join(args.out, "results.json")
    if args.only and os.path.exists(previous):
        # A partial run replaces its own figures and keeps the others of the last full run.
        with open(previous) as f:
            kept = [r for r in json.load(f)["rows"]
                    if r.get("group", r["figure"].split("_")[0]) not in only]
        results["rows"] = kept + results["rows"]
        results["partial"] = only
    write_results(results, args.out)
    log(f"[{results['seconds']:6.0f} s] done; results in {args.out}")
    for r in results["rows"]:
        log(summary_line(r))


if __name__ == "__main__":
    main()
