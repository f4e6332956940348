"""What the recompilation causes and the profiles cost, on the examples' MLP (torch_xla on the
CPU, one process, no Ray). Each figure alternates its sides over ``--reps`` rounds and reports
medians:

- ``hooks``: host nanoseconds per step of the step seam (``step_done``) with the profile and
  graph-check hooks installed and nothing due, against no hooks;
- ``graph_check``: one check step of the comparison of the ranks' graphs (read the compile
  counter, write this rank's value to a real ``TCPStore``, and on rank 0 read every rank's),
  microseconds, and per step amortised over the default 100 steps;
- ``compile_causes``: the MLP's step time after warm-up, the time of a step that compiles a
  new graph (15 new batch sizes, median) and of a new graph of one small op (60 sizes), with
  torch_xla's compilation analysis on (``PT_XLA_DEBUG_LEVEL=1`` and a file, what
  ``compile_causes=True`` plans) against off; each side in fresh processes (torch_xla reads the
  level once);
- ``profile_window``: a 10-step window with torch_xla's profiler: the MLP's step time inside
  the window against outside it, the trace's start, and its stop and export (on the training
  thread; the upload is in the background).

Writes ``observe.json`` and ``observe.md`` under ``--out``.

    python benchmarks/bench_observe.py [--reps 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_GRAPHS = 15  # steps compiling a new graph, timed in each process
TINY_GRAPHS = 60  # and new graphs of one small op
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "examples"), os.path.join(ROOT, "src")]


def mlp_step_fn(batch: int):
    """The examples' MLP on the XLA CPU device: a function running one training step."""
    import torch
    import torch_xla
    from run import make_mlp, mlp_config

    config = mlp_config(quick=True)
    device = torch_xla.device()
    model = make_mlp(config).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, config["features"]).to(device)
    y = torch.randn(batch, 1).to(device)

    def step(xb=x, yb=y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        torch_xla.sync()

    return step, config


def wait() -> None:
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def child_compile_causes(steps: int) -> dict:
    """In a fresh process: steady step time, then the time of a step with a new batch size."""
    import torch

    step, config = mlp_step_fn(64)
    for _ in range(20):
        step()
    wait()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        wait()
        times.append(time.perf_counter() - t)
    import torch_xla

    device = torch_xla.device()
    new_graphs = []
    for rows in range(65, 65 + NEW_GRAPHS):  # each batch size is a new graph
        x = torch.randn(rows, config["features"]).to(device)
        y = torch.randn(rows, 1).to(device)
        wait()
        t = time.perf_counter()
        step(x, y)
        wait()
        new_graphs.append(time.perf_counter() - t)
    tiny = []  # a graph whose compilation is quick: the analysis's share shows
    for n in range(1, TINY_GRAPHS + 1):
        t = time.perf_counter()
        z = torch.ones(n, device=device) * 3 + 1
        torch_xla.sync()
        wait()
        tiny.append(time.perf_counter() - t)
    del z
    return {"step_us": statistics.median(times) * 1e6,
            "compiles": float(torch_xla._XLAC._xla_counter_value("UncachedCompile") or 0),
            "new_graph_ms": statistics.median(new_graphs) * 1e3,
            "tiny_new_graph_ms": statistics.median(tiny) * 1e3}


def compile_causes(reps: int, steps: int) -> dict:
    sides: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(reps):
        for side in ("off", "on") if rep % 2 == 0 else ("on", "off"):  # neither always first
            env = dict(os.environ, PJRT_DEVICE="CPU")
            env.pop("PT_XLA_DEBUG_LEVEL", None)
            debug = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
            if side == "on":
                env.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=debug)
            out = subprocess.run([sys.executable, __file__, "--child", str(steps)], env=env,
                                 capture_output=True, text=True, timeout=600, check=True)
            sides[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            if side == "on":
                sides[side][-1]["analysis_bytes"] = os.path.getsize(debug)
            os.unlink(debug)
    out: dict = {side: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                 for side, rows in sides.items()}
    out["runs"] = sides
    return out


def hooks(reps: int, n: int = 200_000) -> dict:
    import torch.distributed as dist

    from ray_train_xla.toolkit import steps
    from ray_train_xla.toolkit.observability import compile_causes as cc
    from ray_train_xla.toolkit.observability import profiling

    out: dict[str, list[float]] = {"none": [], "installed": []}
    for _ in range(reps):
        for side in ("none", "installed"):
            steps.reset()
            if side == "installed":
                steps.add_step_hook(profiling.Profiles(0, 2, storage=object()).on_step)
                steps.add_step_hook(cc.GraphCheck(dist.HashStore(), 0, 2, "g",
                                                  every=1 << 40).on_step)
            t = time.perf_counter()
            for _ in range(n):
                steps.step_done()
            out[side].append((time.perf_counter() - t) / n * 1e9)
    steps.reset()
    return {side: statistics.median(v) for side, v in out.items()}


def graph_check(reps: int, world: int = 2, checks: int = 200) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from ray_train_xla.toolkit.observability import compile_causes as cc

    mlp_step_fn(8)[0]()  # a compiled graph to count
    server = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True,
                           timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, world_size=1, is_master=False,
                           timeout=timedelta(seconds=30))
    check = {r: cc.GraphCheck(client, r, world, "bench", every=1) for r in range(world)}
    rows = {"rank0_us": [], "other_us": []}
    for _ in range(reps):
        times = {0: [], 1: []}
        for n in range(1, checks + 1):
            for r in (1, 0):
                t = time.perf_counter()
                check[r]._check(n)
                times[r].append(time.perf_counter() - t)
        rows["rank0_us"].append(statistics.median(times[0]) * 1e6)
        rows["other_us"].append(statistics.median(times[1]) * 1e6)
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["rank0_per_step_us_every_100"] = out["rank0_us"] / cc.DEFAULT_CHECK_EVERY
    return out


def profile_window(reps: int, window: int = 10) -> dict:
    import torch_xla.debug.profiler as xp

    step, _ = mlp_step_fn(64)
    for _ in range(20):
        step()
    wait()
    rows: dict[str, list[float]] = {"outside_us": [], "inside_us": [], "start_ms": [],
                                    "stop_export_ms": []}
    from ray_train_xla.toolkit.observability.profiling import XLATracer

    for _ in range(reps):
        outside = []
        for _ in range(window):
            t = time.perf_counter()
            step()
            wait()
            outside.append(time.perf_counter() - t)
        tracer, local = XLATracer(), tempfile.mkdtemp()
        t = time.perf_counter()
        tracer.start(local, 1)
        rows["start_ms"].append((time.perf_counter() - t) * 1e3)
        inside = []
        for k in range(window):
            t = time.perf_counter()
            step()
            wait()
            if k < window - 1:
                tracer.step(k + 2)
            inside.append(time.perf_counter() - t)
        t = time.perf_counter()
        tracer.stop(local, 0)
        rows["stop_export_ms"].append((time.perf_counter() - t) * 1e3)
        rows["outside_us"].append(statistics.median(outside) * 1e6)
        rows["inside_us"].append(statistics.median(inside) * 1e6)
    del xp
    return {k: statistics.median(v) for k, v in rows.items()}


def markdown(results: dict) -> str:
    cc, h, g, p = (results[k] for k in ("compile_causes", "hooks", "graph_check", "profile_window"))
    return "\n".join([
        "# Recompilation causes and profiles: what they cost",
        "",
        f"`python benchmarks/bench_observe.py --reps {results['reps']}` on {results['machine']}"
        " (torch_xla on the CPU, the examples' MLP; medians; a shared, noisy machine: compare "
        "the sides, not the absolute times).",
        "",
        "| figure | off / outside | on / inside |",
        "|---|---|---|",
        f"| step seam, host ns per step (hooks installed, nothing due) | {h['none']:.0f} | "
        f"{h['installed']:.0f} |",
        f"| MLP step after warm-up, us (compile_causes) | {cc['off']['step_us']:.0f} | "
        f"{cc['on']['step_us']:.0f} |",
        f"| a step compiling a new graph, ms (compile_causes) | {cc['off']['new_graph_ms']:.1f} | "
        f"{cc['on']['new_graph_ms']:.1f} |",
        f"| a new graph of one small op, ms (compile_causes) | "
        f"{cc['off']['tiny_new_graph_ms']:.2f} | {cc['on']['tiny_new_graph_ms']:.2f} |",
        f"| MLP step, us (outside / inside a torch_xla profile window) | {p['outside_us']:.0f} | "
        f"{p['inside_us']:.0f} |",
        "",
        f"- graph check (2 ranks, a real TCPStore): {g['other_us']:.0f} us on a rank, "
        f"{g['rank0_us']:.0f} us on rank 0 per check; every 100 steps: "
        f"{g['rank0_per_step_us_every_100']:.2f} us per step on rank 0.",
        f"- compile_causes wrote {cc['on']['analysis_bytes']:.0f} bytes of analysis for "
        f"{cc['on']['compiles']:.0f} compilations "
        f"({cc['on']['analysis_bytes'] / cc['on']['compiles'] / 1000:.1f} KB each).",
        f"- profile window: trace start {p['start_ms']:.2f} ms, stop and export "
        f"{p['stop_export_ms']:.1f} ms (training thread, at the window's ends).",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--child", type=int, default=None)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child_compile_causes(args.child)))
        return
    os.environ["PJRT_DEVICE"] = "CPU"
    import platform

    results = {
        "reps": args.reps, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "compile_causes": compile_causes(args.reps, args.steps),
        "hooks": hooks(args.reps),
        "graph_check": graph_check(args.reps),
        "profile_window": profile_window(args.reps),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "observe.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = markdown(results)
    with open(os.path.join(args.out, "observe.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
