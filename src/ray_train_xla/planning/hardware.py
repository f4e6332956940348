"""The hardware the planner checks a job against: Trainium instances and TPU generations.

Pure data and lookups (no Ray, no torch), shared by ``ray-train-xla plan``, the runtimes' checks
(``runtimes/tpu.py``, ``runtimes/native_tpu.py``) and the memory planner (``memory.py``). Each
table says where its figures come from; ``docs/trainium.md`` ("Workers per node") and
``docs/spmd-tpu.md`` ("TPU generations and slices") print them, and
``tests/test_hardware_tables.py`` holds the two equal.

- Trainium: an instance's chips, its generation's physical NeuronCores per chip and the logical
  NeuronCore configurations (LNC, ``NEURON_LOGICAL_NC_CONFIG``) it runs; one worker drives one
  logical NeuronCore, so a node runs at most ``chips x cores per chip / LNC`` workers.
- TPU: per generation, the TensorCores its accelerator type counts per chip (``v4-64`` is 32
  chips), the devices each chip exposes (2 on TPU v7x), the chips one host holds, and the
  standard topology of each published slice size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NEURON = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/"
_TPU = "https://cloud.google.com/tpu/docs/"

# ---- Trainium ------------------------------------------------------------------------------

# The Neuron runtime's logical NeuronCore configuration: physical NeuronCores per device.
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"


@dataclass(frozen=True)
class TrainiumGeneration:
    """A Trainium chip: its physical NeuronCores, the LNC values the Neuron runtime takes on it
    (the first is its default), and its device memory."""

    name: str
    chip: str
    core: str
    cores_per_chip: int
    lnc: tuple[int, ...]
    memory_gib_per_chip: int
    source: str

    @property
    def default_lnc(self) -> int:
        return self.lnc[0]


@dataclass(frozen=True)
class TrainiumInstance:
    """An instance (or server) of Trainium chips: a node of the job."""

    name: str
    generation: str
    chips: int
    source: str
    note: str = ""
    host_memory_gib: int | None = None  # the host's memory (Ray's node), where published

    def devices(self, lnc: int | None = None) -> int:
        """Logical NeuronCores (the devices workers run on) at ``lnc`` (default: the
        generation's)."""
        gen = TRAINIUM_GENERATIONS[self.generation]
        return self.chips * gen.cores_per_chip // (lnc or gen.default_lnc)


TRAINIUM_GENERATIONS: dict[str, TrainiumGeneration] = {
    # LNC applies from Trainium2 on ("Logical NeuronCore configuration": Trn2 default 2); Trn1
    # runs each NeuronCore-v2 as one device.
    "trn1": TrainiumGeneration(
        "trn1", "Trainium", "NeuronCore-v2", 2, (1,), 32,
        _NEURON + "neuron-hardware/trainium.html: 2 NeuronCore-v2 and 32 GiB per chip"),
    "trn2": TrainiumGeneration(
        "trn2", "Trainium2", "NeuronCore-v3", 8, (2, 1), 96,
        _NEURON + "neuron-hardware/trainium2.html: 8 NeuronCore-v3 and 96 GiB per chip; "
        "neuron-features/logical-neuroncore-config.html: LNC 2 (default) or 1"),
    "trn3": TrainiumGeneration(
        "trn3", "Trainium3", "NeuronCore-v4", 8, (2, 1), 144,
        _NEURON + "neuron-hardware/trainium3.html: 8 NeuronCore-v4 and 144 GiB per chip, LNC "
        "as on Trainium2 (2 by default, as the Neuron SDK 2.34 Trn3 tutorials run it, or 1)"),
}

_TRN1_ARCH = _NEURON + "neuron-hardware/trn1-arch.html"  # chips and "Host Memory (GiB)"
_TRN2_ARCH = _NEURON + "neuron-hardware/trn2-arch.html"
TRAINIUM_INSTANCES: dict[str, TrainiumInstance] = {i.name: i for i in (
    TrainiumInstance("trn1.2xlarge", "trn1", 1, _TRN1_ARCH, host_memory_gib=32),
    TrainiumInstance("trn1.32xlarge", "trn1", 16, _TRN1_ARCH, host_memory_gib=512),
    TrainiumInstance("trn1n.32xlarge", "trn1", 16, _TRN1_ARCH, host_memory_gib=512),
    TrainiumInstance("trn2.3xlarge", "trn2", 1,
                     "https://aws.amazon.com/ec2/instance-types/trn2/: 1 Trainium2 chip"),
    TrainiumInstance("trn2.48xlarge", "trn2", 16, _TRN2_ARCH, host_memory_gib=2048),
    TrainiumInstance("trn2u.48xlarge", "trn2", 16, _TRN2_ARCH, host_memory_gib=2048),
    # AWS publishes Trn3 as UltraServers (Neuron SDK 2.34, trn3-arch.html): Gen1, 4 servers of
    # 16 Trainium3; Gen2, 36 servers of 4. It names no Trn3 instance type, so "trn3" stands for
    # the larger server.
    TrainiumInstance("trn3", "trn3", 16, _NEURON + "neuron-hardware/trn3-arch.html",
                     "a Trn3 Gen1 UltraServer server (Gen2 servers hold 4 chips); AWS names no "
                     "Trn3 instance type"),
)}
# A generation's name stands for its largest instance.
_TRAINIUM_BY_GENERATION = {"trn1": "trn1.32xlarge", "trn2": "trn2.48xlarge", "trn3": "trn3"}


def trainium_names() -> list[str]:
    """Every name ``trainium_instance`` knows."""
    return sorted(set(TRAINIUM_INSTANCES) | set(_TRAINIUM_BY_GENERATION))


def trainium_instance(name: str) -> TrainiumInstance:
    """The Trainium instance ``name`` names (``trn2.48xlarge``; a generation, ``trn2``, is its
    largest instance). Raises ValueError naming the known ones otherwise."""
    key = (name or "").strip().lower()
    key = _TRAINIUM_BY_GENERATION.get(key, key)
    if key not in TRAINIUM_INSTANCES:
        raise ValueError(f"{name!r} is not a Trainium instance this package knows: expected one "
                         f"of {', '.join(trainium_names())}")
    return TRAINIUM_INSTANCES[key]


def trainium_lnc(instance: TrainiumInstance, value: str | None) -> int:
    """The LNC a worker environment sets (``NEURON_LOGICAL_NC_CONFIG``, None or "" for the
    generation's default); ValueError for one the generation does not take."""
    gen = TRAINIUM_GENERATIONS[instance.generation]
    text = (value or "").strip()
    if not text:
        return gen.default_lnc
    if not text.isdigit() or int(text) not in gen.lnc:
        raise ValueError(f"{LNC_VAR}={text!r} is not valid on {gen.chip} ({instance.name}): "
                         f"expected {' or '.join(map(str, sorted(gen.lnc)))}")
    return int(text)


# ---- TPU -----------------------------------------------------------------------------------

# Chips on a host of a multi-host slice, as a grid: every generation here (Ray 2.60
# ``DEFAULT_TPU_NUM_CHIPS_PER_HOST``; torch-tpu 0.2.0 ``distributed._CHIPS_PER_HOST``).
MULTI_HOST_CHIPS = (2, 2, 1)
# Google's PCI vendor id; each generation's PCI device id is in its row (torch_xla 2.9
# ``_internal/tpu.py`` ``_TPU_PCI_DEVICE_IDS``; torch-tpu 0.2.0 ``hardware._PCI_DEVICE_ID_TO_NAME``).
GOOGLE_PCI_VENDOR = "0x1ae0"


@dataclass(frozen=True)
class TPUGeneration:
    """A TPU generation as its accelerator types name it (Ray's spelling, ``v5litepod``)."""

    name: str
    cores_per_chip: int  # TensorCores the accelerator type's size counts per chip
    devices_per_chip: int  # devices each chip exposes to the runtime (a process each)
    single_host_chips: int  # the most chips one host holds
    shapes: tuple[str, ...]  # the published slice topologies, smallest first
    source: str
    aliases: tuple[str, ...] = ()
    pci_device_id: str = ""
    memory_gib_per_chip: int | None = None  # HBM per chip (v5p: what the runtime leaves of 96)
    # Shapes also offered as hosts of MULTI_HOST_CHIPS (v6e's 2x4 on 2 VMs, GKE only).
    split_shapes: tuple[str, ...] = ()
    topologies: dict[int, str] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "topologies", {
            math.prod(int(d) for d in s.split("x")): s for s in self.shapes})

    @property
    def dims(self) -> int:
        """2 for slices written AxB (v5e, v6e), 3 for AxBxC."""
        return len(self.shapes[0].split("x"))

    def accelerator_type(self, chips: int) -> str:
        return f"{self.name}-{chips * self.cores_per_chip}"

    def sizes(self) -> list[str]:
        """The accelerator types of the published slices (``v6e-1`` ... ``v6e-256``)."""
        return [self.accelerator_type(c) for c in self.topologies]


# Cubes of 4-chip hosts: the v4 and v5p shapes Google's tables list (tpu/docs/v4, tpu/docs/v5p
# "most common" shapes plus v5p-32) and Ray 2.60's ``VALID_TPU_TOPOLOGY['v7x']``.
_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
          "8x16x16")
# Google's "supported 2D slice shapes" of v5e and v6e (tpu/docs/v5e, tpu/docs/v6e); the same set.
_PLANES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
TPU_GENERATIONS: dict[str, TPUGeneration] = {g.name: g for g in (
    # torch_xla 2.9 ``_ACCELERATOR_TYPE_TO_HOST_BOUNDS`` (v2-8 ... v3-2048), hosts of 2x2 chips;
    # one process per chip (torch_xla runs the chip's two cores in it).
    TPUGeneration("v2", 2, 1, 4, ("2x2", "4x4", "8x8", "8x16", "16x16"),
                  "torch_xla 2.9 _internal/tpu.py _ACCELERATOR_TYPE_TO_HOST_BOUNDS",
                  pci_device_id="0x0027"),
    TPUGeneration("v3", 2, 1, 4, ("2x2", "4x4", "4x8", "8x8", "8x16", "16x16", "16x32",
                                  "32x32"),
                  "torch_xla 2.9 _internal/tpu.py _ACCELERATOR_TYPE_TO_HOST_BOUNDS",
                  pci_device_id="0x0027"),
    TPUGeneration("v4", 2, 1, 4, _CUBES,
                  _TPU + "v4: 2 TensorCores per chip (one megacore device), 4 chips per host, "
                  "32 GiB HBM per chip",
                  pci_device_id="0x005e", memory_gib_per_chip=32),
    TPUGeneration("v5p", 2, 1, 4, _CUBES + ("16x16x16", "16x16x24"),
                  _TPU + "v5p: slice shapes up to 16x16x24, 4 chips per host, 95 GiB HBM per "
                  "chip allocatable (96 GiB physical)",
                  pci_device_id="0x0062", memory_gib_per_chip=95),
    TPUGeneration("v5litepod", 1, 1, 8, _PLANES,
                  _TPU + "v5e: 2D slice shapes, 1 TensorCore per chip, VMs of 1, 4 or 8 chips, "
                  "16 GB HBM per chip (counted as GiB)",
                  aliases=("v5e", "v5lite"), pci_device_id="0x0063", memory_gib_per_chip=16),
    TPUGeneration("v6e", 1, 1, 8, _PLANES,
                  _TPU + "v6e: 2D slice shapes, 1 TensorCore per chip, 8 chips per host (2x4 "
                  "also as 2 VMs of 4 on GKE), hosts of 4 chips beyond; 32 GB HBM per chip "
                  "(32 GiB in the TPU7x comparison table)",
                  pci_device_id="0x006f", split_shapes=("2x4",), memory_gib_per_chip=32),
    TPUGeneration("v7x", 2, 2, 4, _CUBES,
                  _TPU + "tpu7x: 2 TensorCores per chip, each a device, 4-chip VMs; shapes: Ray "
                  "2.60 VALID_TPU_TOPOLOGY['v7x']; devices: torch-tpu 0.2.0 "
                  "hardware._DEVICES_PER_CHIP; 192 GiB HBM per chip",
                  aliases=("v7", "tpu7x"), pci_device_id="0x0076", memory_gib_per_chip=192),
)}
_TPU_ALIASES = {alias: g.name for g in TPU_GENERATIONS.values() for alias in g.aliases}


def tpu_generation(accelerator_type: str) -> str:
    """The generation of a TPU accelerator type as Ray spells it ("v7x", "v5litepod"), from any
    spelling: "tpu7x-32", "v7x-32", Ray's "TPU-V7X", "v5e-8"; "" when none is given. A
    generation this package does not know is returned as written ("v9z")."""
    normal = re.sub(r"^tpu-?v?", "v", (accelerator_type or "").strip().lower())
    name = normal.split("-")[0] if normal.startswith("v") else ""
    return _TPU_ALIASES.get(name, name)


def tpu_generation_spec(accelerator_type: str) -> TPUGeneration | None:
    """The generation row of a TPU accelerator type (any spelling), None when unknown."""
    return TPU_GENERATIONS.get(tpu_generation(accelerator_type))


def devices_per_chip(accelerator_type: str) -> int:
    """Devices per chip of a TPU accelerator type: 2 on TPU v7x, else 1 (also when unknown)."""
    gen = tpu_generation_spec(accelerator_type)
    return gen.devices_per_chip if gen else 1


def tpu_generation_of_pci(device_id: str) -> TPUGeneration | None:
    """The generation whose chips have this PCI device id (v4 and later; v2 and v3 share one)."""
    matches = [g for g in TPU_GENERATIONS.values() if g.pci_device_id == device_id]
    return matches[-1] if matches else None
