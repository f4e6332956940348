"""The step timeline's figures as Ray metrics (``ray.util.metrics``) for Ray's dashboard,
Prometheus and Grafana (the metrics: ``docs/observability.md``; the dashboard:
``docs/grafana-dashboard.json``), set from the timeline's background thread every
``interval_s``, never from the step. Ray exports them with its ``ray_`` prefix; they leave the
node through Ray's metrics agent (``pip install 'ray[default]'``). Rank 0 also sets
``train_xla_straggler_excess_seconds`` for each rank it names a straggler
(``goodput.stragglers``, every ``storage_interval_s``, over the last 5 minutes and at most the
last 2000 steps that every rank has written; 0 once no longer named).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

TAG_KEYS = ("run", "rank", "node", "device")
BUCKETS = ("step", "data_wait", "checkpoint_stall", "compilation")


class _Metrics:
    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self.step_time = Gauge("train_xla_step_time_seconds",
                               "Mean step time over the last interval (host time between step ends)",
                               tag_keys=TAG_KEYS)
        self.samples = Gauge("train_xla_samples_per_second", "Samples per second over the last "
                             "interval", tag_keys=TAG_KEYS)
        self.tokens = Gauge("train_xla_tokens_per_second", "Tokens per second over the last "
                            "interval", tag_keys=TAG_KEYS)
        self.tflops = Gauge("train_xla_tflops_per_second", "Model TFLOP/s of this device over "
                            "the last interval", tag_keys=TAG_KEYS)
        self.mfu = Gauge("train_xla_mfu", "Model FLOPs utilisation: model TFLOP/s over the "
                         "device's peak", tag_keys=TAG_KEYS)
        self.memory = Gauge("train_xla_device_memory_bytes", "Device memory in use (process RSS on "
                            "CPU)", tag_keys=TAG_KEYS)
        self.peak = Gauge("train_xla_device_memory_peak_bytes", "Peak device memory in use",
                          tag_keys=TAG_KEYS)
        self.goodput = Gauge("train_xla_goodput_ratio", "Productive step time over the time since "
                             "this worker group started", tag_keys=TAG_KEYS)
        self.steps = Counter("train_xla_steps", "Training steps finished", tag_keys=TAG_KEYS)
        self.seconds = Counter("train_xla_time_seconds", "Seconds of step time, by bucket",
                               tag_keys=(*TAG_KEYS, "bucket"))
        self.straggler = Gauge("train_xla_straggler_excess_seconds", "Seconds a step by which "
                               "this rank's median own time (before the step's gradient "
                               "synchronisation) exceeds the other ranks' median, over the steps "
                               "every rank has written, for the ranks named stragglers",
                               tag_keys=("run", "rank"))
        self.named: set[int] = set()  # ranks named stragglers so far (rank 0)
        self.stragglers: dict[int, float] = {}  # as last read
        self.productive = 0.0
        self.step_s: float | None = None  # the last interval's mean step time


def exporter() -> Callable[[Any, dict], None] | None:
    """A function the timeline calls with itself and the totals of each interval; None when
    Ray's metrics cannot be used here."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        node_ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 (outside Ray)
        return None
    metrics = functools.cache(_Metrics)  # made at the first export, then the same

    def export(tl: Any, window: dict) -> None:
        m = metrics()
        tags = {"run": tl.run or "unnamed", "rank": str(tl.rank), "node": node_ip,
                "device": tl.device}
        if window["steps"]:
            m.step_s = window["step_s"] / window["steps"]
            m.steps.inc(window["steps"], tags=tags)
        # Gauges are set again every interval, new steps or not: Ray's agent drops a gauge not
        # refreshed within two export intervals (a worker that stopped).
        step_s = m.step_s
        if step_s is not None:
            m.step_time.set(step_s, tags=tags)
            samples, tokens = window.get("samples_per_step"), window.get("tokens_per_step")
            if step_s > 0 and samples:
                m.samples.set(samples / step_s, tags=tags)
            if step_s > 0 and tokens:
                m.tokens.set(tokens / step_s, tags=tags)
            flops, peak = window.get("flops_per_step"), window.get("peak_tflops")
            if step_s > 0 and flops:
                m.tflops.set(flops / step_s / 1e12, tags=tags)
                if peak:
                    m.mfu.set(flops / step_s / 1e12 / peak, tags=tags)
        for bucket, key in zip(BUCKETS, ("step_s", "data_s", "stall_s", "compile_s")):
            if window[key] > 0:
                m.seconds.inc(window[key], tags={**tags, "bucket": bucket})
        m.productive += max(0.0, window["step_s"] - window["data_s"] - window["stall_s"]
                            - window["compile_s"])
        elapsed = time.time() - tl.group_start
        if elapsed > 0:
            m.goodput.set(min(1.0, m.productive / elapsed), tags=tags)
        if window.get("stragglers") is not None:  # rank 0, every storage_interval_s
            m.stragglers = window["stragglers"]
            m.named |= set(m.stragglers)
        for rank in m.named:  # set again every interval (a gauge not refreshed is dropped)
            m.straggler.set(m.stragglers.get(rank, 0.0), tags={"run": tags["run"], "rank": str(rank)})
        memory = tl.memory
        if memory is not None:
            m.memory.set(memory[0], tags=tags)
            m.peak.set(memory[1], tags=tags)

    return export
