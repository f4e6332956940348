"""One runtime per worker: the options of every toolkit component, frozen, and the components.

Ray Train enters our configs' ``train_func_context`` around the training function on every
worker (``startup/train_function.py``): it makes a fresh :class:`Runtime` for the function and
ends it when the function ends. Outside a training function (a test, a notebook, a script
without Ray) the first helper that needs one makes it. The toolkit's public helpers are thin
calls into it, and its state is nowhere else: ``tests/test_runtime.py`` scans every module for
module-level state other than this module's handle, the locks and the package's lazy exports.

Options come in one frozen block per component (``ReportOptions``, ``TimelineOptions``,
``MetricsOptions``, ``GraphCheckOptions``), made from the defaults, the config's fields that
concern a block (``peak_tflops``: the timeline's, read from the planned environment) and the
``configure_*`` calls. A call that sets a value another call or the config set differently
before, or that changes a value already in effect (its component started with it), raises
``ValueError`` naming both: it is never ignored.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ray_train_xla.planning.contract import WorkerContext, worker_context


@dataclasses.dataclass(frozen=True)
class ReportOptions:
    """``configure_reports``: how many checkpoints may wait for Ray at once, whether DTensor
    snapshots are copied while the next step runs, whether writer processes write."""

    max_in_flight: int = 2
    overlap_snapshots: bool = True
    writer_process: bool = True


@dataclasses.dataclass(frozen=True)
class TimelineOptions:
    """``configure_timeline``: what one step processes (samples, tokens, model FLOPs), the
    device's peak TFLOP/s, how often the background thread runs, the straggler threshold."""

    samples_per_step: float | None = None
    tokens_per_step: float | None = None
    flops_per_step: float | None = None
    peak_tflops: float | None = None
    interval_s: float = 5.0
    storage_interval_s: float = 30.0
    straggler_threshold: float = 0.1


@dataclasses.dataclass(frozen=True)
class MetricsOptions:
    """``metrics(warmup_steps=...)``: steps of the warm-up of ``metrics()``'s compile monitor."""

    warmup_steps: int = 3


@dataclasses.dataclass(frozen=True)
class GraphCheckOptions:
    """``check_graphs_every``: steps between two comparisons of the ranks' compiled graphs."""

    every: int = 100


Options = TypeVar("Options")
Part = TypeVar("Part")

# The fields of a block that a config field of the same name sets (the worker reads it from its
# planned environment, ``WorkerContext``).
_FROM_CONFIG = {TimelineOptions: ("peak_tflops",)}
# Which call sets each block, for the errors.
_SETTERS = {ReportOptions: "configure_reports", TimelineOptions: "configure_timeline",
            MetricsOptions: "metrics", GraphCheckOptions: "check_graphs_every"}


class Runtime:
    """This worker's toolkit state for one training function (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._options: dict[type, Any] = {}
        self._set_by: dict[tuple[type, str], Any] = {}  # (block, field) -> the value a call set
        self._config_set: set[tuple[type, str]] = set()  # of those, the ones the config set
        self._in_effect: set[type] = set()
        # The components, made on first use by their modules.
        self.reporter: Any = None  # reporting.Reporter (a new one after each flush)
        self.reporters = 0  # reporters started (every rank starts the same number)
        self.pool: Any = None  # staging.StagingPool
        self.shared_pool: Any = None  # staging.StagingPool of shared memory (replicated state)
        self.snapshots: Any = None  # staging.Snapshots
        self.save_process: Any = None  # writer.SaveProcess
        self.torch_writer: Any = None  # writer._TorchWriterProcess: torch's, once found
        self.memory_tier: Any = None  # memory.MemoryTier
        self.timeline: Any = None  # timeline.Timeline while the training function runs
        self.profiles: Any = None  # profiling.Profiles
        self.profile_watcher: Any = None  # profiling.RequestWatcher
        self.graph_check: Any = None  # compile_causes.GraphCheck (several workers)
        self.warned_one_worker_check = False  # check_graphs_every with one worker, said once
        self.debug_log: Any = None  # compile_causes.DebugLog
        self.compile_monitor: Any = None  # metrics.CompileMonitor of metrics()
        self.model_flops: Any = None  # flops.ModelFlops: the models the package prepared
        self.steps: Any = None  # steps.StepCounter
        self.host_groups: dict[str, Any] = {}  # collectives: gloo groups of the helpers
        self.host_groups_of: Any = None  # the default group they were made in
        self.group_ranks: Any = None  # collectives: (group, {global rank: group rank})
        self.preempt_saved: set[tuple] = set()  # preemption: drains a checkpoint was made for
        self.reduced: Any = None  # optim: gradients clip_grad_norm_ averaged (by parameter id)
        self.checked: Any = None  # optim: optimizers checked for sharding (weak)
        self.prepared: Any = None  # checkpoint.names.PreparedModels
        self.stack: Any = None  # stacks: this worker's Stack, for the plan it was made from
        self.meshes: dict[tuple[int, ...], Any] = {}  # fsdp2: the device mesh of each shape
        self.layout: Any = None  # parallel: the layout configure_parallelism set
        self.layout_used = False  # parallel: a helper used the layout (it may not change)
        self.layout_mesh: Any = None  # parallel: (layout, its DeviceMesh over the dimensions)
        self.layout_groups: dict[tuple, Any] = {}  # parallel: (layout, dim, host) -> group
        self.spare_buffers: list[Any] = []  # files.MemoryFiles: data buffers to reuse
        self.recoverable = False  # the function runs in rtx.recoverable (startup/recovery.py)

    def part(self, name: str, make: Callable[[], Part]) -> Part:
        """The component ``name``, made by ``make`` on its first use."""
        with self.lock:
            value = getattr(self, name)
            if value is None:
                value = make()
                setattr(self, name, value)
            return value

    @property
    def world(self) -> World:
        """The world this worker trains in now (membership and generation)."""
        return world()

    @property
    def ctx(self) -> WorkerContext:
        """The plan of this worker, as its environment says now."""
        return worker_context()

    # ---- options ------------------------------------------------------------------------------

    def options(self, block: type[Options], capture: bool = False) -> Options:
        """The options of ``block`` as they are now; ``capture``: a component keeps them from
        now on (a later change raises)."""
        with self.lock:
            if capture:
                self._in_effect.add(block)
            return self._current(block)

    def _current(self, block: type[Options]) -> Options:
        """(Holding the lock) ``block`` as set so far; at its first use, its defaults with the
        config's values, which count as set (a ``configure_*`` call may not change them)."""
        current = self._options.get(block)
        if current is None:
            planned = {name: getattr(self.ctx, name) for name in _FROM_CONFIG.get(block, ())
                       if getattr(self.ctx, name)}
            current = self._options[block] = block(**planned)
            for name, value in planned.items():
                self._set_by[(block, name)] = value
                self._config_set.add((block, name))
        return current

    def configure(self, block: type[Options], **values: Any) -> Options:
        """Set fields of ``block`` (None: left as they are). Raises ``ValueError`` when a value
        differs from one set before (by a call or the config), or from one in effect already."""
        with self.lock:
            current = self._current(block)
            changes = {k: v for k, v in values.items() if v is not None}
            for name, value in changes.items():
                before = self._set_by.get((block, name), getattr(current, name))
                was_set = (block, name) in self._set_by
                if value != before and (was_set or block in self._in_effect):
                    why = (f"the config's {name} field sets" if (block, name) in self._config_set
                           else "was set before on this worker" if was_set else
                           "is in effect already (call it before the first use)")
                    raise ValueError(f"{_SETTERS[block]}: {name}={value!r} conflicts with "
                                     f"{name}={before!r}, which {why}")
            self._set_by.update({(block, name): value for name, value in changes.items()})
            self._options[block] = dataclasses.replace(current, **changes)
            return self._options[block]

    def close(self) -> None:
        """Stop what this runtime started that would outlive it: torch's global optimizer hooks
        (the step count's, the snapshots', the parameter names'), the watcher of profile
        requests. Its timeline ends apart (how it ended is the caller's to say)."""
        watcher, self.profile_watcher = self.profile_watcher, None
        if watcher is not None:
            watcher.stop()
        for part in (self.steps, self.snapshots, self.prepared):
            if part is not None:
                part.close()


# ---- the world this worker trains in ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class World:
    """The ranks this worker trains with, as a value: the run (its plan's id), this worker's rank,
    the world's size, and the generation (0 from the backend's start; one more at each recovery
    in place, ``startup/recovery.py``); ``store`` is the run's store, where the ranks meet for
    each generation. The process group, the helpers' groups, meshes and the protocols between
    the ranks (the reporter's decisions, the memory tier's barriers) belong to one generation:
    their keys in the store start with :meth:`key`."""

    run_id: str
    rank: int
    size: int
    generation: int = 0
    store: Any = dataclasses.field(default=None, compare=False, repr=False)
    started: float = 0.0  # Unix seconds: the fault this generation recovered from (0: the first)
    faults: tuple = ()  # the faults the generations after the first recovered from, in order
    gloo: tuple = ()  # gloo's listener (IP, port) of each rank, as published (gloo groups only)

    def key(self, *parts: object) -> str:
        """A key of this generation in the store."""
        return "/".join(("ray_train_xla", self.run_id or "run", f"g{self.generation}",
                         *map(str, parts)))

    def next(self) -> World:
        """The same ranks in the next generation."""
        return dataclasses.replace(self, generation=self.generation + 1)

    def after(self, fault: dict[str, Any]) -> World:
        """This generation, started by a recovery from ``fault`` (``startup/recovery.py``)."""
        return dataclasses.replace(self, started=float(fault["t"]), faults=(*self.faults, fault))


# ---- this worker's runtime and world ----------------------------------------------------------

_lock = threading.Lock()
_current: Runtime | None = None
_world: World | None = None


def world() -> World:
    """The world this worker trains in: the one its process group started in, else (no group
    started here: a test, a single process) the plan's ranks in generation 0, without a store."""
    current = _world
    if current is None:
        ctx = worker_context()
        return World(ctx.run_id, ctx.rank, ctx.world_size)
    return current


def set_world(new: World | None) -> None:
    """The process group of ``new`` started (``startup/process_group.py``); None: it ended."""
    global _world
    with _lock:
        _world = new


def runtime() -> Runtime:
    """This worker's runtime (made on first use outside a training function)."""
    global _current
    current = _current
    if current is None:
        with _lock:
            if _current is None:
                _current = Runtime()
            current = _current
    return current


def begin() -> Runtime:
    """A fresh runtime for the training function that starts now (``train_func_context``); the
    one before, made outside a training function, is closed."""
    global _current
    with _lock:
        previous, _current = _current, Runtime()
        current = _current
    if previous is not None:
        previous.close()
    return current


def end() -> None:
    """The training function ended: close its runtime; later helpers make a new one."""
    global _current
    with _lock:
        current, _current = _current, None
    if current is not None:
        current.close()
