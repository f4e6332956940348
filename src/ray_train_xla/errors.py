"""Every error type of the package, in one module that everything may import (no Ray, no torch).
``XLAConfigError`` is raised in the driver, before any worker starts; ``WorkerSetupError`` and its
kinds (``XLAInitError``, ``RendezvousTimeoutError``) while a worker is set up."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class Term:
    """A part of an error message that its reader spells differently: the Python API's words
    (``ScalingConfig(num_workers=32, ...)``, ``spmd=True``: the default, ``str``) or
    ``ray-train-xla plan``'s flags (``--nodes 4 --workers-per-node 8``, ``--spmd``)."""

    def __init__(self, api: str, plan: str) -> None:
        self.api, self.plan = api, plan

    def __str__(self) -> str:
        return self.api

    def __repr__(self) -> str:
        return f"Term({self.api!r}, {self.plan!r})"


class XLAConfigError(ValueError):
    """A configuration mistake that can be named and fixed before training starts. Built from
    text and :class:`Term` parts: ``str()`` reads in the API's words, :meth:`for_plan` in
    ``plan``'s flags, so one message serves both."""

    def __init__(self, *parts: Any) -> None:
        self.parts = parts
        super().__init__("".join(map(str, parts)))

    def for_plan(self) -> str:
        """The message with every :class:`Term` in ``ray-train-xla plan``'s flags."""
        return "".join(p.plan if isinstance(p, Term) else str(p) for p in self.parts)


class WorkerSetupError(RuntimeError):
    """A worker could not be set up; the message names the worker and what to do."""


class XLAInitError(WorkerSetupError):
    """torch_xla's own initialisation (at import, or enabling SPMD) failed on a worker."""


class RendezvousTimeoutError(WorkerSetupError):
    """Not every rank reached the rendezvous within ``timeout_s``."""


class ShardedStateError(ValueError):
    """Sharded state was given to a helper that would silently get it wrong."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit what it is loaded into: a tensor of another shape or dtype, a
    key missing from the checkpoint or one the target does not have (each named)."""


class NeuronCompileError(RuntimeError):
    """Parallel compilation of the extracted graphs failed on a worker."""


def config_error(field_name: str, value: Any, expected: str | Iterable[str] | Term,
                 owner: str = "TorchXLAConfig", *more: Any) -> XLAConfigError:
    """Build the one error type for bad options: the field, the bad value, the valid choices
    (``expected`` and ``more``: text or :class:`Term` parts)."""
    if not isinstance(expected, (str, Term)):
        expected = "one of " + ", ".join(repr(c) for c in expected)
    return XLAConfigError(f"{owner}.{field_name}={value!r} is not valid: expected ", expected,
                          *more, ".")


class RecoveryError(RuntimeError):
    """Recovery in place (``recovery="in_place"``) cannot go on: its budget is spent, a fault
    repeated at the same step, or the training function took a step after a recovery without
    ``load_checkpoint``. The run fails with it (its cause: the fault)."""


class ReportError(RuntimeError):
    """A report or checkpoint handed to the background reporter failed, or could not be made
    within ``timeout_s``; raised in the training function at its next report and at its end."""


def run_failure(exc: BaseException) -> str:
    """One line for a failed Ray Train run: the first worker's (or the controller's) own error,
    not the remote tracebacks Ray wraps around it."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        failures = getattr(exc, "worker_failures", None)  # ray.train.WorkerGroupError
        inner = (failures[min(failures)] if failures
                 else getattr(exc, "controller_failure", None)  # ray.train.ControllerError
                 or getattr(exc, "cause", None))  # ray.exceptions.RayTaskError
        if not isinstance(inner, BaseException):
            break
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") or line.startswith("File ")
                              for line in lines):
        return lines[-1]  # a traceback as text ends with "Type: message"
    return f"{type(exc).__name__}: {' '.join(lines)}"
