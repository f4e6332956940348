"""``ray-train-xla doctor``: check the driver (and, with ``--cluster``, every node) before training.

Each check yields a row: check, node, status (OK, WARN, FAIL), a detail, and for every non-OK
status a one-line fix. Checks read package metadata (never importing torch_xla in this process),
the environment, ``/dev`` and ``/sys``, and the resources Ray advertises for each node; one check
imports torch_xla in a subprocess to prove it loads. In cluster mode one small task runs on each
alive node (``NodeAffinitySchedulingStrategy``), and every wait is bounded by ``timeout_s``.

Every check of a node is one function in ``NODE_CHECKS``; ``check_node`` runs them in that
order. Adding a check is adding a function (``(NodeContext, NodeFacts) -> rows``) and a row there.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from ray_train_xla.startup import netinfo
from ray_train_xla.tools.args import positive_seconds
from ray_train_xla.tools.examples.cluster import NEURON_RESOURCE, TPU_RESOURCE

OK, WARN, FAIL = "OK", "WARN", "FAIL"
NEURON_CACHE_DEFAULT = "/var/tmp/neuron-compile-cache"
NEFF_CACHE_VAR, NEFF_CACHE_DEFAULT = "TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/neff_cache"
PACKAGES = ("torch", "torch_xla", "torch-neuronx", "libneuronxla")
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class Check:
    """One row of the report."""

    check: str
    node: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class NodeContext:
    """What one node's checks know beyond the machine itself."""

    node: str  # label shown in the report
    node_id: str = ""
    node_ip: str = ""
    # Resources Ray advertises for the node; None when not connected to Ray.
    ray_resources: Mapping[str, float] | None = None
    is_head: bool = True
    load_check: bool = True
    timeout_s: float = 60.0
    multi_node: bool = False
    extra: dict = field(default_factory=dict)


# Facts about this machine.


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution (from metadata, nothing imported); None if absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> str:
    """``2.9`` of ``2.9.1+cpu``."""
    return ".".join(str(int("".join(c for c in piece if c.isdigit()) or 0))
                    for piece in version.split("+")[0].split(".")[:2])


def torch_pin(dist: str, requirement: str = "torch") -> str | None:
    """The version specifier ``dist`` declares for ``requirement`` (torch by default) in its
    Requires-Dist (outside extras), if any."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requires = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if _norm(req.name) == _norm(requirement) and str(req.specifier) and (
            req.marker is None or req.marker.evaluate({"extra": ""})
        ):
            return str(req.specifier)
    return None


def pairing(dist: str, dist_version: str, torch_version: str) -> tuple[bool, str]:
    """Whether ``dist`` (torch_xla, torch-neuronx) was built for the installed torch, and how
    that was decided. A torch pin in the package's Requires-Dist wins; torch_xla 2.9 declares
    none, so then the rule is major.minor equality (torch_xla 2.9.0 pairs with torch 2.9.x)."""
    spec = torch_pin(dist)
    if spec:
        from packaging.specifiers import SpecifierSet

        ok = SpecifierSet(spec).contains(torch_version.split("+")[0], prereleases=True)
        return ok, f"{dist} requires torch{spec}"
    ok = _major_minor(dist_version) == _major_minor(torch_version)
    return ok, f"{dist} {dist_version} pairs with torch {_major_minor(dist_version)}.x"


def is_native_neuronx(version: str | None) -> bool:
    """Whether the installed torch-neuronx is native TorchNeuron (Neuron SDK 2.30+): the XLA
    builds require torch-xla, the native one does not."""
    return version is not None and not any(
        _norm(line).startswith("torch-xla") for line in importlib.metadata.requires("torch-neuronx") or [])


def native_rows(version: str, torch_v: str | None, multi_node: bool) -> list[tuple[str, str, str, str]]:
    """(check, status, detail, fix) rows for native TorchNeuron: the package and its torch pin,
    and the NEFF cache directory (``TorchNeuronConfig.compile_cache``)."""
    rows = []
    if torch_v is None:
        rows.append(("native TorchNeuron", FAIL, f"torch-neuronx {version}; torch not installed",
                     "pip install torch-neuronx (it pulls the torch it was built for)"))
    else:
        ok, how = pairing("torch-neuronx", version, torch_v)
        rows.append(("native TorchNeuron", OK if ok else FAIL,
                     f"torch-neuronx {version} ({how}; torch {torch_v}); use TorchNeuronConfig",
                     "install the torch the native torch-neuronx requires, in this environment"))
    path = os.environ.get(NEFF_CACHE_VAR, "")
    where = f"{NEFF_CACHE_VAR}={path}" if path else f"{NEFF_CACHE_DEFAULT} (default; {NEFF_CACHE_VAR} unset)"
    ok, detail = _writable(path or NEFF_CACHE_DEFAULT)
    if not ok:
        rows.append(("NEFF cache", FAIL, f"{where}: {detail}",
                     "make it writable for the user running Ray, or pass "
                     "TorchNeuronConfig(compile_cache=<shared directory>)"))
    elif not path and multi_node:
        rows.append(("NEFF cache", WARN, f"{where}: per node, so every node compiles every graph",
                     "pass TorchNeuronConfig(compile_cache=<directory shared by all nodes>)"))
    else:
        rows.append(("NEFF cache", OK, f"{where}: {detail}", ""))
    return rows


def neuron_devices(dev: str = "/dev") -> list[str]:
    """The Neuron device files (``/dev/neuron0`` ...)."""
    return sorted(p for p in glob.glob(os.path.join(dev, "neuron*")) if p[len(dev) + 7:].isdigit())


def tpu_chips(dev: str = "/dev") -> list[str]:
    """TPU chips: ``/dev/accel*`` (TPU v4/v5p) or ``/dev/vfio/<n>`` groups (v5e, v6e)."""
    accel = sorted(glob.glob(os.path.join(dev, "accel*")))
    if accel:
        return accel
    return sorted(p for p in glob.glob(os.path.join(dev, "vfio", "*")) if os.path.basename(p).isdigit())


def tpu_devices_per_chip(pci: str = "/sys/bus/pci/devices") -> int:
    """Devices per TPU chip on this host: 2 on TPU v7 (a Google PCI device of a generation with
    two devices per chip, as torch-tpu's PCI scan finds it: ``planning/hardware.py`` has the
    ids, or ``TPU_ACCELERATOR_TYPE`` naming a v7x slice), else 1."""
    from ray_train_xla.planning.hardware import (
        GOOGLE_PCI_VENDOR,
        devices_per_chip,
        tpu_generation_of_pci,
    )

    found = devices_per_chip(os.environ.get("TPU_ACCELERATOR_TYPE", ""))
    for vendor in glob.glob(os.path.join(pci, "*", "vendor")):
        try:
            with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    gen = tpu_generation_of_pci(g.read().strip())
                    found = max(found, gen.devices_per_chip if gen else 1)
        except OSError:
            continue
    return found


def _writable(path: str) -> tuple[bool, str]:
    """Whether ``path`` (or, if it does not exist yet, its nearest existing parent) accepts a file."""
    probe = path
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe.rstrip("/"))
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return False, f"{probe} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".rtx-doctor-"):
            pass
    except OSError as exc:
        return False, f"cannot write in {probe}: {exc.strerror or exc}"
    return True, "writable" if probe == path else f"does not exist yet; {probe} is writable"


def _load_torch_xla(timeout_s: float) -> tuple[bool, str]:
    code = "import torch_xla, torch_xla.runtime; print(torch_xla.__version__)"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False, f"import torch_xla did not finish within {timeout_s:.0f} s"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return False, f"import torch_xla failed: {lines[-1] if lines else f'exit {proc.returncode}'}"
    return True, f"import torch_xla works ({proc.stdout.strip().splitlines()[-1]})"


# The checks of one node: one function each, run in the order of NODE_CHECKS.

# A check's row before it is placed on a node: (check, status, detail, fix).
Row = tuple[str, str, str, str]


@dataclass(frozen=True)
class NodeFacts:
    """What the checks of one node share, read once per node."""

    versions: Mapping[str, str | None]  # PACKAGES -> installed version (None: absent)
    torch_tpu: str | None  # installed torch-tpu
    native_neuronx: bool  # torch-neuronx is native TorchNeuron
    nc_devices: Sequence[str]  # /dev/neuron*
    chips: Sequence[str]  # TPU chips
    ray_cores: int | None  # neuron_cores Ray advertises; None when not connected
    ray_tpus: int | None  # TPU Ray advertises; None when not connected

    @property
    def neuron_present(self) -> bool:
        """A Neuron node: it has the devices, or Ray hands out NeuronCores there."""
        return bool(self.nc_devices) or bool(self.ray_cores)


def node_facts(ctx: NodeContext) -> NodeFacts:
    """Read the facts of the machine this runs on (and what Ray advertises for it)."""
    versions = {name: installed_version(name) for name in PACKAGES}
    res = ctx.ray_resources
    return NodeFacts(
        versions=versions,
        torch_tpu=installed_version("torch-tpu"),
        native_neuronx=is_native_neuronx(versions["torch-neuronx"]),
        nc_devices=neuron_devices(),
        chips=tpu_chips(),
        ray_cores=int(res.get(NEURON_RESOURCE, 0)) if res is not None else None,
        ray_tpus=int(res.get(TPU_RESOURCE, 0)) if res is not None else None,
    )


def node_stack(facts: NodeFacts) -> str | None:
    """The device stack this node's packages make (``planning/versions.py`` ``STACKS``), or
    None: no device stack, the CPU twins (and torch_xla on the CPU) only."""
    if facts.native_neuronx:
        return "native TorchNeuron"
    if facts.versions["torch-neuronx"]:
        return "Trainium XLA SDK"
    if facts.torch_tpu:
        return "native TorchTPU"
    return "torch_xla" if facts.versions["torch_xla"] else None


def check_python(ctx: NodeContext, facts: NodeFacts,
                 python: str = ".".join(map(str, sys.version_info[:3]))) -> list[Row]:
    """This Python against the stack the node's packages make (``planning/versions.py``)."""
    from ray_train_xla.planning.versions import python_problem, stack

    name = node_stack(facts)
    problem = python_problem(python, name)
    if problem:
        fix = ("a Python environment of the version the stack is built for (Neuron's native "
               "TorchNeuron wheels exist for 3.12 to 3.14 only)" if name else
               "Python 3.10 or newer")
        return [("python", FAIL, problem, fix)]
    what = (f"in {stack(name).python[0]}-{stack(name).python[1]} for {name}" if name else
            "no device stack installed (the CPU twins run on it)")
    return [("python", OK, f"Python {python}: {what}", "")]


def check_torch(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """torch is installed, in the range of at least one config (``planning/versions.py``)."""
    from ray_train_xla.planning.versions import TESTED_TORCH, configs_supporting, describe_ranges

    torch_v = facts.versions["torch"]
    if torch_v is None:
        return [("torch", FAIL, "not installed", "pip install torch==2.9.0 torch-xla==2.9.0")]
    configs = configs_supporting(torch_v)
    ranges = f"supported: {describe_ranges()}; tested on {', '.join(TESTED_TORCH)}"
    if not configs:
        return [("torch", FAIL, f"torch {torch_v}: no config supports it ({ranges})",
                 "install a torch in the range of the config you use (torch 2.9.0 with "
                 "torch-xla 2.9.0 for TorchXLAConfig; the native stack's own torch for the others)")]
    return [("torch", OK, f"torch {torch_v}: {', '.join(configs)} ({ranges})", "")]


def check_torch_xla(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """torch_xla is paired with torch (not needed under a native runtime, nor with a torch
    only the native configs support), and, with ``ctx.load_check``, imports in a subprocess."""
    from ray_train_xla.planning.versions import configs_supporting, supported_range

    torch_v, xla_v = facts.versions["torch"], facts.versions["torch_xla"]
    if xla_v is None and (facts.native_neuronx or facts.torch_tpu):
        which = "native TorchNeuron" if facts.native_neuronx else "native TorchTPU"
        return [("torch/torch_xla", OK, f"torch_xla not installed (not needed with {which})", "")]
    if xla_v is None and torch_v and "TorchXLAConfig" not in configs_supporting(torch_v):
        return [("torch/torch_xla", OK, f"torch {torch_v}; torch_xla not installed (TorchXLAConfig "
                 f"needs torch {supported_range('TorchXLAConfig')[1]} with its torch_xla; the "
                 "native configs need none)", "")]
    if xla_v is None:
        return [("torch/torch_xla", FAIL, f"torch {torch_v or '-'}; torch_xla not installed",
                 f"pip install 'torch-xla=={_major_minor(torch_v or '2.9')}.*'")]
    if torch_v is None:
        return []
    ok, how = pairing("torch_xla", xla_v, torch_v)
    tmm, xmm = _major_minor(torch_v), _major_minor(xla_v)
    rows = [("torch/torch_xla", OK if ok else FAIL, f"torch {torch_v}, torch_xla {xla_v} ({how})",
             f"install a matching pair: pip install 'torch=={xmm}.*' (for torch_xla {xla_v}) "
             f"or 'torch-xla=={tmm}.*' (for torch {torch_v})")]
    if ctx.load_check:
        ok, detail = _load_torch_xla(ctx.timeout_s)
        rows.append(("torch_xla loads", OK if ok else FAIL, detail,
                     "reinstall torch and torch-xla as a matching pair in this Python environment "
                     f"({sys.executable})"))
    return rows


def check_torch_tpu(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """Native TorchTPU (``TorchTPUConfig``), when torch-tpu is installed: torch-tpu's torch pin
    (0.2.0: ``torch>=2.11,<=2.15``, so not torch_xla 2.9's torch) and its libtpu."""
    from packaging.specifiers import SpecifierSet

    if not facts.torch_tpu:
        return []
    version, torch_v, libtpu_v = facts.torch_tpu, facts.versions["torch"], installed_version("libtpu")
    if torch_v is None:
        rows = [("native TorchTPU", FAIL, f"torch-tpu {version}; torch not installed",
                 "pip install torch-tpu (it pulls a torch it supports)")]
    else:
        ok, how = pairing("torch-tpu", version, torch_v)
        rows = [("native TorchTPU", OK if ok else FAIL,
                 f"torch-tpu {version} ({how}; torch {torch_v}); use TorchTPUConfig",
                 "install torch-tpu in an environment of its own with the torch it requires "
                 "(torch_xla 2.9 needs torch 2.9: the two cannot share one)")]
    spec = torch_pin("torch-tpu", "libtpu") or ""
    if libtpu_v is None:
        rows.append(("libtpu", FAIL, f"not installed (torch-tpu requires libtpu{spec})",
                     f"pip install 'libtpu{spec or '>=0.0.50'}'"))
    else:
        ok = not spec or SpecifierSet(spec).contains(libtpu_v, prereleases=True)
        rows.append(("libtpu", OK if ok else FAIL,
                     f"{libtpu_v}" + (f" (torch-tpu requires libtpu{spec})" if spec else ""),
                     f"pip install 'libtpu{spec}'"))
    return rows


def check_neuron_packages(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """torch-neuronx (XLA or native) and libneuronxla."""
    torch_v, rows = facts.versions["torch"], []
    for name in ("torch-neuronx", "libneuronxla"):
        version = facts.versions[name]
        if name == "torch-neuronx" and facts.native_neuronx:
            rows += native_rows(version, torch_v, ctx.multi_node)
        elif version is None:
            needed = facts.neuron_present and not facts.native_neuronx
            rows.append((name, FAIL if needed else OK,
                         "not installed" + ("" if needed else " (not needed: no Neuron on this node)"),
                         "pip install torch-neuronx libneuronxla "
                         "--extra-index-url https://pip.repos.neuron.amazonaws.com"))
        elif name == "torch-neuronx" and torch_v is not None:
            ok, how = pairing(name, version, torch_v)
            rows.append((name, OK if ok else FAIL, f"{version} ({how}; torch {torch_v} installed)",
                         "install the torch-neuronx release built for the installed torch (see the "
                         "Neuron SDK release notes), or the torch it requires"))
        else:
            rows.append((name, OK, version, ""))
    return rows


def check_device(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """PJRT_DEVICE and what device="auto" resolves to; records it in ``ctx.extra["device"]``."""
    from ray_train_xla.errors import XLAConfigError
    from ray_train_xla.planning.planner import resolve_device
    from ray_train_xla.planning.topology import WorkerFacts

    pjrt, res = os.environ.get("PJRT_DEVICE", ""), ctx.ray_resources
    if res is not None:  # connected: what Ray would give a worker asking for all of them
        source = "Ray resources"
        accel = {r: tuple(str(i) for i in range(int(res.get(r, 0))))
                 for r in (NEURON_RESOURCE, TPU_RESOURCE) if int(res.get(r, 0))}
    else:  # not connected: what Ray would detect on this machine
        source = "local devices"
        accel = {r: ("0",) for r, found in ((NEURON_RESOURCE, facts.nc_devices),
                                            (TPU_RESOURCE, facts.chips)) if found}
    worker = WorkerFacts(node_id=ctx.node_id or "local", node_ip=ctx.node_ip or "127.0.0.1",
                         pid=os.getpid(), accelerator_ids=accel, pjrt_device=pjrt)
    try:
        device = resolve_device("auto", [worker])
        row = ("device", OK, f"PJRT_DEVICE={pjrt or 'unset'}; device='auto' -> {device} "
               f"(from {source})", "")
    except XLAConfigError as exc:
        device = ""
        row = ("device", FAIL, f"PJRT_DEVICE={pjrt}: {exc}",
               "unset PJRT_DEVICE (or set CPU, TPU or NEURON), or pass TorchXLAConfig(device=...)")
    ctx.extra["device"] = device
    return [row]


def check_neuron_devices(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """/dev/neuron* against the neuron_cores Ray advertises."""
    n, cores = len(facts.nc_devices), facts.ray_cores
    cores_text = "" if cores is None else f"; Ray advertises neuron_cores={cores}"
    if not n and not cores:
        return [("neuron devices", OK, "not present" + cores_text, "")]
    if not n:
        return [("neuron devices", FAIL, f"no /dev/neuron* devices{cores_text}",
                 "install the Neuron driver (aws-neuronx-dkms) on this node, or start Ray there "
                 "without a neuron_cores resource")]
    if cores is None:
        return [("neuron devices", OK, f"{n} devices (/dev/neuron*)", "")]
    if cores == 0:
        return [("neuron devices", WARN, f"{n} devices{cores_text}",
                 "make neuron-ls work for the user running Ray (/opt/aws/neuron/bin), or start "
                 "Ray with --resources='{\"neuron_cores\": N}'")]
    if cores % n:
        return [("neuron devices", WARN, f"{n} devices{cores_text} (not a multiple)",
                 "restart Ray on this node so that it advertises every NeuronCore (see neuron-ls)")]
    return [("neuron devices", OK, f"{n} devices{cores_text}", "")]


def check_visible_cores(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """NEURON_RT_VISIBLE_CORES set by hand fights Ray's per-worker assignment."""
    visible = os.environ.get("NEURON_RT_VISIBLE_CORES", "")
    if visible:
        return [("NEURON_RT_VISIBLE_CORES", WARN, f"set by hand to {visible!r}: it fights Ray's "
                 "per-worker NeuronCore assignment",
                 "unset it where Ray and the driver start; request cores with "
                 "ScalingConfig(resources_per_worker={'neuron_cores': N})")]
    return [("NEURON_RT_VISIBLE_CORES", OK, "unset (Ray assigns cores per worker)", "")]


def check_efa(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """EFA, which multi-node Neuron collectives need."""
    if netinfo.has_efa():
        return [("EFA", OK, "EFA devices present", "")]
    if facts.neuron_present and ctx.multi_node:
        return [("EFA", WARN, "no EFA devices: multi-node Neuron collectives fall back to TCP",
                 "use EFA-enabled instances (trn1.32xlarge, trn2.48xlarge) with EFA in the "
                 "security group and the EFA driver installed")]
    return [("EFA", OK, "not present" + ("" if facts.neuron_present
                                         else " (not needed without Neuron)"), "")]


def check_tpu_chips(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """TPU chips against the TPU resource Ray advertises."""
    n, tpus = len(facts.chips), facts.ray_tpus
    tpu_text = "" if tpus is None else f"; Ray advertises TPU={tpus}"
    if not n and not tpus:
        return [("TPU chips", OK, "not present" + tpu_text, "")]
    if not n:
        return [("TPU chips", FAIL, f"no /dev/accel* or /dev/vfio chips{tpu_text}",
                 "run this node on a TPU VM, or start Ray there without a TPU resource")]
    per_chip = tpu_devices_per_chip()
    per_device = os.environ.get("RAY_TPU_RESOURCE_PER_CHIP", "1")
    counted = int(per_device) if per_device.isdigit() and int(per_device) > 0 else 1
    detail = f"{n} chips, {per_chip} device{'s' if per_chip > 1 else ''} per chip"
    if per_chip > 1:
        detail += (f" (TPU v7: one worker per device; Ray counts TPU per "
                   f"{'device' if counted > 1 else 'chip'}, RAY_TPU_RESOURCE_PER_CHIP={per_device})")
    if tpus is not None and tpus != n * counted:
        return [("TPU chips", WARN, detail + tpu_text,
                 f"restart Ray on this node with --resources='{{\"TPU\": {n * counted}}}'")]
    if per_chip > 1 and counted == 1:
        return [("TPU chips", WARN, detail + tpu_text,
                 "start Ray on this node with RAY_TPU_RESOURCE_PER_CHIP=2 and --resources="
                 f"'{{\"TPU\": {n * per_chip}}}' (TorchTPUConfig, TorchXLAConfig without SPMD: "
                 "one worker per device)")]
    return [("TPU chips", OK, detail + tpu_text, "")]


def check_compile_caches(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """The Neuron and XLA persistent compile caches can be written."""
    caches = []
    if facts.neuron_present or facts.versions["torch-neuronx"]:
        url = os.environ.get("NEURON_COMPILE_CACHE_URL", "")
        caches.append(("NEURON_COMPILE_CACHE_URL", url or NEURON_CACHE_DEFAULT, bool(url)))
    if os.environ.get("XLA_PERSISTENT_CACHE_PATH"):
        caches.append(("XLA_PERSISTENT_CACHE_PATH", os.environ["XLA_PERSISTENT_CACHE_PATH"], True))
    if not caches:
        return [("compile cache", OK,
                 "none configured (no Neuron, XLA_PERSISTENT_CACHE_PATH unset)", "")]
    rows = []
    for var, path, is_set in caches:
        where = f"{var}={path}" if is_set else f"{path} (default; {var} unset)"
        if path.startswith("s3://"):
            rows.append(("compile cache", OK, f"{where}: S3, not checked from here", ""))
            continue
        ok, detail = _writable(path)
        rows.append(("compile cache", OK if ok else FAIL, f"{where}: {detail}",
                     f"make {path} writable for the user running Ray, or set {var} to a writable "
                     "(shared) path"))
    return rows


def check_free_ports(ctx: NodeContext, facts: NodeFacts) -> list[Row]:
    """On the head only: two ephemeral TCP ports can be bound."""
    if not ctx.is_head:
        return []
    try:
        ports = netinfo.free_ports(2)
    except OSError as exc:
        return [("free ports", FAIL, f"cannot bind ephemeral TCP ports: {exc}",
                 "free ports in net.ipv4.ip_local_port_range or close stale listeners")]
    return [("free ports", OK, f"bound two ephemeral ports ({ports[0]}, {ports[1]})", "")]


# The checks of a node, in report order.
NODE_CHECKS: tuple[Callable[[NodeContext, NodeFacts], list[Row]], ...] = (
    check_python,
    check_torch,
    check_torch_xla,
    check_torch_tpu,
    check_neuron_packages,
    check_device,
    check_neuron_devices,
    check_visible_cores,
    check_efa,
    check_tpu_chips,
    check_compile_caches,
    check_free_ports,
)


def check_node(ctx: NodeContext) -> list[Check]:
    """All checks of the machine this runs on (the driver, or a node's task in cluster mode):
    every function of ``NODE_CHECKS`` in order. A fix is kept only on a non-OK row."""
    facts = node_facts(ctx)
    ctx.extra["versions"] = dict(facts.versions)
    return [Check(name, ctx.node, status, detail, fix if status != OK else "")
            for check in NODE_CHECKS for name, status, detail, fix in check(ctx, facts)]


def remote_node_check(ctx: NodeContext) -> dict:
    """Run in a Ray task on one node: that node's rows plus the facts the driver compares across
    nodes (``ctx.extra``: its package versions and device)."""
    return {"rows": [asdict(r) for r in check_node(ctx)], **ctx.extra}


# Driver side: local only, or every node of a cluster.


def cpu_note(node: str) -> Check:
    return Check("CPU collectives", node, OK,
                 "several CPU workers run in the development mode: xm collectives "
                 "(all_reduce, all_gather, reduce_scatter, broadcast, rendezvous, mesh_reduce, "
                 "optimizer_step), torch.distributed and DDP on XLA tensors cross workers over "
                 "gloo on host copies, and xr.world_size()/global_ordinal() are Ray's; eager, "
                 "every collective cuts the graph (see docs/cpu-development-mode.md)")


def run_local(load_check: bool = True, timeout_s: float = 60.0) -> list[Check]:
    """Checks of this machine only, without Ray."""
    ctx = NodeContext(node="driver", load_check=load_check, timeout_s=timeout_s)
    rows = check_node(ctx)
    if ctx.extra.get("device") == "cpu":
        rows.append(cpu_note("driver"))
    return rows


def _connect(address: str, timeout_s: float) -> str | None:
    """Connect to a running Ray cluster within ``timeout_s``; an error text, or None."""
    import threading

    import ray

    errors: list[BaseException] = []

    def work() -> None:
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=work, name="ray_train_xla-doctor-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"no answer from Ray at {address!r} within {timeout_s:.0f} s"
    if errors:
        return f"{type(errors[0]).__name__}: {errors[0]}"
    return None


def run_cluster(address: str, load_check: bool = True, timeout_s: float = 60.0) -> list[Check]:
    """Checks of the driver, then one task on each alive node of the cluster at ``address``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def driver_rows() -> list[Check]:
        rows = run_local(load_check=load_check, timeout_s=timeout_s)
        return [r for r in rows if r.check not in ("free ports", "CPU collectives")]

    driver_versions = {n: installed_version(n) for n in PACKAGES}
    error = _connect(address, timeout_s)
    if error:
        return driver_rows() + [
            Check("ray cluster", "driver", FAIL, error,
                  "start Ray (ray start --head) or pass its address: --cluster HOST:6379")
        ]
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        task = ray.remote(remote_node_check)
        labels = {}
        for node in nodes:
            resources = dict(node.get("Resources", {}))
            head = HEAD_RESOURCE in resources
            label = f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}" + (" (head)" if head else "")
            ctx = NodeContext(node=label, node_id=node["NodeID"],
                              node_ip=node["NodeManagerAddress"], ray_resources=resources,
                              is_head=head, load_check=load_check, timeout_s=timeout_s * 0.8,
                              multi_node=len(nodes) > 1)
            ref = task.options(
                num_cpus=0, max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(ctx)
            labels[ref] = label
        # The driver's own checks run while the nodes work.
        rows = driver_rows()
        rows.append(Check("ray cluster", "driver", OK,
                          f"connected to {address}: {len(nodes)} alive nodes, Ray {ray.__version__}"))
        ready, pending = ray.wait(list(labels), num_returns=len(labels), timeout=timeout_s)
        answers = []
        for ref in ready:
            try:
                answers.append((labels[ref], ray.get(ref, timeout=timeout_s)))
            except Exception as exc:
                first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                rows.append(Check("node task", labels[ref], FAIL, f"the check task failed: {first}",
                                  "install ray-train-xla (and the same torch/torch_xla) in the "
                                  "Python environment Ray uses on this node"))
        for ref in pending:
            ray.cancel(ref, force=True)
            rows.append(Check("node task", labels[ref], FAIL,
                              f"no answer within {timeout_s:.0f} s",
                              "check the node is healthy (ray status), or rerun with a larger "
                              "--timeout"))
        for label, answer in sorted(answers, key=lambda a: a[0]):
            rows += [Check(**r) for r in answer["rows"]]
            differ = [f"{n} {answer['versions'].get(n) or '-'} (driver {driver_versions[n] or '-'})"
                      for n in PACKAGES if answer["versions"].get(n) != driver_versions[n]]
            rows.append(Check("same as driver", label, WARN if differ else OK,
                              "; ".join(differ) if differ else "package versions match the driver",
                              "install the same torch, torch_xla and Neuron packages on the "
                              "driver and every node" if differ else ""))
        if any(answer.get("device") == "cpu" for _, answer in answers):
            rows.append(cpu_note("cluster"))
    finally:
        ray.shutdown()
    return rows


# Output.


def failed(rows: Sequence[Check]) -> bool:
    return any(r.status == FAIL for r in rows)


def format_table(rows: Sequence[Check]) -> str:
    """One line per check (check, node, status, detail), the fix indented under each non-OK."""
    header = ("check", "node", "status", "detail")
    cells = [header] + [(r.check, r.node, r.status, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    lines = []
    for i, cell in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cell[:3], widths)) + "  " + cell[3])
        if i and rows[i - 1].fix:
            lines.append(" " * (sum(widths) + 6) + "fix: " + rows[i - 1].fix)
    counts = {s: sum(r.status == s for r in rows) for s in (OK, WARN, FAIL)}
    lines.append(f"{len(rows)} checks: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL")
    return "\n".join(lines)


def to_json(rows: Sequence[Check]) -> dict:
    return {"ok": not failed(rows), "checks": [asdict(r) for r in rows]}


# ``ray-train-xla doctor``: its parser and its command.
def add_parser(sub) -> argparse.ArgumentParser:
    """``doctor``: checks of this machine or of every node of a Ray cluster."""
    doctor = sub.add_parser(
        "doctor",
        help="check this machine (or every node of a Ray cluster) for training under "
        "TorchXLAConfig, TorchNeuronConfig or TorchTPUConfig",
        description="Check the Python and torch against the device stack installed (torch_xla, "
        "Trainium's XLA SDK, native TorchNeuron, native TorchTPU: the ranges of "
        "planning/versions.py), the packages' pairings (torch_xla, torch-neuronx or torch-tpu "
        "built for the installed torch), "
        "PJRT_DEVICE and what device='auto' resolves to, Neuron devices against Ray's "
        "neuron_cores, NEURON_RT_VISIBLE_CORES, EFA, TPU chips against Ray's TPU resource, "
        "compile cache writability and free ports. Prints one row per check (OK, WARN, FAIL) "
        "with a one-line fix for every non-OK row; exits 1 when any check FAILs.",
    )
    doctor.add_argument(
        "--cluster", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help="also connect to a running Ray cluster (default address: auto, i.e. RAY_ADDRESS "
        "or the local cluster started with `ray start`) and run the checks on every alive node",
    )
    doctor.add_argument(
        "--timeout", type=positive_seconds, default=60.0, metavar="SECONDS",
        help="bound on connecting, on each node's answer and on the torch_xla import "
        "(default 60)",
    )
    doctor.add_argument(
        "--no-load-check", dest="load_check", action="store_false",
        help="skip importing torch_xla in a subprocess (faster; versions are still checked)",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON: ok, checks[]")
    return doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.cluster is None:
        rows = run_local(load_check=args.load_check, timeout_s=args.timeout)
    else:
        if not args.json:
            print(f"ray-train-xla doctor: connecting to Ray at {args.cluster}...", flush=True)
        rows = run_cluster(args.cluster, load_check=args.load_check, timeout_s=args.timeout)
    print(json.dumps(to_json(rows), indent=2) if args.json else format_table(rows))
    return 1 if failed(rows) else 0
