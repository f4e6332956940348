"""Throughput with checkpoints: the toolkit's loop against its real peers, side by side.

In one Ray Train worker (same process, same threads), variants alternate over ``--reps``
rounds, each timed over ``--window`` seconds of steps, a checkpoint every ``cadence`` seconds
(measured by the loop's clock). Steps/s count the loop (a save that waits for Ray, or for a
free slot, is inside it) and the helpers' wait at the end for the checkpoints still in flight
(at most ``max_in_flight``, once per training function; shown on its own as ``end s``): the
time until every checkpoint was taken by Ray, as the hand-written loop's time is. The loop's
steps/s without that wait are in the JSON (``loop_steps_per_s``):

- ``bare``: ``DataLoader`` + ``.to(device)``, ``opt.step()``, ``torch_xla.sync()``; no reports;
- ``helpers``: ``prepare_data_loader``, ``prepare_model``, ``optimizer_step``, ``metrics()``
  every step, ``save_checkpoint`` (background reporter) at the cadence, ``flush_reports`` at
  the end of the window;
- ``hand``: a hand-written torch_xla + Ray loop doing the same job: ``.to(device)``,
  ``xm.optimizer_step`` + ``torch_xla.sync()``, the compile metrics read every step, and at the
  cadence the same state (model, optimizer, step) ``torch.save``d and reported with
  ``ray.train.report(metrics, checkpoint=...)`` on the training thread.

Two models: the examples' MLP and a heavier MLP (four 512x512 hidden layers, batch 256; a step
about 12x the MLP's here). Cadences 1 s and 3 s. Three Ray settings, each fit in a process of
its own: Ray Train V2 with the controller's default poll (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=2``:
Ray takes at most one report per 2 s from a worker), V2 with a 0.5 s poll, and Ray Train V1
(``RAY_TRAIN_V2_ENABLED=0``: the driver takes each report as it comes). The worker has 2 CPUs
(``OMP_NUM_THREADS=2``); the bare loop also runs in plain processes with 1 and 2 threads, so
"inside Ray" is not confused with "one thread".

Writes ``reporting.json`` and ``reporting.md`` under ``--out``.

    python benchmarks/bench_reporting.py [--reps 3] [--window 8] [--settings v2@2s,v2@0.5s,v1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "examples")]

from run import HEAVY, make_mlp, mlp_config, mlp_data  # noqa: E402

# The heavier model: four 512x512 hidden layers, batch 256, a step about 12x the MLP's here
# (run.py's HEAVY, two layers and batch 128, is about 6x).
MODELS = {"mlp": {}, "heavy": {**HEAVY, "depth": 4, "batch_size": 256}}
VARIANTS = ("bare", "helpers", "hand")


def model_config(name: str) -> dict:
    config = mlp_config(quick=True)
    config.update(MODELS[name])
    return config


def batches_to_device(loader, device):
    while True:
        for xb, yb in loader:
            yield xb.to(device), yb.to(device)


def plain_setup(config: dict):
    """The model and optimizer on the XLA device, and endless batches moved with ``.to``: what
    the bare and the hand-written loops share."""
    import torch
    import torch_xla

    device = torch_xla.device()
    loader = torch.utils.data.DataLoader(mlp_data(config), batch_size=config["batch_size"],
                                         shuffle=True, drop_last=True)
    model = make_mlp(config).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    return model, opt, batches_to_device(loader, device)


def run_bare(config: dict, window: float, cadence: float | None, warmup: int = 20) -> dict:
    import torch
    import torch_xla

    model, opt, it = plain_setup(config)

    def step():
        xb, yb = next(it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        torch_xla.sync()

    return timed(step, None, window, warmup)


def run_helpers(config: dict, window: float, cadence: float, warmup: int = 20) -> dict:
    import torch

    import ray_train_xla as rtx

    loader = rtx.prepare_data_loader(torch.utils.data.DataLoader(
        mlp_data(config), batch_size=config["batch_size"], shuffle=True))
    model = rtx.prepare_model(make_mlp(config))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    n = [0]

    def batches():
        while True:
            yield from loader

    it = batches()

    def step():
        xb, yb = next(it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        rtx.optimizer_step(opt)
        n[0] += 1
        return rtx.metrics(n[0])

    def checkpoint(metrics):
        rtx.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "step": n[0]}, {"step": n[0], **metrics})

    return timed(step, checkpoint, window, warmup, cadence, end=rtx.flush_reports)


def run_hand(config: dict, window: float, cadence: float, warmup: int = 20) -> dict:
    import ray.train
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    model, opt, it = plain_setup(config)
    n = [0]

    def step():
        xb, yb = next(it)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        xm.optimizer_step(opt)
        torch_xla.sync()
        n[0] += 1
        compiles = met.metric_data("CompileTime")
        return {"xla/compiles": compiles[0] if compiles else 0}

    def checkpoint(metrics):
        tmp = tempfile.mkdtemp()
        try:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": n[0]}
            cpu = torch.utils._pytree.tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, state)
            torch.save(cpu, os.path.join(tmp, "checkpoint.pt"))
            ray.train.report({"step": n[0], **metrics},
                             checkpoint=ray.train.Checkpoint.from_directory(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return timed(step, checkpoint, window, warmup, cadence)


def timed(step, checkpoint, window: float, warmup: int, cadence: float | None = None,
          end=None) -> dict:
    """Warm up, then run ``step`` for ``window`` seconds, calling ``checkpoint`` every
    ``cadence`` seconds; ``steps_per_s`` counts the time of ``end()`` too (the wait for the
    reports in flight), ``loop_steps_per_s`` does not."""
    import torch_xla.core.xla_model as xm

    for _ in range(warmup):
        step()
    xm.wait_device_ops()
    t0 = last = time.perf_counter()
    steps = saves = 0
    while True:
        metrics = step()
        steps += 1
        now = time.perf_counter()
        if checkpoint is not None and now - last >= cadence:
            checkpoint(metrics or {})
            saves += 1
            last = time.perf_counter()
        if now - t0 >= window:
            break
    xm.wait_device_ops()
    loop_s = time.perf_counter() - t0
    if end is not None:
        end()
    end_s = time.perf_counter() - t0 - loop_s
    return {"steps": steps, "seconds": loop_s + end_s, "steps_per_s": steps / (loop_s + end_s),
            "loop_steps_per_s": steps / loop_s, "end_s": end_s, "checkpoints": saves}


RUNNERS = {"bare": run_bare, "helpers": run_helpers, "hand": run_hand}


def in_worker(config: dict) -> None:
    """The Ray worker: every (model, cadence) case, variants alternating, ``reps`` rounds."""
    import torch

    results = {"threads": torch.get_num_threads(),
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cases": {}}
    for model in config["models"]:
        mc = model_config(model)
        for cadence in config["cadences"]:
            runs: dict[str, list] = {v: [] for v in VARIANTS}
            for rep in range(config["reps"]):
                order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]  # rotate: no variant always first
                for v in order:
                    runs[v].append(RUNNERS[v](mc, config["window"], cadence))
            results["cases"][f"{model}@{cadence:g}s"] = runs
    with open(os.path.join(config["out_dir"], "worker.json"), "w") as f:
        json.dump(results, f)


def plain_bare(model: str, threads: int, window: float, reps: int) -> list[float]:
    """The bare loop in a plain process (no Ray) with ``threads`` threads: steps/s per rep."""
    code = (f"import sys, json, torch; sys.path[:0] = [{HERE!r}, {os.path.join(ROOT, 'examples')!r}]; "
            f"torch.set_num_threads({threads}); from bench_reporting import run_bare, model_config; "
            f"print(json.dumps([run_bare(model_config({model!r}), {window}, None)['steps_per_s'] "
            f"for _ in range({reps})]))")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit_in_ray(config: dict, setting: str) -> dict:
    """One fit for ``setting`` (``v2@<poll>s`` or ``v1``), in a process of its own: Ray Train
    reads ``RAY_TRAIN_V2_ENABLED`` when ``ray.train`` is first imported."""
    out_dir = tempfile.mkdtemp(prefix="bench-reporting-")
    train, _, poll = setting.partition("@")
    env = {**os.environ, "RAY_TRAIN_V2_ENABLED": "0" if train == "v1" else "1"}
    if poll:
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = poll.rstrip("s")
    code = (f"import sys, json; sys.path[:0] = [{HERE!r}]; from bench_reporting import _fit; "
            f"_fit(json.loads(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, json.dumps({**config, "out_dir": out_dir})],
                   env=env, check=True, timeout=7200)
    with open(os.path.join(out_dir, "worker.json")) as f:
        return {**json.load(f), "rounds": config["reps"], "window": config["window"]}


def _fit(config: dict) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    env_vars = {"PYTHONPATH": os.pathsep.join([HERE, os.path.join(ROOT, "examples")])}
    if "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S" in os.environ:
        env_vars["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env_vars})
    try:
        TorchTrainer(
            in_worker, train_loop_config=config,
            torch_config=TorchXLAConfig(device="cpu", timeout_s=600),
            scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 2}),
            run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="bench-reporting-runs-")),
        ).fit()
    finally:
        ray.shutdown()


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.1f} [{min(values):.1f}-{max(values):.1f}]"


def summarise(results: dict) -> list[str]:
    lines = ["| Ray Train | rounds | case | bare steps/s | helpers steps/s | hand steps/s | helpers / bare | "
             "hand / bare | helpers / hand | helpers / bare, loop only | checkpoints (helpers, hand) | "
             "helpers' end s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, res in results["ray"].items():
        for case, runs in res["cases"].items():
            sps = {v: [r["steps_per_s"] for r in runs[v]] for v in VARIANTS}
            # per-round ratios (A and B of the same round), then their median and range
            hb = [h / b for h, b in zip(sps["helpers"], sps["bare"])]
            nb = [h / b for h, b in zip(sps["hand"], sps["bare"])]
            hh = [h / n for h, n in zip(sps["helpers"], sps["hand"])]
            hl = [r["loop_steps_per_s"] / b for r, b in zip(runs["helpers"], sps["bare"])]
            ck = (statistics.median(r["checkpoints"] for r in runs["helpers"]),
                  statistics.median(r["checkpoints"] for r in runs["hand"]))
            end = statistics.median(r["end_s"] for r in runs["helpers"])
            lines.append(
                f"| {setting} | {res.get('rounds', '?')} x {res.get('window', '?'):g} s | "
                f"{case} | {spread(sps['bare'])} | {spread(sps['helpers'])} | "
                f"{spread(sps['hand'])} | {statistics.median(hb):.3f} [{min(hb):.3f}-{max(hb):.3f}] | "
                f"{statistics.median(nb):.3f} [{min(nb):.3f}-{max(nb):.3f}] | "
                f"{statistics.median(hh):.3f} [{min(hh):.3f}-{max(hh):.3f}] | "
                f"{statistics.median(hl):.3f} [{min(hl):.3f}-{max(hl):.3f}] | {ck[0]:g}, {ck[1]:g} | "
                f"{end:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", type=float, default=8.0, help="seconds of steps per run")
    parser.add_argument("--settings", default="v2@2s,v2@0.5s,v1",
                        help="Ray Train V2 with a controller poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), "
                             "or v1")
    parser.add_argument("--models", default="mlp,heavy")
    parser.add_argument("--cadences", default="1,3")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--keep", action="store_true",
                        help="keep the settings of the last run's reporting.json not run again")
    args = parser.parse_args()
    config = {"reps": args.reps, "window": args.window, "models": args.models.split(","),
              "cadences": [float(c) for c in args.cadences.split(",")]}
    results = {"config": config, "ray": {}, "plain_bare": {}}
    last = os.path.join(args.out, "reporting.json")
    if args.keep and os.path.exists(last):
        with open(last) as f:
            results["ray"] = {k: v for k, v in json.load(f)["ray"].items()
                              if k not in args.settings.split(",")}
    for setting in args.settings.split(","):
        print(f"fit under Ray Train {setting} ...", flush=True)
        results["ray"][setting] = fit_in_ray(config, setting)
    for model in config["models"]:
        for threads in (1, 2):
            results["plain_bare"][f"{model}/{threads} threads"] = plain_bare(
                model, threads, args.window, args.reps)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reporting.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["# Reports off the step path: throughput with checkpoints", "",
             f"Command: `python benchmarks/bench_reporting.py --reps {args.reps} --window "
             f"{args.window:g} --settings {args.settings}{' --keep' if args.keep else ''}` "
             "(rounds per setting in the table). One Ray worker with 2 CPUs (torch "
             f"threads: {next(iter(results['ray'].values()))['threads']}), variants alternating; "
             "steps/s as median [min-max] over the rounds, ratios computed per round. Steps/s "
             "count the time until every checkpoint was taken by Ray (the helpers' end wait "
             "included); \"loop only\" leaves that wait out.", ""]
    lines += summarise(results)
    lines += ["", "Bare loop in a plain process (no Ray), steps/s median [min-max]:", "",
              "| model / threads | steps/s |", "|---|---|"]
    lines += [f"| {k} | {spread(v)} |" for k, v in results["plain_bare"].items()]
    with open(os.path.join(args.out, "reporting.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
