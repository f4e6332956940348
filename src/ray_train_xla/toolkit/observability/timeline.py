"""The step timeline of one worker: where each step's time goes, at a cost of a few
microseconds a step (what it measures and reports: ``docs/observability.md``).

The training thread only stamps boundaries. At the end of every step (each step once, by the
rules of ``steps.py``) it appends one record to a bounded buffer: the step's end (host wall
clock) and, since the previous end, its time blocked in the toolkit's loaders handing out a
batch (data wait), in ``save_checkpoint``, ``report`` and ``flush_reports`` (stall), compiling
(the compile time, read again only when the compile counter moved: about 0.6 us) and its own
time (``arrived``), which tells a slow rank where synchronous collectives give every rank the
same step time. Step time is host time: XLA's queue is short, so in steady state the host
waits for the device every step, without a forced sync. The loaders also hand it each batch's
tokens and samples (``add_batch``): with the model the package prepared (``flops.py``) they
give each step's model FLOPs where ``configure_timeline`` gives none.

A background thread, every ``interval_s``, drains the buffer into spans and events, reads
device memory, sets the Ray metrics (``ray_metrics.py``) and, every ``storage_interval_s``, at
checkpoints and at the end, writes this worker's goodput events into the run's storage
(``goodput/attempt-<id>/rank-<r>.<part>.jsonl``, read by ``goodput.py``). The training path
tells it what happens through ``toolkit/events.py``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ray_train_xla.toolkit.observability.flops import NO_MODEL, batch_counts
from ray_train_xla.toolkit.runtime import TimelineOptions, runtime

logger = logging.getLogger(__name__)

BUFFER_RECORDS = 65536  # steps (and marks) held between two background runs; older ones drop
# A goodput file part is rewritten whole at every write: it is bounded in lines and in bytes
# (spans hold each step's own time: about 4 bytes a step, 20 KB a span at 1 step/ms; 2000
# spans without them weigh about as much as this bound).
PART_LINES = 2000
PART_BYTES = 1 << 19
MAX_COMPILE_EVENTS = 500  # compilation events kept per worker and attempt (storms are summed)
# Rank 0's Ray metric names the stragglers of the last 5 minutes, over at most the last 2000
# steps every rank has written (the medians of 2000 steps: a few ms a rank every write).
STRAGGLER_WINDOW_S = 300.0
STRAGGLER_WINDOW_STEPS = 2000
GOODPUT_DIR = "goodput"

# Record kinds in the buffer.
STEP, CHECKPOINT, END = 0, 1, 2

def configure_timeline(samples_per_step: float | None = None, tokens_per_step: float | None = None,
                       interval_s: float | None = None, storage_interval_s: float | None = None,
                       flops_per_step: float | None = None, peak_tflops: float | None = None,
                       straggler_threshold: float | None = None) -> None:
    """Say what one step of this worker processes (``samples_per_step``, ``tokens_per_step``:
    samples/s and tokens/s; ``flops_per_step``, the model FLOPs of its forward and backward on
    one device, from ``model_flops_per_token`` or ``count_flops``: TFLOP/s and MFU against
    ``peak_tflops``, by default the config's, else ``device_peak``). Left unsaid, they are
    counted from the batches of the toolkit's loaders and, for FLOPs, the model that
    ``prepare_model``, ``prepare_sharded_model`` or ``load_pretrained`` prepared
    (``flops.py``); a value given here wins. How often the background
    thread runs (``interval_s``: Ray metrics and memory, 5 s; ``storage_interval_s``: goodput
    events, 30 s, and always at checkpoints and at the end) and ``straggler_threshold`` (rank 0's
    Ray metric names the ranks whose own time exceeds the others' median by more than this share
    of the step time, 0.1). Call it on every worker; values left None are as they are, and a
    value that differs from one set before (or from the config's) raises ``ValueError``."""
    values = {"samples_per_step": samples_per_step, "tokens_per_step": tokens_per_step,
              "interval_s": interval_s, "storage_interval_s": storage_interval_s,
              "flops_per_step": flops_per_step, "peak_tflops": peak_tflops,
              "straggler_threshold": straggler_threshold}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise ValueError(f"configure_timeline: {name}={value!r} must be a number > 0")
    rt = runtime()
    rt.configure(TimelineOptions, **{k: None if v is None else float(v) for k, v in values.items()})
    if rt.timeline is not None:
        rt.timeline.wake()


# Where a Linux machine's firmware names it: on EC2 Nitro instances, the instance type.
PRODUCT_NAME = "/sys/devices/virtual/dmi/id/product_name"


def instance_type(path: str = PRODUCT_NAME) -> str:
    """The machine's type as its firmware names it (``trn1.32xlarge`` on EC2), or ""."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def device_peak(device: str) -> tuple[float | None, str]:
    """(peak TFLOP/s, where it comes from) of one device of this worker: the published figure
    of ``TPU_ACCELERATOR_TYPE`` on TPU, of the instance type at ``NEURON_LOGICAL_NC_CONFIG`` on
    Trainium, a matmul probe on CPU; (None, why) where none is known."""
    from ray_train_xla.planning import peaks

    if device == "cpu":
        from ray_train_xla.toolkit.observability.flops import cpu_peak_tflops

        return cpu_peak_tflops(), "measured: a float32 matmul probe of this worker"
    if device == "tpu":
        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        found = peaks.device_peak(accelerator)
        what = f"TPU_ACCELERATOR_TYPE={accelerator!r}"
    elif device == "neuron":
        instance = instance_type()
        found = peaks.neuron_peak(instance, os.environ)
        lnc = os.environ.get(peaks.LNC_VAR)
        what = (f"instance type {instance!r}" if instance else
                f"an instance type not named here ({PRODUCT_NAME} unreadable)")
        what += f", {peaks.LNC_VAR}={lnc}" if lnc else ""
    else:
        return None, f"no published peak for device {device!r}"
    if found is None:
        return None, f"no published peak for {what}"
    return found.bf16, f"the published bf16 peak of a {found.device}, from {what}"


# ---- device memory, off the step path ---------------------------------------------------------

def device_memory(xla_info: list[bool]) -> tuple[float, float] | None:
    """(bytes in use, peak bytes) of this worker's device: what its stack reads from the device
    (torch_xla's memory info, ``xla_info[0]`` False once it said it has none; the native
    device's allocator), else this process's resident memory; None when nothing can be read."""
    from ray_train_xla.toolkit.stacks import stack

    found = None
    with contextlib.suppress(Exception):  # (the XLA CPU device has no allocator stats: RSS)
        found = stack().device_memory(xla_info)
    return found if found is not None else _process_memory()


def _process_memory() -> tuple[float, float] | None:
    try:
        import resource

        with open("/proc/self/statm") as f:
            rss = float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
        return rss, max(rss, peak)
    except (OSError, ValueError, ImportError, IndexError):
        return None


# ---- the timeline -----------------------------------------------------------------------------


class Timeline:
    """The timeline of one worker for one training function (see the module docstring)."""

    def __init__(self, *, attempt: str = "", rank: int = 0, world: int = 1, local_rank: int = 0,
                 node: str = "", device: str = "", group_start: float = 0.0,
                 run_start: float = 0.0, recovery: str = "", storage: Any = None, run: str = "",
                 export: Any = None,
                 compile_reader: Any = None, clock: Callable[[], float] = time.time,
                 options: Callable[[], TimelineOptions] = TimelineOptions,
                 model_flops: Callable[[], Any] = lambda: None) -> None:
        self.attempt, self.rank, self.world = attempt, rank, world
        self._options = options  # configure_timeline's, as they are now
        self._model_flops = model_flops  # flops.ModelFlops of the runtime (None: no model yet)
        self._xla_memory_info = [True]  # False once the XLA device said it has no statistics
        self.node, self.device, self.run = node, device, run
        self._clock = clock
        self.begin = clock()
        self.group_start = group_start or self.begin
        self.run_start = run_start  # when fit() handed the config to Ray; 0.0 when unknown
        self._storage, self._export = storage, export
        # The training thread's accumulators since the last boundary.
        self.data_s = self.stall_s = 0.0
        self.tokens = self.token_positions = self.samples = 0  # of the loaders' batches
        self._last = self._prev_step_end = self.begin
        self._own: float | None = None  # this step's own time, once it arrived (``arrived``)
        self._step_stall = 0.0  # stall in this step's checkpoint records so far
        self._count, self._compile_total = compile_reader or (None, None)
        self._compiles = self._count() if self._count else 0.0
        self._compile_s = self._compile_total() if self._compile_total else 0.0
        self._buf: collections.deque = collections.deque(maxlen=BUFFER_RECORDS)
        self._appended = 0  # records appended (the training thread), to count drops
        self._commits: collections.deque = collections.deque()  # when Ray took each checkpoint
        # What metrics() reports: steps, step s, data s, stall s, compile s, tokens, tokens x
        # their sequence's length, samples since the start, and where each caller of metrics()
        # read them last (its window starts there).
        self._m = [0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0]
        self._read: dict[Any, list] = {}
        # The background side.
        self._lock = threading.Lock()
        self._drained = self._dropped = 0
        self._span: dict[str, Any] | None = None
        self._first_done = False
        self._part = self._compile_events = 0
        self._dirty = True
        self._last_write = 0.0
        # (bytes in use, peak bytes) of the device, as last read by the background thread
        self.memory: tuple[float, float] | None = None
        self._write_error_logged = False
        self._peak: list[tuple] = []  # the device's (peak TFLOP/s, source), once looked up
        self._header = {
            "kind": "worker", "attempt": attempt, "rank": rank, "world": world,
            "local_rank": local_rank, "node": node, "device": device,
            "group_start": self.group_start, "run_start": self.run_start, "begin": self.begin,
            "pid": os.getpid(),
        }  # what one step processes is added at each write of the first part (``_write``)
        if recovery:  # this attempt is a generation started by a recovery of that kind
            self._header["recovery"] = recovery
        self._lines = [json.dumps(self._header)]
        self._bytes = 0  # of the lines of the current part (``PART_BYTES``)
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- the training thread: microseconds ----------------------------------------------------

    def _boundary(self, kind: int, steps: int) -> None:
        now = self._clock()
        compile_s = 0.0
        count = self._count
        if count is not None:
            c = count()
            if c != self._compiles:
                self._compiles = c
                total = self._compile_total()
                compile_s, self._compile_s = total - self._compile_s, total
        data, stall, own = self.data_s, self.stall_s, None
        if kind == STEP:
            own, self._own, self._step_stall = self._own, None, 0.0
        else:
            self._step_stall += stall
        self._buf.append((kind, steps, self._last, now, data, stall, compile_s, own))
        self._appended += 1
        self.data_s = self.stall_s = 0.0
        self._last = now
        m = self._m  # what metrics() reports: whole steps, their checkpoints included
        m[2] += data
        m[3] += stall
        m[4] += compile_s
        m[5] += self.tokens
        m[6] += self.token_positions
        m[7] += self.samples
        self.tokens = self.token_positions = self.samples = 0
        if kind == STEP:
            m[0] += 1
            m[1] += now - self._prev_step_end
            self._prev_step_end = now

    def add_batch(self, batch: Any) -> None:
        """A loader of the toolkit handed out ``batch``: its tokens and samples count in this
        step (``flops.batch_counts``; not with gradients off)."""
        counts = batch_counts(batch)
        if counts is not None:
            self.tokens += counts[0]
            self.token_positions += counts[1]
            self.samples += counts[2]

    def arrived(self) -> None:
        """This rank reached the step's gradient synchronisation (the first arrival counts): its
        own time of the step is the time since the previous step end, less its checkpoint stall."""
        if self._own is None:
            self._own = (self._clock() - self._prev_step_end - self._step_stall
                         - self.stall_s)

    def on_step(self, steps: int) -> None:
        """The step hook (``steps.add_step_hook``): one step ended."""
        self._boundary(STEP, steps)

    def checkpoint_saved(self, steps: int) -> None:
        """``save_checkpoint`` returned: the state of this step is on its way to storage. The
        time so far belongs before the checkpoint (goodput's lost work starts here)."""
        self._boundary(CHECKPOINT, steps)

    def peak(self) -> tuple[float | None, str]:
        """(peak TFLOP/s, where it comes from) that MFU is taken against: the configured
        ``peak_tflops``, else ``device_peak`` (once); None when unknown (warned once)."""
        given = self._options().peak_tflops
        if given:
            return given, "given: the config's or configure_timeline's peak_tflops"
        if not self._peak:
            try:
                found = device_peak(self.device)
            except Exception as exc:  # noqa: BLE001 (no MFU, the run goes on)
                found = None, f"the peak of {self.device}: {type(exc).__name__}: {exc}"
            if found[0] is None:
                logger.warning("rank %d: timeline: %s here, so no MFU: give the config's "
                               "peak_tflops or configure_timeline(peak_tflops=...)", self.rank,
                               found[1])
            self._peak.append(found)
        return self._peak[0]

    def peak_tflops(self) -> float | None:
        """The peak TFLOP/s MFU is taken against (``peak``); None when unknown."""
        return self.peak()[0]

    def per_step(self, m: list | None = None) -> dict[str, Any]:
        """What one step processed over the steps of ``m`` (a window of ``_m``; by default all
        so far): ``samples_per_step`` and ``tokens_per_step`` (``configure_timeline``'s, else
        the loaders' batches'), ``flops_per_step`` of one device with ``flops_from``, the rule
        that gave them, or None with ``why``."""
        m = self._m if m is None else m
        options, steps = self._options(), m[0]
        out: dict[str, Any] = {
            "samples_per_step": options.samples_per_step or (m[7] / steps if steps else None),
            "tokens_per_step": options.tokens_per_step or (m[5] / steps if steps else None)}
        if options.flops_per_step:
            out.update(flops_per_step=options.flops_per_step, flops_from="configure_timeline")
            return out
        model = self._model_flops()
        flops, source = ((None, NO_MODEL) if model is None else
                         model.per_step(m[5], m[6], m[7], steps) if steps else
                         (None, "no step yet"))
        out.update(flops_per_step=flops, **{"flops_from" if flops else "why": source})
        return out

    def mfu_missing(self, figures: dict[str, Any]) -> str | None:
        """Why there is no MFU for ``figures`` (``per_step``), naming the call that adds it;
        None when there is one."""
        if not figures["flops_per_step"]:
            return f"no model FLOPs a step: {figures['why']}"
        peak, why = self.peak()
        if not peak:
            return (f"no peak TFLOP/s: {why}; give the config's peak_tflops= or "
                    "rtx.configure_timeline(peak_tflops=...)")
        return None

    def report_metrics(self, caller: Any = None) -> dict[str, Any]:
        """The steps since ``caller``'s previous call, as ``timeline/...`` metrics (empty when
        none): each caller has its window, so two never take each other's steps."""
        totals, last = list(self._m), self._read.get(caller)
        m = totals if last is None else [t - p for t, p in zip(totals, last)]
        n = m[0]
        if not n:
            return {}
        self._read[caller] = totals
        step_s = m[1] / n if m[1] else 0.0
        out = {
            "timeline/steps": n,
            "timeline/step_time_s": step_s,
            "timeline/data_wait_s": m[2] / n,
            "timeline/checkpoint_stall_s": m[3] / n,
            "timeline/compile_s": m[4] / n,
        }
        if step_s > 0:
            fig = self.per_step(m)
            if fig["samples_per_step"]:
                out["timeline/samples_per_s"] = fig["samples_per_step"] / step_s
            if fig["tokens_per_step"]:
                out["timeline/tokens_per_s"] = fig["tokens_per_step"] / step_s
            flops = fig["flops_per_step"]
            if flops:
                tflops = flops / step_s / 1e12
                out.update({"timeline/flops_per_step": flops,
                            "timeline/flops_from": fig["flops_from"],
                            "timeline/tflops_per_s": tflops})
                peak = self.peak_tflops()
                if peak:
                    out["timeline/mfu"] = tflops / peak
            missing = self.mfu_missing(fig)
            if missing:
                out["timeline/mfu_missing"] = missing
        memory = self.memory
        if memory is not None:
            out["timeline/device_memory_bytes"], out["timeline/device_memory_peak_bytes"] = memory
        return out

    # ---- other threads ------------------------------------------------------------------------

    def checkpoint_committed(self) -> None:
        """Ray took the oldest checkpoint still in flight (the background reporter's thread)."""
        self._commits.append(self._clock())
        self.wake()

    def restored(self, tier: str, seconds: float) -> None:
        """A restore from ``tier`` (memory or storage) that took ``seconds``: a goodput event."""
        with self._lock:
            self._event({"kind": "restore", "t": self._clock(), "tier": tier, "seconds": seconds},
                        due=True)

    def memory_kept(self, t: float) -> None:
        """The memory tier completed the snapshot taken at ``t`` (every rank's files are in):
        a restore from memory resumes from there (goodput counts no work before it as lost)."""
        with self._lock:
            self._event({"kind": "memory_kept", "t": t})

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ray_train_xla-timeline", daemon=True)
        self._thread.start()

    def end(self, failed: bool = False, error: str = "", stopped: bool = False,
            timeout_s: float = 30.0) -> None:
        """The training function returned (or raised; ``stopped``: Ray shut the worker group
        down while it ran): its last span, then every event written."""
        self._boundary(END, -1)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            self._drain()
            end = {"kind": "end", "t": self._last, "failed": failed, "error": error[:500]}
            if stopped:
                end["stopped"] = True
            self._event(end)
            self._write(force=True)

    def _run(self) -> None:
        next_memory = next_stragglers = 0.0
        while not self._stop:
            self._wake.wait(self._options().interval_s)
            self._wake.clear()
            if self._stop:
                return
            try:
                options, now = self._options(), time.monotonic()
                if now >= next_memory:
                    self.memory = device_memory(self._xla_memory_info)
                    next_memory = now + options.interval_s
                with self._lock:
                    window = self._drain()
                    self._write()
                if self._export is not None:
                    fig = self.per_step()
                    flops = fig["flops_per_step"]
                    window.update(samples_per_step=fig["samples_per_step"],
                                  tokens_per_step=fig["tokens_per_step"], flops_per_step=flops,
                                  peak_tflops=self.peak_tflops() if flops else None)
                    if (self.rank == 0 and self.world > 1 and self._storage is not None
                            and now >= next_stragglers):
                        next_stragglers = now + options.storage_interval_s
                        window["stragglers"] = self.stragglers()
                    self._export(self, window)
            except Exception as exc:  # noqa: BLE001 (never take the run down for its timeline)
                logger.warning("rank %d: timeline: %s: %s", self.rank, type(exc).__name__, exc)

    def stragglers(self) -> dict[int, float]:
        """(Rank 0) the ranks named stragglers over the last ``STRAGGLER_WINDOW_S``, from every
        rank's newest events, over the last ``STRAGGLER_WINDOW_STEPS`` steps every rank has
        written: their excess own time a step, in seconds (``goodput.stragglers``)."""
        from ray_train_xla.toolkit.observability.goodput import live_stragglers

        found = live_stragglers(self._storage, self.path(0).rsplit("/", 1)[0],
                                self._clock() - STRAGGLER_WINDOW_S,
                                self._options().straggler_threshold, STRAGGLER_WINDOW_STEPS)
        return {s.rank: s.excess_per_step_s for s in found}

    def _drain(self) -> dict[str, float]:
        """(Holding the lock) turn the buffered records into spans and events; returns the
        totals of the steps drained (for the Ray metrics)."""
        window = {"steps": 0, "step_s": 0.0, "data_s": 0.0, "stall_s": 0.0, "compile_s": 0.0}
        while self._commits:  # (lost work is counted from the checkpoints Ray took: write now)
            self._event({"kind": "commit", "t": self._commits.popleft()}, due=True)
        appended = self._appended
        while self._buf:  # (this thread alone takes records out)
            self._drained += 1
            self._record(self._buf.popleft(), window)
        lost = appended - self._drained - len(self._buf)
        if lost > self._dropped:  # the deque dropped its oldest records: the timeline is behind
            logger.warning("rank %d: timeline: %d step records dropped (the background thread "
                           "fell behind)", self.rank, lost - self._dropped)
            self._event({"kind": "dropped", "records": lost - self._dropped})
            self._dropped = lost
        self._close_span()
        return window

    def _record(self, rec: tuple, window: dict[str, float]) -> None:
        kind, steps, t0, t1, data, stall, compile_s, own = rec
        if kind == END:
            self._close_span()  # the tail after the last step is a span of its own
        span = self._span
        if span is None:
            span = self._span = {"kind": "span", "t0": t0, "t1": t1, "steps": 0, "data_s": 0.0,
                                 "stall_s": 0.0, "compile_s": 0.0}
        span["t1"] = t1
        for key, value in (("data_s", data), ("stall_s", stall), ("compile_s", compile_s)):
            span[key] += value
            if kind != END:
                window[key] += value
        if kind == STEP:
            span["steps"] += 1
            span["last_step"] = steps
            window["steps"] += 1
            if own is not None and not compile_s:  # a step that compiled: the compiler's time
                span.setdefault("own", []).append((steps, own))
        if kind != END:
            window["step_s"] += t1 - t0
        if compile_s > 0 and self._compile_events < MAX_COMPILE_EVENTS:
            self._compile_events += 1
            self._event({"kind": "compile", "t": t1, "compile_s": compile_s, "step": steps})
        if kind == STEP and not self._first_done:
            self._first_done = True
            span["first"] = True  # begin -> the end of the first step: start-up
            self._close_span()
        elif kind == CHECKPOINT:
            self._close_span()
            self._event({"kind": "checkpoint", "t": t1, "step": steps}, due=True)
        elif kind == END:
            self._close_span()

    def _close_span(self) -> None:
        if self._span is not None:
            own = self._span.pop("own", None)
            if own:  # each step's own time, in microseconds, by its index (None: not measured)
                first = own[0][0]
                values: list[int | None] = [None] * (own[-1][0] - first + 1)
                for step, value in own:
                    values[step - first] = round(value * 1e6)
                self._span.update(own_step=first, own_us=values)
            self._event(self._span)
            self._span = None

    def _event(self, event: dict[str, Any], due: bool = False) -> None:
        """(Holding the lock) one goodput event; ``due``: written at the thread's next run."""
        line = json.dumps(event, separators=(",", ":"))
        self._lines.append(line)
        self._bytes += len(line) + 1
        self._dirty = True
        if due:
            self._last_write = 0.0

    def _write(self, force: bool = False) -> None:
        """(Holding the lock) write this worker's current part when it changed and is due."""
        if self._storage is None or not self._dirty:
            return
        now = time.monotonic()
        if not force and now - self._last_write < self._options().storage_interval_s:
            return
        if self._part == 0:  # what one step processes may have been configured since
            fig = self.per_step()
            flops = fig["flops_per_step"]
            self._header.update(samples_per_step=fig["samples_per_step"],
                                tokens_per_step=fig["tokens_per_step"], flops_per_step=flops,
                                flops_from=fig.get("flops_from"),
                                peak_tflops=self.peak_tflops() if flops else None,
                                mfu_missing=self.mfu_missing(fig))
            self._lines[0] = json.dumps(self._header)
        self._lines.append(json.dumps({"kind": "alive", "t": self._clock()}))
        try:
            self._storage.write_bytes(self.path(self._part),
                                      ("\n".join(self._lines) + "\n").encode())
        except Exception as exc:  # noqa: BLE001 (the run goes on; the next write tries again)
            if not self._write_error_logged:
                self._write_error_logged = True
                logger.warning("rank %d: timeline: cannot write goodput events to the run's "
                               "storage: %s: %s", self.rank, type(exc).__name__, exc)
            return
        finally:
            self._lines.pop()  # the heartbeat stays only in what was written
        self._last_write = now
        self._dirty = False
        header = len(self._lines[0]) + 1 if self._part == 0 and self._lines else 0
        if len(self._lines) >= PART_LINES or self._bytes + header >= PART_BYTES:
            self._part += 1
            self._lines, self._bytes = [], 0

    def path(self, part: int) -> str:
        return f"{GOODPUT_DIR}/attempt-{self.attempt or 'local'}/rank-{self.rank}.{part:04d}.jsonl"


# ---- this worker's timeline (held by the runtime) ---------------------------------------------


def active() -> Timeline | None:
    """This worker's timeline while a training function runs, else None."""
    return runtime().timeline


def report_metrics(caller: Any = None) -> dict[str, Any]:
    """``timeline/...`` metrics of the steps since ``caller``'s previous call (``metrics()`` adds them)."""
    tl = runtime().timeline
    return tl.report_metrics(caller) if tl is not None else {}


def begin() -> Timeline:
    """Start this worker's timeline (the training function's start does)."""
    rt = runtime()
    if rt.timeline is not None:
        end()
    from ray_train_xla.toolkit import steps
    from ray_train_xla.toolkit.observability import ray_metrics
    from ray_train_xla.toolkit.observability.counters import Counters
    from ray_train_xla.toolkit.run_storage import RunStorage

    ctx = rt.ctx
    storage = RunStorage.of_worker() if ctx.planned else None
    node = ""
    with contextlib.suppress(Exception):  # (outside Ray)
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    try:
        counters = Counters()
        compile_reader = counters.compiles, counters.compile_time_s
    except ImportError:  # no torch_xla here: no compile time
        compile_reader = None
    # A generation after a recovery in place is an attempt of its own, from its fault on.
    world = rt.world
    later = world.generation > 0
    tl = Timeline(
        attempt=f"{ctx.run_id}.g{world.generation}" if later else ctx.run_id, rank=ctx.rank,
        world=ctx.world_size, local_rank=ctx.local_rank, node=node, device=ctx.device or "cpu",
        group_start=world.started if later else ctx.group_start, run_start=ctx.run_start,
        recovery="in_process" if later else "", storage=storage,
        run=storage.path.rsplit("/", 1)[-1] if storage is not None else "",
        export=ray_metrics.exporter() if ctx.planned else None, compile_reader=compile_reader,
        options=lambda: rt.options(TimelineOptions), model_flops=lambda: rt.model_flops)
    steps.add_step_hook(tl.on_step)
    rt.timeline = tl
    tl.start()
    return tl


def end(failed: bool = False, error: str = "", stopped: bool = False) -> None:
    """End this worker's timeline: write its last events (the training function's end does,
    when it returns or raises, and shutdown, ``stopped``, when Ray shuts down a worker group
    whose function still runs: another worker failed, or an elastic resize)."""
    rt = runtime()
    tl, rt.timeline = rt.timeline, None
    if tl is None:
        return
    from ray_train_xla.toolkit import steps

    steps.remove_step_hook(tl.on_step)
    tl.end(failed=failed, error=error, stopped=stopped)
