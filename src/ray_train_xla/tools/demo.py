"""The demo job: the project's seed check, on an embedded local Ray.

Every worker all-reduces ``torch.ones(2, 3)`` on its XLA device ``iterations`` times with
``ray_train_xla.all_reduce`` and checks that the result equals ``ones * world_size``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass


@dataclass
class DemoSummary:
    workers: int
    device: str
    pjrt_device: str
    process_group: str
    iterations: int
    seconds: float
    ok: bool


def seed_check_loop(config: dict) -> None:
    """Training function: all-reduce ones N times and assert the sum; record what it saw."""
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.planning.contract import worker_context

    device = rtx.get_device()
    n = rtx.world_size()
    expected = torch.ones(2, 3) * n
    start = time.perf_counter()
    for i in range(config["iterations"]):
        result = rtx.all_reduce(torch.ones(2, 3, device=device)).cpu()
        if not torch.equal(result, expected):
            raise AssertionError(
                f"rank {rtx.rank()}, iteration {i}: all_reduce gave {result.tolist()}, "
                f"expected {expected.tolist()}"
            )
    elapsed = time.perf_counter() - start
    record = {
        "rank": rtx.rank(),
        "device": str(device),
        "pjrt_device": os.environ.get("PJRT_DEVICE", ""),
        "process_group": worker_context().pg_backend,
        "loop_seconds": elapsed,
    }
    with open(os.path.join(config["out_dir"], f"rank{rtx.rank()}.json"), "w") as f:
        json.dump(record, f)


def run_demo(workers: int = 2, iterations: int = 10, device: str = "auto") -> DemoSummary:
    """Start a local Ray, run the seed check on ``workers`` workers, shut Ray down."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig

    config = TorchXLAConfig(device=device, timeout_s=120)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp:
        out_dir = os.path.join(tmp, "out")
        os.makedirs(out_dir)
        started_ray = not ray.is_initialized()
        if started_ray:
            # address="local": never attach to a stale cluster another program left behind.
            ray.init(
                address="local",
                num_cpus=max(2, workers + 1),
                include_dashboard=False,
                log_to_driver=False,
            )
        try:
            start = time.perf_counter()
            TorchTrainer(
                seed_check_loop,
                train_loop_config={"iterations": iterations, "out_dir": out_dir},
                torch_config=config,
                scaling_config=ScalingConfig(num_workers=workers),
                run_config=RunConfig(storage_path=os.path.join(tmp, "results"), name="demo"),
            ).fit()
            seconds = time.perf_counter() - start
        finally:
            if started_ray:
                ray.shutdown()
        records = []
        for name in sorted(os.listdir(out_dir)):
            with open(os.path.join(out_dir, name)) as f:
                records.append(json.load(f))
    first = records[0] if records else {}
    return DemoSummary(
        workers=workers,
        device=first.get("device", "?"),
        pjrt_device=first.get("pjrt_device", "?"),
        process_group=first.get("process_group", "?"),
        iterations=iterations,
        seconds=seconds,
        ok=len(records) == workers,
    )


EXAMPLE_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    "examples", "train_mlp.py",
)


@dataclass
class TrainSummary:
    workers: int
    steps: int
    seconds: float
    history: list  # [{"step", "loss", "xla/compiles", ...}] one per report, in step order
    checkpoint: str

    @property
    def ok(self) -> bool:
        return len(self.history) >= 2 and self.history[-1]["loss"] < self.history[0]["loss"]


def load_example(path: str = EXAMPLE_PATH):
    """Import an example (``examples/train_mlp.py`` by default, from a source checkout) so Ray
    ships it by value."""
    import importlib.util
    import sys

    import ray.cloudpickle

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} not found: `demo --train` and `demo --sharded` run examples/ from a source "
            "checkout of ray-train-xla (pip install -e .)"
        )
    name = "ray_train_xla_example_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # workers cannot import it by name
    return module


def run_train_demo(workers: int = 2, steps: int = 40, device: str = "auto") -> TrainSummary:
    """Start a local Ray, train the example MLP on ``workers`` workers, shut Ray down."""
    import ray

    example = load_example()
    config = example.default_config(steps)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp:
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(address="local", num_cpus=max(2, workers + 1), include_dashboard=False,
                     log_to_driver=False)
        try:
            start = time.perf_counter()
            trainer = example.build_trainer(workers, config, tmp, "train_mlp", device, keep=None)
            result = trainer.fit()
            seconds = time.perf_counter() - start
        finally:
            if started_ray:
                ray.shutdown()
        history = sorted((dict(m) for _, m in result.best_checkpoints), key=lambda m: m["step"])
        checkpoint = result.checkpoint.path if result.checkpoint else ""
    return TrainSummary(workers, steps, seconds, history, checkpoint)


@dataclass
class ShardedSummary:
    devices: int
    steps: int
    seconds: float
    parameters: int
    # [{"step", "loss", "xla/compiles", ..., "checkpoint_bytes", "checkpoint_files"}], in step order
    history: list

    @property
    def ok(self) -> bool:
        return len(self.history) >= 2 and self.history[-1]["loss"] < self.history[0]["loss"]


def run_sharded_demo(devices: int = 4, steps: int = 40) -> ShardedSummary:
    """Start a local Ray, train examples/train_lm.py sharded over ``devices`` virtual XLA CPU
    devices of one SPMD worker, shut Ray down."""
    import ray

    example = load_example(os.path.join(os.path.dirname(EXAMPLE_PATH), "train_lm.py"))
    config = example.lm_config(steps=steps)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp:
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            start = time.perf_counter()
            trainer = example.build_trainer(config, devices, tmp, "train_lm", keep=None)
            result = trainer.fit()
            seconds = time.perf_counter() - start
        finally:
            if started_ray:
                ray.shutdown()
        history = []
        for checkpoint, metrics in result.best_checkpoints:
            files = os.listdir(checkpoint.path)
            history.append({**metrics, "checkpoint_files": len(files), "checkpoint_bytes": sum(
                os.path.getsize(os.path.join(checkpoint.path, f)) for f in files)})
        history.sort(key=lambda m: m["step"])
    parameters = sum(p.numel() for p in example.make_model(config).parameters())
    return ShardedSummary(devices, steps, seconds, parameters, history)
