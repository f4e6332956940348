"""Compile and execution metrics from ``torch_xla.debug.metrics``, ready for ``ray.train.report``.

A healthy XLA loop compiles its graphs during the first steps (warm-up) and then only replays
them. Graphs that keep compiling after warm-up (a recompilation storm) make every step slow;
``CompileMonitor`` counts them and warns once, naming the step and the usual causes.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_WARMUP_STEPS = 3
_NS = 1e-9


def is_graph_extraction_run() -> bool:
    """True on a worker of a ``neuron_parallel_compile`` run: graphs are only extracted, so
    outputs, losses and checkpoints are placeholders."""
    return os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY") == "1"


class RecompilationWarning(UserWarning):
    """XLA graphs keep compiling after warm-up."""


def _read() -> dict[str, float]:
    import ray_train_xla.worker.device as _device

    if _device.is_native():
        return _read_native()
    import torch_xla.debug.metrics as met

    def metric(name: str) -> tuple[float, float]:
        data = met.metric_data(name)
        return (float(data[0]), float(data[1])) if data else (0.0, 0.0)

    compiles, compile_ns = metric("CompileTime")
    executions, execute_ns = metric("ExecuteTime")
    return {
        "compiles": compiles,
        "compile_time_s": compile_ns * _NS,
        "executions": executions,
        "execute_time_s": execute_ns * _NS,
        "cache_hits": float(met.counter_value("CachedCompile") or 0),
    }


def _read_native() -> dict[str, float]:
    """The native path's compiles are ``torch.compile``'s: graphs Dynamo compiled (each new
    shape or guard failure is one more) and the time spent compiling; executions are eager and
    not counted."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "compiles": float(counters["stats"]["unique_graphs"]),
        "compile_time_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))),
        "executions": 0.0,
        "execute_time_s": 0.0,
        "cache_hits": 0.0,
    }


class CompileMonitor:
    """Counts compilations and executions since it was created (``since_start``: since the
    process started); warns on recompilation storms.

    Call ``metrics(step)`` once per step (or every few steps). Compilations after step
    ``warmup_steps`` count as recompilations; when they reach ``warn_after``, one
    ``RecompilationWarning`` is issued with the step number.
    """

    def __init__(self, warmup_steps: int = DEFAULT_WARMUP_STEPS, warn_after: int = 1,
                 prefix: str = "xla/", since_start: bool = False) -> None:
        if warmup_steps < 0 or warn_after < 1:
            raise ValueError(
                f"CompileMonitor(warmup_steps={warmup_steps}, warn_after={warn_after}) is not "
                "valid: expected warmup_steps >= 0 and warn_after >= 1"
            )
        self.warmup_steps = warmup_steps
        self.warn_after = warn_after
        self.prefix = prefix
        self._baseline = {k: 0.0 for k in _read()} if since_start else _read()
        self._at_warmup: float | None = None if warmup_steps else 0.0
        self._steps = 0
        self.warned_at_step: int | None = None

    def metrics(self, step: int | None = None) -> dict[str, Any]:
        """A flat dict of this worker's compile/execution counts and times (seconds) so far.

        ``step``: the current step (1-based, finished); default: one more than the last call.
        """
        step = self._steps + 1 if step is None else step
        self._steps = step
        now = _read()
        values = {k: now[k] - self._baseline[k] for k in now}
        if self._at_warmup is None and step >= self.warmup_steps:
            self._at_warmup = values["compiles"]
        after = 0.0 if self._at_warmup is None else values["compiles"] - self._at_warmup
        if after >= self.warn_after and self.warned_at_step is None:
            self.warned_at_step = step
            message = (
                f"XLA compiled {int(after)} new graph(s) after warm-up ({self.warmup_steps} "
                f"steps), by step {step}: every new input shape or constant is a new graph. "
                "Usual causes: changing input shapes (a short last batch: use "
                "prepare_data_loader/iter_xla_batches, which keep batch shapes constant), "
                "Python scalars that change every step baked into the graph (pass them as "
                "tensors), and reading values (.item(), print) in the middle of the step."
            )
            logger.warning(message)
            warnings.warn(message, RecompilationWarning, stacklevel=2)
        out: dict[str, Any] = {f"{self.prefix}{k}": (int(v) if k in ("compiles", "executions",
                               "cache_hits") else v) for k, v in values.items()}
        out[f"{self.prefix}compiles_after_warmup"] = int(after)
        if is_graph_extraction_run():  # the values of this run are not meaningful
            out[f"{self.prefix}graph_extraction_only"] = 1
        return out


_default: CompileMonitor | None = None


def metrics(step: int | None = None, warmup_steps: int = DEFAULT_WARMUP_STEPS) -> dict[str, Any]:
    """This worker's XLA compile/execution metrics as a flat dict for ``ray.train.report``.

    Counts since the process started; warns once on recompilations after
    ``warmup_steps`` (see ``CompileMonitor``).
    """
    global _default
    if _default is None:
        _default = CompileMonitor(warmup_steps=warmup_steps, since_start=True)
    return _default.metrics(step)
