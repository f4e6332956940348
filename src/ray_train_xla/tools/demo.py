"""The demo jobs, on an embedded local Ray or a cluster (``address``): the project's seed check,
and the packaged examples (``ray_train_xla.tools.examples``) for ``demo --train`` / ``--sharded``.

In the seed check every worker all-reduces ``torch.ones(2, 3)`` on its XLA device ``iterations``
times with ``ray_train_xla.all_reduce`` and checks that the result equals ``ones * world_size``.
On ``neuron`` / ``tpu`` every worker asks Ray for its NeuronCores / TPU chips
(``tools/examples/cluster.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass

from ray_train_xla.tools.examples.cluster import ray_session, resolve_device, scaling_config

EXAMPLES = ("train_mlp", "train_lm")  # the packaged examples, ray_train_xla.tools.examples.*


@dataclass
class DemoSummary:
    workers: int
    device: str
    pjrt_device: str
    process_group: str
    iterations: int
    seconds: float
    ok: bool


class Records:
    """A Ray actor the seed check's workers hand their records to: it works on any cluster
    (Ray Train V2 keeps no metrics reported without a checkpoint, and workers on other nodes
    cannot write into the driver's files)."""

    def __init__(self):
        self.records = []

    def add(self, record: dict) -> None:
        self.records.append(record)

    def get(self) -> list:
        return sorted(self.records, key=lambda r: r["rank"])


def seed_check_loop(config: dict) -> None:
    """Training function: all-reduce ones N times and assert the sum; record what it saw."""
    import ray
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
    ray.get(config["records"].add.remote({
        "rank": rtx.rank(),
        "device": str(device),
        "pjrt_device": os.environ.get("PJRT_DEVICE", ""),
        "process_group": worker_context().pg_backend,
        "loop_seconds": elapsed,
    }))


def run_demo(workers: int = 2, iterations: int = 10, device: str = "auto",
             address: str | None = None, tpu_topology: str | None = None,
             accelerator_type: str | None = None) -> DemoSummary:
    """Run the seed check on ``workers`` workers: on an embedded local Ray (started and shut
    down here), or on the cluster at ``address``."""
    import ray
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchXLAConfig, check_scaling_config

    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp, \
            ray_session(address, num_cpus=max(2, workers + 1), log_to_driver=False):
        device = resolve_device(device)
        config = TorchXLAConfig(device=device, timeout_s=120)
        scaling = scaling_config(device, workers, 1, tpu_topology, accelerator_type)
        check_scaling_config(scaling, config)
        collector = ray.remote(Records).options(num_cpus=0).remote()
        start = time.perf_counter()
        TorchTrainer(
            seed_check_loop,
            train_loop_config={"iterations": iterations, "records": collector},
            torch_config=config,
            scaling_config=scaling,
            run_config=RunConfig(storage_path=os.path.join(tmp, "results"), name="demo"),
        ).fit()
        seconds = time.perf_counter() - start
        records = ray.get(collector.get.remote())
        ray.kill(collector)
    first = records[0] if records else {}
    return DemoSummary(
        workers=workers,
        device=first.get("device", "?"),
        pjrt_device=first.get("pjrt_device", "?"),
        process_group=first.get("process_group", "?"),
        iterations=iterations,
        seconds=seconds,
        ok=[r["rank"] for r in records] == list(range(workers)),
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


def load_example(name_or_path: str = "train_mlp"):
    """An example's module: a packaged one by name (``train_mlp``, ``train_lm``: workers import
    it as any module of the package), or a file of your own by path, imported here and
    registered so that Ray ships it by value (workers cannot import it by name)."""
    if name_or_path in EXAMPLES:
        return importlib.import_module(f"ray_train_xla.tools.examples.{name_or_path}")
    import sys

    import ray.cloudpickle

    if not os.path.exists(name_or_path):
        raise FileNotFoundError(f"{name_or_path} not found: an example is one of {EXAMPLES} "
                                "or the path of a Python file")
    name = "ray_train_xla_example_" + os.path.splitext(os.path.basename(name_or_path))[0]
    spec = importlib.util.spec_from_file_location(name, name_or_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def _storage(storage_path: str | None, tmp: str) -> str:
    return storage_path if storage_path is not None else tmp


def run_train_demo(workers: int = 2, steps: int = 40, device: str = "auto",
                   address: str | None = None, tpu_topology: str | None = None,
                   accelerator_type: str | None = None, storage_path: str | None = None,
                   report_every: int = 20) -> TrainSummary:
    """Train the example MLP (``tools/examples/train_mlp.py``) on ``workers`` workers: on an
    embedded local Ray, or on the cluster at ``address``. Checkpoints go to ``storage_path``
    (default: a temporary directory, deleted after) under the run name ``train_mlp``."""
    example = load_example("train_mlp")
    config = example.default_config(steps, report_every)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp, \
            ray_session(address, num_cpus=max(2, workers + 1), log_to_driver=False):
        start = time.perf_counter()
        trainer = example.build_trainer(workers, config, _storage(storage_path, tmp), "train_mlp",
                                        resolve_device(device), keep=None,
                                        tpu_topology=tpu_topology,
                                        accelerator_type=accelerator_type)
        result = trainer.fit()
        seconds = time.perf_counter() - start
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


def run_sharded_demo(devices: int = 4, steps: int = 40, device: str = "cpu", workers: int = 1,
                     address: str | None = None, tpu_topology: str | None = None,
                     accelerator_type: str | None = None,
                     storage_path: str | None = None) -> ShardedSummary:
    """Train the example transformer LM (``tools/examples/train_lm.py``) sharded over
    ``devices`` devices of each of ``workers`` SPMD workers (virtual XLA CPU devices of one
    worker on the CPU, else NeuronCores / TPU chips asked of Ray): on an embedded local Ray, or
    on the cluster at ``address``."""
    example = load_example("train_lm")
    config = example.lm_config(steps=steps)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp, \
            ray_session(address, num_cpus=4, log_to_driver=False):
        start = time.perf_counter()
        trainer = example.build_trainer(config, devices, _storage(storage_path, tmp), "train_lm",
                                        resolve_device(device), keep=None, workers=workers,
                                        tpu_topology=tpu_topology,
                                        accelerator_type=accelerator_type)
        result = trainer.fit()
        seconds = time.perf_counter() - start
        history = []
        for checkpoint, metrics in result.best_checkpoints:
            # Sizes where the driver sees the checkpoint (a local path, or a mounted shared one).
            files = os.listdir(checkpoint.path) if os.path.isdir(checkpoint.path) else []
            history.append({**metrics, "checkpoint_files": len(files), "checkpoint_bytes": sum(
                os.path.getsize(os.path.join(checkpoint.path, f)) for f in files)})
        history.sort(key=lambda m: m["step"])
    parameters = sum(p.numel() for p in example.make_model(config).parameters())
    return ShardedSummary(devices, steps, seconds, parameters, history)
