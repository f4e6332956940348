"""Published peak dense compute per device, the denominator of model FLOPs utilisation (MFU).

Per device as PyTorch sees it, the unit a worker owns: a NeuronCore on Trainium (a logical one,
two physical NeuronCores at Trainium2's and Trainium3's default LNC=2), a chip on TPU v4 to v6e
(v4 and v5p run their two TensorCores as one megacore device), half a chip on TPU v7x (each
TensorCore is a device). Dense figures, in TFLOP/s; fp8 where the vendor publishes one (not
for v4 to v6e, whose pages give bf16 and int8 only).

Each entry is one published figure times the share of it that is one device, and its source
says both (``tests/test_flops_local.py`` checks the arithmetic). Where the vendor publishes an
exact figure per core, that is the one taken. The Trainium2 and Trainium3 chip pages do not
agree with their cores' pages: 667 and 671 BF16 TFLOPS per chip of 8 cores (83.4 and 83.9 a
core), where each core's page gives 79 (8 x 79 = 632); against a chip page's figure MFU would
read 5% lower. The NeuronCore-v2 page says only "over 90": Trn1's chip figure, 190 over its 2
cores, is taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ray_train_xla.planning.memory import device_key


@dataclass(frozen=True)
class Peak:
    """Peak dense TFLOP/s of one device."""

    bf16: float
    fp8: float | None
    device: str
    source: str  # the page, its figure and the arithmetic that gives ``bf16`` (and ``fp8``)


def _published(page: str, bf16: float, fp8: float | None, fp8_name: str, per: str,
               share: float, device: str, note: str = "") -> Peak:
    """A device's peak from a figure published ``per`` unit: ``share`` units make a device."""
    def times(value: float) -> str:
        if share == 1:
            return f"{value:,g}"
        arithmetic = f"x {share:g}" if share > 1 else f"/ {1 / share:g}"
        return f"{value:,g} {arithmetic} = {value * share:,g}"

    figures = f"{bf16:,g} BF16" + (f" and {fp8:,g} {fp8_name}" if fp8 else "")
    per_device = f"BF16 {times(bf16)}" + (f", {fp8_name} {times(fp8)}" if fp8 else "")
    return Peak(bf16 * share, None if fp8 is None else fp8 * share, device,
                f"{page}: {figures} TFLOPS per {per}; per device: {per_device}{note}")


_NEURON = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/"
_CORE_V3 = _NEURON + "about-neuron/arch/neuron-hardware/neuron-core-v3.html"
_CORE_V4 = _NEURON + "about-neuron/arch/neuron-hardware/neuron-core-v4.html"
_TRN2_CHIP = ("; the Trainium2 page gives 667 BF16 and 1,299 FP8 per chip of 8 NeuronCore-v3 "
              "(83.4 and 162.4 a core), not 8 x 79 = 632: the core's figure is taken")
_TRN3_CHIP = ("; the Trainium3 page gives 671 BF16 per chip of 8 NeuronCore-v4 (83.9 a core), "
              "not 8 x 79 = 632: the core's figure is taken; its 315 MXFP8 a core is "
              "microscaled, not fp8")
_TPU = "https://cloud.google.com/tpu/docs/"
PEAKS: dict[str, Peak] = {
    "trn1": _published(_NEURON + "general/arch/neuron-hardware/trainium.html", 190.0, 190.0,
                       "cFP8", "chip of 2 NeuronCore-v2", 0.5, "Trainium NeuronCore-v2",
                       " (the NeuronCore-v2 page says only \"over 90\")"),
    "trn2": _published(_CORE_V3, 79.0, 158.0, "cFP8", "NeuronCore-v3", 2.0,
                       "Trainium2 logical NeuronCore (LNC=2: 2 NeuronCore-v3)", _TRN2_CHIP),
    "trn2-lnc1": _published(_CORE_V3, 79.0, 158.0, "cFP8", "NeuronCore-v3", 1.0,
                            "Trainium2 physical NeuronCore-v3 (LNC=1)", _TRN2_CHIP),
    "trn3": _published(_CORE_V4, 79.0, None, "", "NeuronCore-v4", 2.0,
                       "Trainium3 logical NeuronCore (LNC=2: 2 NeuronCore-v4)", _TRN3_CHIP),
    "trn3-lnc1": _published(_CORE_V4, 79.0, None, "", "NeuronCore-v4", 1.0,
                            "Trainium3 physical NeuronCore-v4 (LNC=1)", _TRN3_CHIP),
    "v4": _published(_TPU + "v4", 275.0, None, "", "chip", 1.0, "TPU v4 chip"),
    "v5e": _published(_TPU + "v5e", 197.0, None, "", "chip", 1.0, "TPU v5e chip"),
    "v5p": _published(_TPU + "v5p-training", 459.0, None, "", "chip", 1.0, "TPU v5p chip"),
    "v6e": _published(_TPU + "v6e", 918.0, None, "", "chip", 1.0, "TPU v6e chip"),
    "v7x": _published(_TPU + "tpu7x", 2307.0, 4614.0, "fp8", "chip of 2 devices", 0.5,
                      "TPU7x device (half a chip)"),
}


def device_peak(accelerator: str, logical_cores: int | None = None) -> Peak | None:
    """The peak of one device of ``accelerator``: a Trainium instance type or generation
    (``trn2.48xlarge``, ``trn1``; ``logical_cores`` is the LNC, 2 unless 1 is given) or a TPU
    accelerator type (``v5p-128``, ``TPU-V6E``, ``tpu7x-32``). None when unknown."""
    return PEAKS.get(device_key(accelerator, logical_cores))


def peak_tflops(accelerator: str, dtype: str = "bf16", logical_cores: int | None = None) -> float | None:
    """``device_peak``'s figure for ``dtype`` (``bf16`` or ``fp8``); None when unpublished."""
    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"peak_tflops: dtype={dtype!r}: give 'bf16' or 'fp8'")
    peak = device_peak(accelerator, logical_cores)
    return None if peak is None else getattr(peak, dtype)


# The Neuron runtime's logical NeuronCore configuration: how many physical NeuronCores make one
# device (1 or 2; Trainium2 and Trainium3 run 2 unless it says 1).
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"


def neuron_peak(product_name: str, environ: Mapping[str, str]) -> Peak | None:
    """The peak of one NeuronCore of this Trainium instance: ``product_name`` is its type as
    the instance's firmware names it (``/sys/devices/virtual/dmi/id/product_name`` holds the
    EC2 instance type on Nitro instances, ``trn2.48xlarge``), ``environ`` the worker's
    environment (``NEURON_LOGICAL_NC_CONFIG=1``: a physical core). None for any other machine."""
    name = product_name.strip().lower()
    if not name.startswith("trn"):
        return None
    return device_peak(name, 1 if environ.get(LNC_VAR, "").strip() == "1" else None)
