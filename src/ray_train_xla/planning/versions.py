"""The Python and torch of each stack, stated once: what ``ray-train-xla doctor`` checks a node
against, and what the README's "Versions" table and docs/configuration.md state (a test holds
them to this module).

Each config runs its hardware stack on that stack's own Python and torch, and its CPU twin
(``device="cpu"``) on any torch of ``SUPPORTED_TORCH``:

- ``TorchXLAConfig``: torch_xla 2.9.0, the last release, built for torch 2.9 (Python 3.10 to
  3.13 on PyPI); Trainium's XLA SDK (torch-neuronx 2.9, Neuron SDK 2.27 to 2.29) takes Python
  3.10 to 3.12.
- ``TorchNeuronConfig``: native TorchNeuron, Neuron SDK 2.34 (2026-11-30): torch-neuronx
  2.13.3.1 and 2.14.3.1, torch 2.13 and 2.14, Python 3.12 to 3.14 only.
- ``TorchTPUConfig``: torch-tpu 0.2.0 (PyPI wheels for CPython 3.11 to 3.14), torch 2.11 to
  2.15 by its own pin (``torch>=2.11.0,<=2.15.0``).

Tested (CI): torch 2.9.0 with torch_xla 2.9.0 (``make test``, ``make test-e2e``) and torch
2.14.1 without torch_xla (``make test-native``), on Python 3.11; torch-tpu 0.2.0's launch code
on torch 2.13.0 (``tests/test_native_tpu_contract.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    """One hardware stack: the config that runs it, its device packages, and the Python and
    torch (major.minor, oldest and newest) they are built for."""

    name: str
    config: str
    packages: str
    python: tuple[str, str]
    torch: tuple[str, str]
    source: str


STACKS: tuple[Stack, ...] = (
    Stack("torch_xla", "TorchXLAConfig", "torch-xla 2.9.0 (TPU: torch_xla[tpu] with libtpu)",
          ("3.10", "3.13"), ("2.9", "2.9"), "PyPI: torch_xla 2.9.0 wheels cp310 to cp313"),
    Stack("Trainium XLA SDK", "TorchXLAConfig",
          "torch-neuronx 2.9, libneuronxla, neuronx-cc 2 (Neuron SDK 2.27 to 2.29)",
          ("3.10", "3.12"), ("2.9", "2.9"), "Neuron SDK 2.27 release notes (PyTorch NeuronX 2.9)"),
    Stack("native TorchNeuron", "TorchNeuronConfig",
          "torch-neuronx 2.13.3.1 or 2.14.3.1, neuronx-cc 2, nki (Neuron SDK 2.34)",
          ("3.12", "3.14"), ("2.13", "2.14"), "Neuron SDK 2.34 release notes (2026-11-30)"),
    Stack("native TorchTPU", "TorchTPUConfig", "torch-tpu 0.2.0 (pulls libtpu)",
          ("3.11", "3.14"), ("2.11", "2.15"),
          "PyPI: torch_tpu 0.2.0 wheels cp311 to cp314, Requires-Dist torch>=2.11.0,<=2.15.0"),
)

# (config, oldest torch, newest torch), as major.minor: the hardware stack's range widened by
# the CPU twin's, which runs from torch 2.9 (the native configs' CPU twins need no torch_xla),
# and capped at the newest torch a CI run used (2.14): torch 2.15 is torch-tpu's but untested.
SUPPORTED_TORCH: tuple[tuple[str, str, str], ...] = (
    ("TorchXLAConfig", "2.9", "2.9"),
    ("TorchNeuronConfig", "2.9", "2.14"),
    ("TorchTPUConfig", "2.9", "2.14"),
)
TESTED_TORCH: tuple[str, ...] = ("2.9.0", "2.14.1")
TESTED_PYTHON = "3.11"
# The package's own floor: the CPU twins and the planner.
OLDEST_PYTHON = "3.10"


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def in_range(version: str, low: str, high: str) -> bool:
    """Whether ``version`` (``3.12.4``, ``2.13.0+cpu``) lies in [low, high] by major.minor."""
    return _major_minor(low) <= _major_minor(version) <= _major_minor(high)


def supported_range(config: str) -> tuple[str, str]:
    """(oldest, newest) torch ``config`` supports, as major.minor."""
    return {name: (low, high) for name, low, high in SUPPORTED_TORCH}[config]


def configs_supporting(torch_version: str) -> list[str]:
    """The configs whose range holds ``torch_version`` (``2.13.0+cpu`` and the like)."""
    return [name for name, low, high in SUPPORTED_TORCH if in_range(torch_version, low, high)]


def describe_ranges() -> str:
    """'TorchXLAConfig 2.9; TorchNeuronConfig 2.9-2.14; TorchTPUConfig 2.9-2.14'."""
    return "; ".join(f"{name} {low}" if low == high else f"{name} {low}-{high}"
                     for name, low, high in SUPPORTED_TORCH)


def stack(name: str) -> Stack:
    """The stack called ``name`` (``STACKS``)."""
    return {s.name: s for s in STACKS}[name]


def python_problem(python: str, stack_name: str | None) -> str:
    """Why ``python`` (``3.11.7``) cannot run the stack called ``stack_name`` (None: no device
    stack, the CPU twins only), or "" when it can."""
    if stack_name is None:
        if in_range(python, OLDEST_PYTHON, "9.99"):
            return ""
        return f"Python {python} is older than {OLDEST_PYTHON}, the oldest this package runs on"
    s = stack(stack_name)
    if in_range(python, *s.python):
        return ""
    return (f"{s.name} ({s.packages}) is built for Python {s.python[0]} to {s.python[1]}, not "
            f"{python}")
