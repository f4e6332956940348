"""The demo jobs, on an embedded local Ray or a cluster (``address``), under any of the three
configs (``config_name``: xla, neuron, tpu): the project's seed check (every worker all-reduces
``torch.ones(2, 3)`` on its device with ``ray_train_xla.all_reduce`` and checks the sum), and the
packaged examples (``ray_train_xla.tools.examples``) for ``demo --train`` / ``--sharded``. At the
end, ``ray-train-xla demo``'s parser and command.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from ray_train_xla.tools.args import CommandError, positive_int, where
from ray_train_xla.tools.examples.cluster import (
    CONFIG_CLASSES,
    ExampleUsageError,
    add_cluster_args,
    add_config_arg,
    check_cluster,
    check_config,
    ray_session,
    resolve_device,
    scaling_config,
    torch_config,
)

EXAMPLES = ("train_mlp", "train_lm")  # the packaged examples, ray_train_xla.tools.examples.*


@dataclass
class DemoSummary:
    config: str
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
    expected = torch.ones(2, 3) * rtx.world_size()
    for i in range(config["iterations"]):
        result = rtx.all_reduce(torch.ones(2, 3, device=device)).cpu()
        if not torch.equal(result, expected):
            raise AssertionError(
                f"rank {rtx.rank()}, iteration {i}: all_reduce gave {result.tolist()}, "
                f"expected {expected.tolist()}"
            )
    ray.get(config["records"].add.remote({
        "rank": rtx.rank(),
        "device": str(device),
        "pjrt_device": os.environ.get("PJRT_DEVICE", ""),
        "process_group": worker_context().pg_backend,
    }))


def run_demo(workers: int = 2, iterations: int = 10, device: str = "auto",
             address: str | None = None, tpu_topology: str | None = None,
             accelerator_type: str | None = None, config_name: str = "xla") -> DemoSummary:
    """Run the seed check on ``workers`` workers under ``config_name`` (xla, neuron or tpu): on
    an embedded local Ray (started and shut down here), or on the cluster at ``address``."""
    import ray
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import check_scaling_config

    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp, \
            ray_session(address, num_cpus=max(2, workers + 1), log_to_driver=False):
        device = resolve_device(device)
        config = torch_config(config_name, device, timeout_s=120)
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
        config=CONFIG_CLASSES[config_name],
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


def run_train_demo(workers: int = 2, steps: int = 40, device: str = "auto",
                   address: str | None = None, tpu_topology: str | None = None,
                   accelerator_type: str | None = None, storage_path: str | None = None,
                   report_every: int = 20, config_name: str = "xla") -> TrainSummary:
    """Train the example MLP (``tools/examples/train_mlp.py``) on ``workers`` workers under
    ``config_name``: on an embedded local Ray, or on the cluster at ``address``. Checkpoints go
    to ``storage_path`` (default: a temporary directory, deleted after) under the run name
    ``train_mlp``."""
    example = load_example("train_mlp")
    config = example.default_config(steps, report_every)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp, \
            ray_session(address, num_cpus=max(2, workers + 1), log_to_driver=False):
        start = time.perf_counter()
        result = example.build_trainer(
            workers, config, tmp if storage_path is None else storage_path, "train_mlp",
            resolve_device(device), keep=None, tpu_topology=tpu_topology,
            accelerator_type=accelerator_type, config_name=config_name).fit()
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
                     storage_path: str | None = None, config_name: str = "xla") -> ShardedSummary:
    """Train the example transformer LM (``tools/examples/train_lm.py``) sharded: under xla
    with FSDPv2 over ``devices`` devices of each of ``workers`` SPMD workers (virtual XLA CPU
    devices of one worker on the CPU, else NeuronCores / TPU chips asked of Ray); under neuron
    or tpu with FSDP2 over ``workers`` workers of one device each. On an embedded local Ray, or
    on the cluster at ``address``."""
    example = load_example("train_lm")
    config = example.lm_config(steps=steps)
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-demo-") as tmp, \
            ray_session(address, num_cpus=4, log_to_driver=False):
        start = time.perf_counter()
        result = example.build_trainer(
            config, devices, tmp if storage_path is None else storage_path, "train_lm",
            resolve_device(device), keep=None, workers=workers, tpu_topology=tpu_topology,
            accelerator_type=accelerator_type, config_name=config_name).fit()
        seconds = time.perf_counter() - start
        history = []
        for checkpoint, metrics in result.best_checkpoints:
            # Sizes where the driver sees the checkpoint (a local path, or a mounted shared one).
            files = os.listdir(checkpoint.path) if os.path.isdir(checkpoint.path) else []
            history.append({**metrics, "checkpoint_files": len(files), "checkpoint_bytes": sum(
                os.path.getsize(os.path.join(checkpoint.path, f)) for f in files)})
        history.sort(key=lambda m: m["step"])
    parameters = sum(p.numel() for p in example.make_model(config).parameters())
    return ShardedSummary(devices if config_name == "xla" else workers, steps, seconds,
                          parameters, history)


# ``ray-train-xla demo``: its parser and its command.
def add_parser(sub) -> argparse.ArgumentParser:
    """``demo``: the seed check, or a training run (--train, --sharded), on Ray."""
    demo = sub.add_parser(
        "demo",
        help="run the seed check (or, with --train, a training run) on an embedded local Ray "
        "or a cluster, under each config or the one --config names",
        description="Run TorchTrainer on an embedded local Ray (or the cluster at --address) "
        "under TorchXLAConfig, TorchNeuronConfig and TorchTPUConfig in turn (their CPU twins "
        "on the CPU), or under the one --config names, and have every worker all-reduce "
        "torch.ones(2, 3) on its device N times, checking the result equals ones * "
        "world_size. With --train, train the packaged MLP example (examples/train_mlp.py) "
        "instead and print the loss and graph compile counts as it goes down. With --sharded, "
        "train the packaged transformer LM example (examples/train_lm.py) sharded, with Ray "
        "Data batches and sharded checkpoints: under xla with FSDPv2 over --devices devices of "
        "each SPMD worker (virtual XLA CPU devices of one worker on the CPU), under neuron or "
        "tpu with FSDP2 over --workers workers; print loss, compile counts and checkpoint sizes "
        "(about 40 s a config on the CPU). With --device neuron or tpu every worker asks Ray "
        "for its NeuronCores or TPU chips, and --config says which stack runs them. Exits "
        "non-zero on failure.",
    )
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument(
        "--train", action="store_true",
        help="train the example MLP (ray_train_xla.tools.examples.train_mlp) instead",
    )
    mode.add_argument(
        "--sharded", action="store_true",
        help="train the example transformer LM sharded (ray_train_xla.tools.examples.train_lm) "
        "instead",
    )
    add_config_arg(demo, default=None, help_default="default: each of the three in turn on the "
                   "CPU; on --device neuron or tpu, give the stack the cluster runs")
    demo.add_argument(
        "--workers", type=positive_int, default=None,
        help="workers (default 2; with --sharded under xla: SPMD workers, one per node, default "
        "1, and 1 on the CPU)")
    demo.add_argument(
        "--iterations", type=positive_int, default=None,
        help="all-reduces per worker of the seed check (default 10; not with --train or --sharded)"
    )
    demo.add_argument(
        "--devices", type=positive_int, default=None,
        help="with --sharded under xla: each SPMD worker's devices, virtual XLA CPU devices on "
        "the CPU, else NeuronCores / TPU chips asked of Ray (default 4)",
    )
    demo.add_argument(
        "--steps", type=positive_int, default=None,
        help="training steps with --train or --sharded (default 40)",
    )
    demo.add_argument(
        "--storage-path", default=None, metavar="PATH",
        help="with --train or --sharded: where checkpoints go (default: a temporary directory, "
        "deleted after); on a cluster of several nodes a path every node reaches (shared "
        "filesystem, s3://, gs://)",
    )
    add_cluster_args(demo)
    return demo


# demo: which flags each mode takes, and their defaults there (None: refused in that mode).
DEMO_DEFAULTS = {
    "seed check": {"workers": 2, "iterations": 10, "steps": None, "devices": None,
                   "storage_path": None},
    "--train": {"workers": 2, "iterations": None, "steps": 40, "devices": None,
                "storage_path": ""},
    "--sharded": {"workers": 1, "iterations": None, "steps": 40, "devices": 4,
                  "storage_path": ""},
}
# --sharded under a native config: FSDP2 over this many workers of one device each.
SHARDED_NATIVE_WORKERS = 2


def _demo_flags(args: argparse.Namespace) -> tuple[str, list[str]]:
    """Fill in the demo's defaults for its mode; refuse a flag the mode does not take, and a
    config the device does not run. Returns the mode and the configs to run, in order."""
    mode = "--sharded" if args.sharded else "--train" if args.train else "seed check"
    configs = _configs(args)
    native_sharded = mode == "--sharded" and all(c != "xla" for c in configs)
    for name, default in DEMO_DEFAULTS[mode].items():
        given = getattr(args, name)
        if default is None and given is not None:
            flag = "--" + name.replace("_", "-")
            takes = [m for m, d in DEMO_DEFAULTS.items() if d[name] is not None]
            raise CommandError(f"{flag} goes with {' or '.join(takes)}, not the {mode}"
                               if mode == "seed check" else
                               f"{flag} does not go with {mode} (it goes with "
                               f"{' or '.join(takes)})")
        if name == "devices" and native_sharded and given is not None:
            raise CommandError(f"--devices goes with --sharded under --config xla (SPMD): under "
                               f"--config {configs[0]} each worker has one device; give --workers")
    from ray_train_xla.tools.examples.train_lm import check_workers

    try:  # refused before Ray starts
        for config in configs:
            if mode == "--sharded" and args.workers is not None:
                check_workers(args.device, args.workers, config)
            check_cluster(args.device, args.workers or DEMO_DEFAULTS[mode]["workers"],
                          args.tpu_topology, args.accelerator_type)
    except ExampleUsageError as exc:
        raise CommandError(str(exc)) from exc
    for name, default in DEMO_DEFAULTS[mode].items():
        if name != "workers" and getattr(args, name) is None:
            setattr(args, name, default or None)
    return mode, configs


def _configs(args: argparse.Namespace) -> list[str]:
    """The configs the demo runs: the one --config names, else every one on the CPU; an
    accelerator needs --config (its stack: torch_xla or the native one)."""
    if args.config is not None:
        try:
            check_config(args.config, args.device)
        except ExampleUsageError as exc:
            raise CommandError(str(exc)) from exc
        return [args.config]
    if args.device == "cpu":
        return list(CONFIG_CLASSES)
    choices = {"neuron": "--config xla (torch_xla: Neuron SDK 2.29 and earlier) or --config neuron "
                         "(native TorchNeuron: Neuron SDK 2.30 and later)",
               "tpu": "--config xla (torch_xla) or --config tpu (native TorchTPU, torch-tpu)",
               "auto": "--config xla, neuron or tpu (the stack the cluster's nodes have)"}
    raise CommandError(f"--device {args.device}: give the stack that runs it, {choices[args.device]}")


def _workers(args: argparse.Namespace, mode: str, config: str) -> int:
    if args.workers is not None:
        return args.workers
    if mode == "--sharded" and config != "xla":
        return SHARDED_NATIVE_WORKERS
    return DEMO_DEFAULTS[mode]["workers"]


def _cluster_kwargs(args: argparse.Namespace) -> dict:
    return {"device": args.device, "address": args.address, "tpu_topology": args.tpu_topology,
            "accelerator_type": args.accelerator_type}


def _run_job(banner: str, job, **kwargs):
    """Print what runs, run it; a training failure is printed as one FAILED line (None
    returned). A configuration refused before the run starts is a usage error."""
    from ray_train_xla.errors import XLAConfigError, run_failure

    print(banner, flush=True)
    try:
        return job(**kwargs)
    except ExampleUsageError as exc:
        raise CommandError(str(exc)) from exc
    except XLAConfigError:
        raise
    except Exception as exc:  # any training failure is a failed demo, not a traceback
        print(f"FAILED: {run_failure(exc)}", file=sys.stderr)
        return None


def cmd_demo(args: argparse.Namespace) -> int:
    mode, configs = _demo_flags(args)
    run = {"--sharded": cmd_sharded_demo, "--train": cmd_train_demo, "seed check": cmd_seed_check}[mode]
    workers = max(_workers(args, mode, c) for c in configs)
    # One Ray for every config: a cluster joined once, or one embedded Ray started once.
    with ray_session(args.address, num_cpus=max(2, workers + 1) if mode != "--sharded" else 4,
                     log_to_driver=False):
        codes = [run(args, config, _workers(args, mode, config)) for config in configs]
    if len(configs) > 1:
        passed = [CONFIG_CLASSES[c] for c, code in zip(configs, codes) if code == 0]
        print(f"{len(passed)} of {len(configs)} configs passed"
              + (f": {', '.join(passed)}" if passed else ""))
    if args.device == "cpu":
        print("This ran on the CPU. The Trainium and TPU paths are checked against each "
              "runtime's own start-up code and test doubles, not yet on hardware: run "
              "`ray-train-xla check` on yours first (README, What has run where).")
    return max(codes)


def cmd_seed_check(args: argparse.Namespace, config: str, workers: int) -> int:
    summary = _run_job(
        f"ray-train-xla demo: {CONFIG_CLASSES[config]}, {workers} workers, "
        f"device={args.device}, {args.iterations} all-reduces each, on {where(args)}...",
        run_demo, workers=workers, iterations=args.iterations, config_name=config,
        **_cluster_kwargs(args))
    if summary is None:
        return 1
    status = "OK" if summary.ok else "FAILED"
    print(
        f"{status}: {summary.config} workers={summary.workers} device={summary.device} "
        f"({f'PJRT_DEVICE={summary.pjrt_device}, ' if summary.pjrt_device else ''}"
        f"process group={summary.process_group}) "
        f"iterations={summary.iterations} all_reduce(ones(2,3)) == ones*{summary.workers} "
        f"time={summary.seconds:.1f}s"
    )
    return 0 if summary.ok else 1


def cmd_train_demo(args: argparse.Namespace, config: str, workers: int) -> int:
    summary = _run_job(
        f"ray-train-xla demo --train: {CONFIG_CLASSES[config]}, {workers} workers, "
        f"device={args.device}, {args.steps} steps of the example MLP (train_mlp) on "
        f"{where(args)}...",
        run_train_demo, workers=workers, steps=args.steps, storage_path=args.storage_path,
        config_name=config, **_cluster_kwargs(args))
    if summary is None:
        return 1
    print(f"{'step':>6}  {'loss':>10}  {'compiles':>8}  {'after warm-up':>13}  {'compile s':>9}")
    for m in summary.history:
        print(f"{m['step']:>6}  {m['loss']:>10.5f}  {m['xla/compiles']:>8}  "
              f"{m['xla/compiles_after_warmup']:>13}  {m['xla/compile_time_s']:>9.2f}")
    status = "OK" if summary.ok else "FAILED"
    losses = [m["loss"] for m in summary.history] or [float("nan")]
    print(f"{status}: {CONFIG_CLASSES[config]} loss {losses[0]:.5f} -> {losses[-1]:.5f} in "
          f"{summary.steps} steps, {len(summary.history)} checkpoints reported, "
          f"time={summary.seconds:.1f}s")
    return 0 if summary.ok else 1


def cmd_sharded_demo(args: argparse.Namespace, config: str, workers: int) -> int:
    if config != "xla":
        what = f"FSDP2 over {workers} workers, device={args.device}"
    elif args.device == "cpu":
        what = f"FSDPv2 over 1 SPMD worker, {args.devices} virtual XLA CPU devices"
    else:
        what = (f"FSDPv2 over {workers} SPMD worker{'s' if workers > 1 else ''}, {args.devices} "
                f"devices each, device={args.device}")
    summary = _run_job(
        f"ray-train-xla demo --sharded: {CONFIG_CLASSES[config]}, {what}, {args.steps} steps "
        f"of the example transformer LM (train_lm) on {where(args)}...",
        run_sharded_demo, devices=args.devices, steps=args.steps, workers=workers,
        storage_path=args.storage_path, config_name=config, **_cluster_kwargs(args))
    if summary is None:
        return 1
    print(f"{'step':>6}  {'loss':>8}  {'compiles':>8}  {'after warm-up':>13}  {'checkpoint':>22}")
    for m in summary.history:
        size = f"{m['checkpoint_bytes'] / 1e6:.2f} MB in {m['checkpoint_files']} files"
        print(f"{m['step']:>6}  {m['loss']:>8.4f}  {m['xla/compiles']:>8}  "
              f"{m['xla/compiles_after_warmup']:>13}  {size:>22}")
    status = "OK" if summary.ok else "FAILED"
    losses = [m["loss"] for m in summary.history] or [float("nan")]
    per = "per worker" if config == "xla" else "in all"
    print(f"{status}: {CONFIG_CLASSES[config]} loss {losses[0]:.4f} -> {losses[-1]:.4f} in "
          f"{summary.steps} steps; {summary.parameters} parameters sharded over "
          f"{summary.devices} devices {per}; time={summary.seconds:.1f}s")
    return 0 if summary.ok else 1
