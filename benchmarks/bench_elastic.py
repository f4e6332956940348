"""Resize downtime of an elastic run: ours against a plain ``TorchConfig(backend="gloo")``.

On a local cluster of its own (``ray.cluster_utils.Cluster``: a head node without worker slots
and two nodes of two), Ray Train V2 runs ``ScalingConfig(num_workers=(2, 4),
elastic_resize_monitor_interval_s=1)``. After ``--steps`` steps of the group of 4 a node is
removed; after as many steps of the group of 2 it is added back; after as many steps of the new
group of 4 the run ends. Measured, per variant and round:

- ``shrink s``: the node's removal (the call) to the first step of the group of 2;
- ``grow s``: the node's arrival (``add_node`` returned) to the first step of the group of 4;
  it includes Ray's detection (the monitor interval, 1 s, and the coordinator's view of the
  cluster, refreshed every second here as in ``tests/test_elastic_ray.py``, 20 s by default;
  ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5``, 60 s by default, bounds a start Ray tries at the
  old size on a stale view);
- ``first start s``: ``fit()`` to the first step.

Variants, the same training function (a 64x64 linear layer, a step every 50 ms, gradients
averaged with ``torch.distributed.all_reduce``, a checkpoint every 5 steps, resumed from it):

- ``gloo``: ``TorchConfig(backend="gloo")``, CPU tensors;
- ``ours-cpu``: ``TorchXLAConfig(device="cpu")``, the same CPU tensors (the default process
  group carries them over gloo): what the backend's start-up adds;
- ``ours-xla``: ``TorchXLAConfig(device="cpu")``, the model on the XLA device with the toolkit
  (``optimizer_step``): adds torch_xla's first compilation of each new group.

Writes ``elastic.json`` and ``elastic.md`` under ``--out``. Run under the machine's Ray lock:

    flock /tmp/ray-lock python benchmarks/bench_elastic.py [--rounds 1] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("gloo", "ours-cpu", "ours-xla")
STEP_SLEEP_S = 0.05
CKPT_EVERY = 5
WAIT_S = 240  # every wait of the driver is bounded
# After a node leaves, Ray Train may first try the old size again (its view of the cluster is a
# moment behind) and waits this long for the placement group (60 s by default) before it sizes
# the group from a fresh view: lowered as in tests/test_elastic_ray.py.
START_TIMEOUT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}


def fast_coordinator():
    """worker_process_setup_hook: refresh the AutoscalingCoordinator's view every second."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coord

    coord._AutoscalingCoordinatorActor.TICK_INTERVAL_S = 1


def train_fn(config):
    import tempfile as tmp

    import ray.train
    import torch
    import torch.distributed as dist

    xla = config["variant"] == "ours-xla"
    if xla:
        import ray_train_xla as rtx

        device = rtx.get_device()
    else:
        device = torch.device("cpu")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(saved["model"])
        step = saved["step"]
    log = open(os.path.join(config["out_dir"], f"steps_{os.getpid()}.jsonl"), "a")
    stop = os.path.join(config["out_dir"], "stop")
    while not os.path.exists(stop):
        opt.zero_grad()
        model(torch.randn(32, 64, device=device)).pow(2).mean().backward()
        if xla:
            rtx.optimizer_step(opt)
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()
        step += 1
        log.write(json.dumps({"world": world, "rank": rank, "step": step, "t": time.time()}) + "\n")
        log.flush()
        if step % CKPT_EVERY == 0:
            with tmp.TemporaryDirectory() as d:
                if rank == 0:
                    state = {k: v.cpu() for k, v in model.state_dict().items()}
                    torch.save({"model": state, "step": step}, os.path.join(d, "state.pt"))
                ray.train.report({"step": step},
                                 checkpoint=ray.train.Checkpoint.from_directory(d))
        time.sleep(STEP_SLEEP_S)


def read_steps(out_dir):
    rows = []
    for name in os.listdir(out_dir):
        if name.startswith("steps_"):
            with open(os.path.join(out_dir, name)) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return rows


def wait_until(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {WAIT_S} s")
        time.sleep(0.05)


def one_round(variant: str, steps: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_train_xla import TorchXLAConfig

    os.environ.update(START_TIMEOUT)  # the cluster's processes inherit it
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False)
        nodes = [cluster.add_node(num_cpus=2, resources={"slot": 2}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": "bench_elastic.fast_coordinator",
                              "env_vars": {"PYTHONPATH": os.pathsep.join(
                                  [HERE, os.environ.get("PYTHONPATH", "")])}})
        out_dir = tempfile.mkdtemp(prefix="rtx-bench-elastic-")
        config = (TorchConfig(backend="gloo") if variant == "gloo"
                  else TorchXLAConfig(device="cpu", timeout_s=60))
        trainer = TorchTrainer(
            train_fn, train_loop_config={"out_dir": out_dir, "variant": variant},
            torch_config=config,
            scaling_config=ScalingConfig(num_workers=(2, 4),
                                         resources_per_worker={"CPU": 1, "slot": 1},
                                         elastic_resize_monitor_interval_s=1),
            run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="rtx-bench-results-"),
                                 failure_config=FailureConfig(max_failures=3)))
        outcome: dict = {}

        def run():
            try:
                outcome["result"] = trainer.fit()
            except BaseException as exc:
                outcome["error"] = exc

        def first(world, after):
            ts = [r["t"] for r in read_steps(out_dir) if r["world"] == world and r["t"] > after]
            return min(ts) if ts else None

        def count(world, after):
            return len({r["step"] for r in read_steps(out_dir)
                        if r["world"] == world and r["t"] > after and r["rank"] == 0})

        t_fit = time.time()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_until(lambda: count(4, t_fit) >= steps or "error" in outcome, "steps of 4 workers")
        t_remove = time.time()
        cluster.remove_node(nodes[1])
        wait_until(lambda: count(2, t_remove) >= steps or "error" in outcome,
                   "steps of 2 workers")
        cluster.add_node(num_cpus=2, resources={"slot": 2})
        t_add = time.time()
        wait_until(lambda: count(4, t_add) >= steps or "error" in outcome,
                   "steps of 4 workers again")
        open(os.path.join(out_dir, "stop"), "w").close()
        thread.join(WAIT_S)
        if "error" in outcome:
            raise RuntimeError(f"{variant}: fit failed: {outcome['error']}")
        return {"variant": variant,
                "first_start_s": first(4, t_fit) - t_fit,
                "shrink_s": first(2, t_remove) - t_remove,
                "grow_s": first(4, t_add) - t_add}
    finally:
        ray.shutdown()
        cluster.shutdown()


def write(results: list[dict], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "elastic.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [
        "# Elastic resize downtime (bench_elastic.py)",
        "",
        "A local cluster (head without worker slots, two nodes of two), Ray Train V2, "
        "`ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=1)`; the Ray "
        "AutoscalingCoordinator's view refreshed every 1 s and "
        "`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=5` (Ray's defaults: 20 s and 60 s). The same "
        "training function in every variant: `gloo` is `TorchConfig(backend=\"gloo\")`, "
        "`ours-cpu` `TorchXLAConfig(device=\"cpu\")` on CPU tensors, `ours-xla` the same config "
        "with the model on the XLA device (`optimizer_step`). Seconds, median (min-max) of "
        f"{len(results) // len(VARIANTS)} round(s) per variant; 2 CPU cores shared with other "
        "work.",
        "",
        "| variant | first start s | shrink s (node removed -> first step of 2) | "
        "grow s (node added -> first step of 4) |",
        "|---|---|---|---|",
    ]
    for variant in VARIANTS:
        rows = [r for r in results if r["variant"] == variant]
        if not rows:
            continue
        cells = []
        for k in ("first_start_s", "shrink_s", "grow_s"):
            values = [r[k] for r in rows]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "elastic.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="steps of each group")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    sys.path.insert(0, HERE)
    results = []
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            row = one_round(variant, args.steps)
            print(json.dumps(row), flush=True)
            results.append(row)
    write(results, args.out)


if __name__ == "__main__":
    main()
