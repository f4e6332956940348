"""The torch each config supports: what `ray-train-xla doctor` checks a node's torch against,
and what docs/configuration.md states.

- ``TorchXLAConfig``: torch 2.9 only, the torch that torch_xla 2.9 (its last release) is built
  for; torch-neuronx 2.9 for Trainium's XLA SDK is too.
- ``TorchNeuronConfig``: torch 2.9 to 2.14. Native TorchNeuron ships torch 2.13 and 2.14; the CPU
  twin (``device="cpu"``) runs on the rest.
- ``TorchTPUConfig``: torch 2.9 to 2.15. torch-tpu 0.2 takes torch 2.11 to 2.15; the CPU twin
  runs on the rest.

Tested (CI): torch 2.9.0 with torch_xla 2.9.0 (`make test`, `make test-e2e`) and torch 2.13.0
without torch_xla (`make test-native`).
"""

from __future__ import annotations

# (config, oldest torch, newest torch), as major.minor
SUPPORTED_TORCH: tuple[tuple[str, str, str], ...] = (
    ("TorchXLAConfig", "2.9", "2.9"),
    ("TorchNeuronConfig", "2.9", "2.14"),
    ("TorchTPUConfig", "2.9", "2.15"),
)
TESTED_TORCH: tuple[str, ...] = ("2.9.0", "2.13.0")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def supported_range(config: str) -> tuple[str, str]:
    """(oldest, newest) torch ``config`` supports, as major.minor."""
    return {name: (low, high) for name, low, high in SUPPORTED_TORCH}[config]


def configs_supporting(torch_version: str) -> list[str]:
    """The configs whose range holds ``torch_version`` (``2.13.0+cpu`` and the like)."""
    have = _major_minor(torch_version)
    return [name for name, low, high in SUPPORTED_TORCH
            if _major_minor(low) <= have <= _major_minor(high)]


def describe_ranges() -> str:
    """'TorchXLAConfig 2.9; TorchNeuronConfig 2.9-2.14; TorchTPUConfig 2.9-2.15'."""
    return "; ".join(f"{name} {low}" if low == high else f"{name} {low}-{high}"
                     for name, low, high in SUPPORTED_TORCH)
