"""Published peak dense compute per device, the denominator of model FLOPs utilisation (MFU).

Per device as PyTorch sees it, the unit a worker owns: a NeuronCore on Trainium (a logical one,
two physical NeuronCore-v3, at Trainium2's default LNC=2), a chip on TPU v4 to v6e (v4 and v5p
run their two TensorCores as one megacore device), half a chip on TPU v7x (each TensorCore is a
device). Dense figures, in TFLOP/s; fp8 where the vendor publishes one. torchtitan's
``get_peak_flops`` uses the same figures, but 90 for Trn1 (the NeuronCore-v2 page says "over
90"; 190 per chip over 2 cores is 95).
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
    source: str


_NEURON = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/"
_TPU = "https://cloud.google.com/tpu/docs/"
PEAKS: dict[str, Peak] = {
    "trn1": Peak(95.0, 95.0, "Trainium NeuronCore-v2",
                 _NEURON + "general/arch/neuron-hardware/trainium.html: 190 TFLOPS FP16/BF16/"
                 "cFP8 per chip of 2 NeuronCore-v2"),
    "trn2": Peak(158.0, 316.0, "Trainium2 logical NeuronCore (LNC=2: 2 NeuronCore-v3)",
                 _NEURON + "about-neuron/arch/neuron-hardware/neuron-core-v3.html: 79 dense "
                 "BF16 TFLOPS and 158 cFP8 per NeuronCore-v3 (667 BF16 per chip of 8)"),
    "trn2-lnc1": Peak(79.0, 158.0, "Trainium2 physical NeuronCore-v3 (LNC=1)",
                      _NEURON + "about-neuron/arch/neuron-hardware/neuron-core-v3.html"),
    "trn3": Peak(158.0, None, "Trainium3 logical NeuronCore (LNC=2: 2 NeuronCore-v4)",
                 _NEURON + "about-neuron/arch/neuron-hardware/neuron-core-v4.html: 79 dense "
                 "BF16 TFLOPS per NeuronCore-v4 (671 per chip of 8); its 315 MXFP8 is "
                 "microscaled, not fp8"),
    "trn3-lnc1": Peak(79.0, None, "Trainium3 physical NeuronCore-v4 (LNC=1)",
                      _NEURON + "about-neuron/arch/neuron-hardware/neuron-core-v4.html"),
    "v4": Peak(275.0, None, "TPU v4 chip", _TPU + "v4: 275 TFLOPS bf16 per chip"),
    "v5e": Peak(197.0, None, "TPU v5e chip", _TPU + "v5e: 197 TFLOPS bf16 per chip"),
    "v5p": Peak(459.0, 459.0, "TPU v5p chip", _TPU + "v5p-training: 459 TFLOPS bf16 per chip"),
    "v6e": Peak(918.0, 918.0, "TPU v6e chip", _TPU + "v6e: 918 TFLOPS bf16 per chip"),
    "v7x": Peak(1153.5, 2307.0, "TPU7x device (half a chip)",
                _TPU + "tpu7x: 2,307 TFLOPS bf16 and 4,614 fp8 per chip of 2 devices"),
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
