"""How the examples and ``ray-train-xla demo`` reach Ray and ask it for accelerators. Each
worker's NeuronCores or TPU chips are requested from Ray, so the backend plans with the ids Ray
assigned; on TPU through Ray Train V2's ``ScalingConfig(use_tpu=True, topology=...,
accelerator_type=...)``, which reserves a whole slice for more than one worker.
"""

from __future__ import annotations

import argparse
import contextlib
import os

DEVICES = ("auto", "cpu", "neuron", "tpu")
NEURON_RESOURCE = "neuron_cores"
TPU_RESOURCE = "TPU"
# ``--config``: the config class of each stack, and the devices it runs on (its CPU twin
# included): xla is torch_xla (Trainium's XLA SDK up to Neuron 2.29, TPU, CPU); neuron is native
# TorchNeuron (Neuron SDK 2.30+); tpu is native TorchTPU (torch-tpu).
CONFIG_CLASSES = {"xla": "TorchXLAConfig", "neuron": "TorchNeuronConfig", "tpu": "TorchTPUConfig"}
CONFIG_DEVICES = {"xla": ("cpu", "neuron", "tpu"), "neuron": ("cpu", "neuron"),
                  "tpu": ("cpu", "tpu")}


class ExampleUsageError(ValueError):
    """A command line the examples refuse (printed as one line, exit status 2)."""


def add_config_arg(parser: argparse.ArgumentParser, default: str | None = "xla",
                   help_default: str = "default xla") -> None:
    """``--config``: which of the three configs runs the job (``CONFIG_CLASSES``)."""
    parser.add_argument(
        "--config", default=default, choices=list(CONFIG_CLASSES),
        help="xla: TorchXLAConfig (torch_xla: Trainium with Neuron SDK 2.29 and earlier, TPU, "
        "CPU); neuron: TorchNeuronConfig (native TorchNeuron, Neuron SDK 2.30+); tpu: "
        "TorchTPUConfig (native TorchTPU, torch-tpu). Each runs on its device or on the CPU, "
        f"where the native ones need no torch_xla ({help_default})")


def check_config(config: str, device: str) -> None:
    """Refuse a ``--config`` on a device it does not run on (``auto`` is checked once
    resolved)."""
    if config not in CONFIG_DEVICES:
        raise ExampleUsageError(f"--config {config!r}: expected one of {', '.join(CONFIG_DEVICES)}")
    if device != "auto" and device not in CONFIG_DEVICES[config]:
        raise ExampleUsageError(
            f"--config {config} ({CONFIG_CLASSES[config]}) runs on --device "
            f"{' or '.join(CONFIG_DEVICES[config])}, not {device}")


def torch_config(config: str, device: str, **options):
    """The config object of ``config`` (xla, neuron or tpu) on ``device`` (resolved), with the
    given fields."""
    import ray_train_xla

    check_config(config, device)
    return getattr(ray_train_xla, CONFIG_CLASSES[config])(device=device, **options)


def add_cluster_args(parser: argparse.ArgumentParser, device_default: str = "cpu",
                     device_of: str = "the config's device") -> None:
    """``--address``, ``--device`` (``device_of``: the config field it sets), ``--tpu-topology``,
    ``--accelerator-type``."""
    parser.add_argument(
        "--address", default=None, metavar="ADDRESS",
        help="the Ray cluster to join (auto, HOST:6379, ray://HOST:10001); default: an embedded "
        "local Ray started for this run")
    parser.add_argument(
        "--device", default=device_default, choices=DEVICES,
        help=f"{device_of} (default {device_default}); neuron and tpu ask Ray for each "
        "worker's NeuronCores / TPU chips; auto: what the cluster has (neuron_cores, else TPU, "
        "else cpu)")
    parser.add_argument(
        "--tpu-topology", default=None, metavar="TOPOLOGY",
        help="with --device tpu: the slice's topology (ScalingConfig.topology, e.g. 4x4); "
        "needed for more than one worker")
    parser.add_argument(
        "--accelerator-type", default=None, metavar="TYPE",
        help="with --device tpu: the slice's type (ScalingConfig.accelerator_type, e.g. "
        "TPU-V6E); needed for more than one worker")


@contextlib.contextmanager
def ray_session(address: str | None, num_cpus: int | None = None, log_to_driver: bool = True):
    """Ray for one run: join ``address``, or start an embedded local Ray (``num_cpus`` CPUs;
    ``address="local"``, never a stale cluster left behind); shut it down after. A Ray this
    process already started is used as it is."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=log_to_driver)
    else:
        ray.init(address=address, log_to_driver=log_to_driver)
    try:
        yield
    finally:
        ray.shutdown()


def resolve_device(device: str) -> str:
    """``auto``: the accelerators of the connected cluster (``neuron_cores``, else ``TPU``),
    else ``cpu``; any other device as given."""
    if device != "auto":
        return device
    import ray

    resources = ray.cluster_resources()
    if resources.get(NEURON_RESOURCE, 0) > 0:
        return "neuron"
    if resources.get(TPU_RESOURCE, 0) > 0:
        return "tpu"
    return "cpu"


def check_cluster(device: str, workers: int, tpu_topology: str | None = None,
                  accelerator_type: str | None = None) -> None:
    """What can be refused before Ray starts: ``--tpu-topology`` / ``--accelerator-type`` on a
    device other than ``tpu`` (``auto`` is checked again once resolved); on ``tpu``, Ray Train
    V1, or several workers without the slice to reserve."""
    if device not in ("tpu", "auto") and (tpu_topology or accelerator_type):
        flag = "--tpu-topology" if tpu_topology else "--accelerator-type"
        raise ExampleUsageError(f"{flag} describes a TPU slice: use it with --device tpu")
    if device != "tpu":
        return
    if os.environ.get("RAY_TRAIN_V2_ENABLED", "1") == "0":
        raise ExampleUsageError(
            "--device tpu needs Ray Train V2 (Ray's default; unset RAY_TRAIN_V2_ENABLED=0): "
            "V1's ScalingConfig has no use_tpu/topology to reserve a TPU slice")
    if workers > 1 and not (tpu_topology and accelerator_type):
        raise ExampleUsageError(
            f"--device tpu with {workers} workers needs --tpu-topology and --accelerator-type: "
            "Ray Train V2 places several TPU workers only on a reserved slice (ScalingConfig "
            "use_tpu=True, topology, accelerator_type)")


def scaling_config(device: str, workers: int, per_worker: int = 1, tpu_topology: str | None = None,
                   accelerator_type: str | None = None):
    """A ``ScalingConfig`` of ``workers`` workers, each asking Ray for ``per_worker``
    NeuronCores or TPU chips on ``device`` (resolved: cpu, neuron or tpu)."""
    from ray.train import ScalingConfig

    if device not in ("cpu", "neuron", "tpu"):
        raise ExampleUsageError(f"device {device!r}: resolve it first (cpu, neuron or tpu)")
    check_cluster(device, workers, tpu_topology, accelerator_type)
    if device == "cpu":
        return ScalingConfig(num_workers=workers)
    if device == "neuron":
        return ScalingConfig(num_workers=workers, resources_per_worker={NEURON_RESOURCE: per_worker})
    try:
        return ScalingConfig(num_workers=workers, use_tpu=True, topology=tpu_topology,
                             accelerator_type=accelerator_type,
                             resources_per_worker={TPU_RESOURCE: per_worker})
    except ValueError as exc:  # Ray's own check of the slice (workers per slice, the names)
        raise ExampleUsageError(f"--device tpu: Ray's ScalingConfig refuses {workers} workers "
                                f"with {TPU_RESOURCE}={per_worker} each: {exc}") from exc
