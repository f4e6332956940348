"""Compile and execution metrics (``counters.py``: torch_xla's, Dynamo's on the native stacks),
ready for ``ray.train.report``. A healthy XLA loop compiles its graphs during the first steps
(warm-up) and then only replays them; graphs that keep compiling after warm-up make every step
slow: ``CompileMonitor`` counts them and warns once, naming the rank, the step and the cause as
the stack reports it (``compile_causes.py``).
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit.observability import timeline
from ray_train_xla.toolkit.observability.counters import Counters
from ray_train_xla.toolkit.runtime import MetricsOptions, runtime

logger = logging.getLogger(__name__)

DEFAULT_WARMUP_STEPS = 3


def is_graph_extraction_run() -> bool:
    """True on a worker of a ``neuron_parallel_compile`` run: graphs are only extracted, so
    outputs, losses and checkpoints are placeholders."""
    return worker_context().graph_extraction


class RecompilationWarning(UserWarning):
    """XLA graphs keep compiling after warm-up."""


class CompileMonitor:
    """Counts compilations and executions since it was created (``since_start``: since the
    process started). Call ``metrics(step)`` once per step (or every few steps): compilations
    after step ``warmup_steps`` count as recompilations, and when they reach ``warn_after`` one
    ``RecompilationWarning`` names the step."""

    def __init__(self, warmup_steps: int = DEFAULT_WARMUP_STEPS, warn_after: int = 1,
                 prefix: str = "xla/", since_start: bool = False) -> None:
        if warmup_steps < 0 or warn_after < 1:
            raise ValueError(f"CompileMonitor(warmup_steps={warmup_steps}, warn_after={warn_after}) "
                             "is not valid: expected warmup_steps >= 0 and warn_after >= 1")
        self.warmup_steps, self.warn_after, self.prefix = warmup_steps, warn_after, prefix
        self._counters = Counters()
        self._compiles, self._compile_s = -1.0, 0.0  # CompileTime, read when the count moves
        self._baseline = (dict.fromkeys(self._read(True), 0.0) if since_start
                          else self._read(True))
        self._at_warmup: float | None = None if warmup_steps else 0.0
        # compilations torch_xla had analysed by the end of warm-up (compile_causes=True)
        self._causes_from: int | None = None if warmup_steps else _analysed()
        self._steps = 0
        self.warned_at_step: int | None = None

    def metrics(self, step: int | None = None, execute_time: bool = False) -> dict[str, Any]:
        """A flat dict of this worker's compile/execution counts and times (seconds) so far;
        ``step``: the current step (1-based, finished), by default one more than the last call;
        ``execute_time``: also ``execute_time_s`` (about 0.2 ms to read: ask for it on the steps
        you report, not every step)."""
        step = self._steps + 1 if step is None else step
        self._steps = step
        now = self._read(execute_time)
        base = self._baseline
        compiles = now["compiles"] - base["compiles"]
        if self._at_warmup is None and step >= self.warmup_steps:
            self._at_warmup = compiles
            self._causes_from = _analysed()
        after = 0.0 if self._at_warmup is None else compiles - self._at_warmup
        if after >= self.warn_after and self.warned_at_step is None:
            self._warn(step, after)
        # Built key by key (no comprehension): this runs every step, at a few microseconds.
        p = self.prefix
        out: dict[str, Any] = {
            p + "compiles": int(compiles),
            p + "compile_time_s": now["compile_time_s"] - base["compile_time_s"],
            p + "executions": int(now["executions"] - base["executions"]),
            p + "cache_hits": int(now["cache_hits"] - base["cache_hits"]),
        }
        if execute_time:
            out[p + "execute_time_s"] = now["execute_time_s"] - base["execute_time_s"]
        out[p + "compiles_after_warmup"] = int(after)
        if is_graph_extraction_run():  # the values of this run are not meaningful
            out[p + "graph_extraction_only"] = 1
        return out

    def _read(self, execute_time: bool) -> dict[str, float]:
        """The counters now (``counters.py``); ``execute_time_s`` only when asked for."""
        c = self._counters
        compiles = c.compiles()
        if c.native or compiles != self._compiles:
            self._compiles, self._compile_s = compiles, c.compile_time_s()
        values = {"compiles": compiles, "compile_time_s": self._compile_s,
                  "executions": c.count("ExecuteComputation"), "cache_hits": c.count("CachedCompile")}
        if execute_time:
            values["execute_time_s"] = c.seconds("ExecuteTime")
        return values

    def _warn(self, step: int, after: float) -> None:
        from ray_train_xla.toolkit.observability import compile_causes

        self.warned_at_step = step
        ctx = worker_context()
        since = self._causes_from
        if since is None:
            since = int(self._baseline["compiles"] + (self._at_warmup or 0))
        what = "torch.compile" if ctx.native else "XLA"
        message = (
            f"rank {ctx.rank}: {what} compiled {int(after)} new graph(s) after warm-up "
            f"({self.warmup_steps} steps), by step {step}. Cause: "
            f"{compile_causes.causes_text(since)}. Every new input shape or constant is a new "
            "graph. Usual causes: changing input shapes (a short last batch: use "
            "prepare_data_loader/iter_xla_batches, which keep batch shapes constant), "
            "Python scalars that change every step baked into the graph (pass them as "
            "tensors), and reading values (.item(), print) in the middle of the step. Whether "
            "the ranks compile the same graphs is compared every "
            f"{compile_causes.check_interval()} steps (rank 0 warns when they do not)."
        )
        logger.warning(message)
        warnings.warn(message, RecompilationWarning, stacklevel=3)


def _analysed() -> int | None:
    """How many compilations torch_xla's analysis has written so far (None when it is off)."""
    from ray_train_xla.toolkit.observability import compile_causes

    log = compile_causes.debug_log()
    if worker_context().native or not log.enabled:
        return None
    log.read()
    return len(log.compilations)


def metrics(step: int | None = None, warmup_steps: int | None = None,
            execute_time: bool = False) -> dict[str, Any]:
    """This worker's XLA compile/execution metrics and step timeline as a flat dict for
    ``ray.train.report``: counts since the process started and, in a training function,
    ``timeline/...`` keys for the steps since this call site's previous call (each place that
    calls it has its own window; the keys: ``docs/observability.md``). Warns once on
    recompilations after ``warmup_steps`` (default 3; see ``CompileMonitor``; a value that
    differs from the one in effect raises ``ValueError``). Cheap enough for every step;
    ``execute_time=True`` adds ``xla/execute_time_s``, about 0.2 ms to read (ask for it when
    reporting)."""
    if warmup_steps is not None and (isinstance(warmup_steps, bool) or
                                     not isinstance(warmup_steps, int) or warmup_steps < 0):
        raise ValueError(f"metrics: warmup_steps={warmup_steps!r} must be an int >= 0")
    rt = runtime()
    rt.configure(MetricsOptions, warmup_steps=warmup_steps)
    with rt.lock:
        if rt.compile_monitor is None:
            rt.compile_monitor = CompileMonitor(
                warmup_steps=rt.options(MetricsOptions, capture=True).warmup_steps,
                since_start=True)
        monitor = rt.compile_monitor
    out = monitor.metrics(step, execute_time)
    caller = sys._getframe(1)
    out.update(timeline.report_metrics((caller.f_code, caller.f_lineno)))
    return out
