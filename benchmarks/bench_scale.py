"""Backend start at scale, simulated: the driver's planning and distribution step for 8,192
workers on 128 nodes and 32,768 on 512 nodes, without starting a process.

A recording worker group stands in for Ray's: ``execute(gather_facts)`` returns the facts the
workers would report (Neuron, one NeuronCore each, EFA), ``execute_single(0, reserve_ports, n)``
returns ports, and ``execute(apply_env, index, options)`` records what every worker receives.
``backend.put`` (the backend's ``ray.put``) is replaced by a recorder that pickles each object
as Ray would, so the bytes each node fetches are counted: the per-node index plus that node's
own object. Also measured: every worker's environment size, ``ray-train-xla plan --json`` for
8,192 workers beyond the CLI's start-up, and the CLI's start-up for ``plan``.

    python benchmarks/bench_scale.py [--reps 5] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCALES = ((128, 64), (512, 64))  # (nodes, workers per node)
TARGETS = {"driver_s_8192": 0.5, "env_bytes": 4096, "plan_json_s_8192": 1.0, "plan_start_s": 0.5}


class _Ref:
    """What the recorder hands out in place of an ObjectRef: which object, and its size."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Store:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.objects: list = []

    def put(self, value):
        self.sizes.append(len(pickle.dumps(value, protocol=5)))
        self.objects.append(value)
        return _Ref(len(self.sizes) - 1)


class _WorkerGroup:
    def __init__(self, facts) -> None:
        self.facts = facts
        self.applied = None

    def execute(self, fn, *args):
        if fn.__name__ == "gather_facts":
            return list(self.facts)
        if fn.__name__ == "apply_env":
            self.applied = args
            return [None] * len(self.facts)
        raise AssertionError(fn.__name__)

    def execute_single(self, rank, fn, *args):
        assert fn.__name__ == "reserve_ports" and rank == 0
        return [29500 + i for i in range(args[0])]


def neuron_facts(nodes: int, per_node: int):
    from ray_train_xla.planning.topology import WorkerFacts

    return [
        WorkerFacts(node_id=f"{n:056x}", node_ip=f"10.{n // 250}.{n % 250}.1", pid=10000 + w,
                    hostname=f"ip-10-0-{n}", accelerator_ids={"neuron_cores": (str(w),)},
                    has_efa=True, network_interface="ens32")
        for n in range(nodes) for w in range(per_node)
    ]


def start_once(facts):
    """One on_start; returns (seconds, store, group)."""
    from ray_train_xla.driver import backend
    from ray_train_xla.driver.config import TorchXLAConfig

    store, group = _Store(), _WorkerGroup(facts)
    config = TorchXLAConfig(device="neuron", compile_cache="/fsx/neuron-cache")
    backend.put = store.put
    try:
        t = time.perf_counter()
        backend.XLABackend().on_start(group, config)
        seconds = time.perf_counter() - t
    finally:
        backend.put = backend.ray.put
    return seconds, store, group


def scale_figures(nodes: int, per_node: int, reps: int) -> dict:
    facts = neuron_facts(nodes, per_node)
    times, store, group = [], None, None
    for _ in range(reps):
        seconds, store, group = start_once(facts)
        times.append(seconds)
    index_ref = group.applied[0]
    index = store.objects[index_ref.index]
    index_bytes = store.sizes[index_ref.index]
    node_bytes = [index_bytes + store.sizes[ref.index] for ref in index.values()]
    envs = [env for ref in index.values() for env in store.objects[ref.index].values()]
    env_bytes = [sum(len(k) + len(v) + 2 for k, v in env.items()) for env in envs]
    # What one world-wide object (every node fetching every environment) would have weighed.
    world_bytes = len(pickle.dumps({k: e for ref in index.values()
                                    for k, e in store.objects[ref.index].items()}, protocol=5))
    return {
        "nodes": nodes, "workers": nodes * per_node, "workers_per_node": per_node,
        "driver_s_median": statistics.median(times), "driver_s": times,
        "objects_put": len(store.sizes),
        "index_bytes": index_bytes,
        "node_fetch_bytes_max": max(node_bytes), "node_fetch_bytes_min": min(node_bytes),
        "node_fetch_bytes_per_worker": max(node_bytes) / per_node,
        "world_object_bytes": world_bytes,
        "env_bytes_max": max(env_bytes), "env_vars": len(envs[0]),
        "workers_planned": len(envs),
    }


def cli_seconds(args: list[str], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ray_train_xla.tools.cli", *args], check=True,
                       stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)

    rows = [scale_figures(n, w, args.reps) for n, w in SCALES]
    for r in rows:
        print(f"{r['workers']:>6} workers on {r['nodes']} nodes: driver {r['driver_s_median']:.3f} s, "
              f"node fetches {r['node_fetch_bytes_max']:,} B (index {r['index_bytes']:,} B; one "
              f"world object would be {r['world_object_bytes']:,} B), env <= {r['env_bytes_max']} B",
              flush=True)
    start = cli_seconds(["--help"], args.reps)
    plan_small = cli_seconds(["plan", "--device", "neuron", "--nodes", "2", "--workers-per-node",
                              "2"], args.reps)
    plan_json = cli_seconds(["plan", "--device", "neuron", "--nodes", "128", "--workers-per-node",
                             "64", "--json"], args.reps)
    cli = {"help_s": start, "plan_start_s": plan_small, "plan_json_8192_s": plan_json,
           "plan_json_8192_beyond_start_s": plan_json - start}
    print(f"CLI: --help {start:.3f} s, plan (4 workers) {plan_small:.3f} s, plan --json 8,192 "
          f"workers {plan_json:.3f} s ({plan_json - start:.3f} s beyond start-up)", flush=True)

    r8k = rows[0]
    checks = [
        ("driver planning + distribution, 8,192 workers", f"{r8k['driver_s_median']:.3f} s",
         f"< {TARGETS['driver_s_8192']} s", r8k["driver_s_median"] < TARGETS["driver_s_8192"]),
        ("driver planning + distribution, 32,768 workers", f"{rows[1]['driver_s_median']:.3f} s",
         "(reported)", None),
        ("bytes a node fetches, 8,192 workers (64 on the node)",
         f"{r8k['node_fetch_bytes_max']:,} B ({r8k['node_fetch_bytes_per_worker']:.0f} B/worker; "
         f"index {r8k['index_bytes']:,} B)",
         f"its own workers' envs, not the world's ({r8k['world_object_bytes']:,} B)",
         r8k["node_fetch_bytes_max"] < r8k["world_object_bytes"] / 10),
        ("bytes a node fetches, 32,768 workers (64 on the node)",
         f"{rows[1]['node_fetch_bytes_max']:,} B (index {rows[1]['index_bytes']:,} B)",
         f"its own workers' envs, not the world's ({rows[1]['world_object_bytes']:,} B)",
         rows[1]["node_fetch_bytes_max"] < rows[1]["world_object_bytes"] / 10),
        ("largest worker environment", f"{max(r['env_bytes_max'] for r in rows)} B",
         f"< {TARGETS['env_bytes']} B", max(r["env_bytes_max"] for r in rows) < TARGETS["env_bytes"]),
        ("`plan --json`, 8,192 workers, beyond start-up", f"{cli['plan_json_8192_beyond_start_s']:.3f} s",
         f"< {TARGETS['plan_json_s_8192']} s",
         cli["plan_json_8192_beyond_start_s"] < TARGETS["plan_json_s_8192"]),
        ("`ray-train-xla plan` start (4 workers)", f"{cli['plan_start_s']:.3f} s",
         f"< {TARGETS['plan_start_s']} s", cli["plan_start_s"] < TARGETS["plan_start_s"]),
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump({"scales": rows, "cli": cli, "targets": TARGETS, "reps": args.reps}, f, indent=1)
    lines = ["# Backend start at scale (simulated worker group, Neuron plan)", "",
             f"Median of {args.reps} runs on this machine ({os.cpu_count()} cores).", "",
             "| figure | measured | target | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {target} | {'' if ok is None else ('yes' if ok else 'NO')} |"
              for name, value, target, ok in checks]
    with open(os.path.join(args.out, "scale.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(ok is not False for *_, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
