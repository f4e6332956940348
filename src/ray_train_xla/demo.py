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
        "process_group": os.environ.get("RAY_TRAIN_XLA_PG_BACKEND", ""),
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
