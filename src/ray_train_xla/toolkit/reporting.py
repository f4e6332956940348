"""Reports off the step path: ``ray.train.report`` runs in one background thread per worker.

Ray Train takes one report from a worker each time its controller polls (every
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default) and every report is a barrier across the
ranks; a loop that calls ``ray.train.report`` itself waits for both. Here the training thread
only hands the report over and goes on:

- **checkpoints** (``save_checkpoint``): the state is copied off the device at the call (the
  snapshot), then written and reported in the background, in call order, never dropped. At most
  ``max_in_flight`` of them are held at once (2 by default): when Ray takes them more slowly than
  the loop makes them, the next call waits for a slot (backpressure, warned once), bounded by
  the run's ``timeout_s``;
- **metrics** (``report``): metrics-only reports that come faster than Ray takes them are
  coalesced: consecutive calls between two checkpoints become one report, the latest metrics,
  with ``reports_coalesced`` saying how many calls it stands for (absent when it is one).
  Rank 0 decides where a coalesced report ends (through the process group's store) and every
  rank follows, so every rank makes the same sequence of ``ray.train.report`` calls (Ray's
  barrier needs it). Rank 0's metrics are exactly those of the last call of the report; the
  other ranks send their latest. The store holds only the decisions some rank has yet to read;
- **errors**: an error in the background (a failed write, a failed report) is raised as
  :class:`ReportError` at this worker's next call and at the end of the training function;
  nothing after it is reported;
- **the end**: the training function returns only after every report it made was taken by Ray
  (the backend makes its end wait; :func:`flush_reports` does the same anywhere);
- **written once**: on Ray Train V2, a checkpoint's files are written straight into its
  directory in the run's storage (named ``checkpoint_<date>`` by rank 0, every rank following):
  on a local or shared file system with plain file writes, on remote storage (S3, GCS, any
  ``storage_filesystem``) through the storage's pyarrow filesystem; and reported with
  ``checkpoint_upload_mode=NO_UPLOAD``: Ray copies nothing. A write that fails removes that
  directory. On Ray Train V1 the files go to a temporary directory that Ray uploads.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_train_xla.errors import ReportError
from ray_train_xla.toolkit import events
from ray_train_xla.toolkit.run_storage import RunStorage
from ray_train_xla.toolkit.runtime import ReportOptions, runtime

logger = logging.getLogger(__name__)

COALESCED_KEY = "reports_coalesced"
# A wait for a slot longer than this is warned about (once per worker).
BACKPRESSURE_WARN_S = 1.0
_POLL_S = 0.5  # how often a waiting background thread looks for an abort


@dataclass
class _Checkpoint:
    metrics: dict
    write: Callable[[str, Any], dict] | None  # None: this rank reports without files
    after: Callable[[], None] | None = None  # once Ray took it
    done: threading.Event = field(default_factory=threading.Event)
    written: dict | None = None


@dataclass
class _Metrics:
    count: int  # report() calls this run stands for
    latest: dict
    frozen: bool = False  # rank 0 decided this report: later calls start the next one


class Reporter:
    """The background reporter of one worker (see the module docstring)."""

    def __init__(self, report_fn: Callable[..., None], *, rank: int, world: int,
                 max_in_flight: int, timeout_s: float, store: Any = None, key_prefix: str = "",
                 coalesce: bool = True, on_checkpoint: Callable[[], None] | None = None,
                 place: Callable[[str], tuple[str, Any]] | None = None) -> None:
        self._report_fn = report_fn
        # place: in_place_directory()'s; None: every checkpoint goes through a temporary directory
        self._place = place
        self._on_checkpoint = on_checkpoint  # called once Ray took each checkpoint
        self._rank, self._world = rank, world
        self._max, self._timeout_s = max_in_flight, timeout_s
        self._store, self._prefix, self._coalesce = store, key_prefix, coalesce
        self._cv = threading.Condition()
        self._events: collections.deque = collections.deque()
        self._checkpoints = 0  # checkpoints queued or being written/reported
        self.calls = [0, 0]  # save_checkpoint and report calls handed over (recovery compares)
        self._closing = False
        self._error: BaseException | None = None
        self._raised = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="ray_train_xla-reports", daemon=True)
        self._thread.start()

    # ---- the training thread ------------------------------------------------------------------

    def checkpoint(self, metrics: Mapping[str, Any], write: Callable[[str, Any], dict] | None,
                   wait: bool = False, after: Callable[[], None] | None = None) -> dict | None:
        """Queue a checkpoint (``write(directory, filesystem)`` writes this rank's files into
        ``directory`` on ``filesystem``, a pyarrow filesystem or None for the local file system;
        ``after()`` runs once Ray took it); ``wait``: return once reported, with what ``write``
        returned."""
        item = _Checkpoint(dict(metrics), write, after)
        with self._cv:
            self._take_slot()
            self.calls[0] += 1
            self._events.append(item)
            self._cv.notify_all()
        if wait:
            self._wait_done(item)
            return item.written
        return None

    def metrics(self, metrics: Mapping[str, Any]) -> None:
        with self._cv:
            self._raise_error()
            self.calls[1] += 1
            tail = self._events[-1] if self._events else None
            if self._coalesce and isinstance(tail, _Metrics) and not tail.frozen:
                tail.count += 1
                tail.latest = dict(metrics)
            else:
                if not self._coalesce:  # each call is its own report: bound them like checkpoints
                    self._take_slot()
                self._events.append(_Metrics(1, dict(metrics)))
            self._cv.notify_all()

    def _take_slot(self) -> None:
        """(Holding the lock) wait until fewer than ``max_in_flight`` reports are held, within
        ``timeout_s``; warn once when it took long; take the slot."""
        self._raise_error()
        start = time.monotonic()
        while self._checkpoints >= self._max and self._error is None:
            left = self._timeout_s - (time.monotonic() - start)
            if left <= 0:
                raise ReportError(
                    f"rank {self._rank}: {self._max} checkpoints are still waiting to be "
                    f"taken by Ray after timeout_s={self._timeout_s:g}; Ray Train takes one "
                    "report per controller poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S).")
            self._cv.wait(min(left, _POLL_S))
        self._raise_error()
        waited = time.monotonic() - start
        if waited > BACKPRESSURE_WARN_S and not self._warned:
            self._warned = True
            logger.warning(
                "rank %d: save_checkpoint waited %.1f s for one of its %d in-flight "
                "checkpoints to be taken by Ray. Ray Train takes one report each time its "
                "controller polls the workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by "
                "default): checkpoint less often than that, or raise max_in_flight "
                "(configure_reports) to absorb bursts.", self._rank, waited, self._max)
        self._checkpoints += 1

    def close(self, timeout_s: float | None = None) -> None:
        """Wait until every report was made, stop the thread, raise a background error."""
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        with self._cv:
            if self._thread.is_alive():
                self._error = self._error or ReportError(
                    f"rank {self._rank}: reports still in flight after {timeout_s:g} s at the end "
                    "of the training function (Ray did not take them, or rank 0 stopped "
                    "reporting)")
            self._raise_error(again=True)

    def _wait_done(self, item: _Checkpoint) -> None:
        deadline = time.monotonic() + self._timeout_s
        while not item.done.wait(_POLL_S):
            with self._cv:
                self._raise_error()
            if time.monotonic() > deadline:
                raise ReportError(f"rank {self._rank}: checkpoint not reported within "
                                  f"timeout_s={self._timeout_s:g}")
        with self._cv:  # reported: only an error of the background thread is raised now (it
            if self._error is not None:  # may have ended since, rank 0 having stopped)
                self._raise_error()

    def _raise_error(self, again: bool = False) -> None:
        if self._error is None and not self._thread.is_alive() and not self._closing:
            self._error = ReportError(
                f"rank {self._rank}: this worker's reports ended (rank 0 ended its reports: "
                "every worker must call save_checkpoint and report the same number of times)")
        if self._error is not None and (again or not self._raised):
            self._raised = True
            err = self._error
            if isinstance(err, ReportError):
                raise err
            raise ReportError(
                f"rank {self._rank}: a report failed in the background: "
                f"{type(err).__name__}: {err}. Nothing after it was reported.") from err
        if self._error is not None:  # raised once already: still refuse new work
            raise ReportError(f"rank {self._rank}: reporting stopped after an earlier error: "
                              f"{type(self._error).__name__}: {self._error}")

    # ---- the background thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            step = 0
            while True:
                decision = self._decide(step) if self._rank == 0 else self._follow(step)
                step += 1
                if decision is None:
                    return
                self._execute(decision)
        except BaseException as exc:  # noqa: BLE001 (handed to the training thread)
            with self._cv:
                self._error = self._error or exc
                self._cv.notify_all()
            logger.error("rank %d: background report failed: %s: %s", self._rank,
                         type(exc).__name__, exc)

    def _decide(self, step: int):
        """Rank 0: the next report (the head of the queue), published for the other ranks."""
        decision = self._next_in_queue(freeze=True)
        if self._agreeing:
            self._store.set(f"{self._prefix}/{step}", ":".join(map(str, decision or ("stop", 0, ""))))
        return decision

    def _new_name(self) -> str:
        """Rank 0: the directory name of the next checkpoint written in place (every rank takes
        rank 0's through the store); "" when checkpoints go through a temporary directory."""
        if self._place is None or (self._world > 1 and not self._agreeing):
            return ""
        import datetime

        # As Ray Train names the checkpoints it copies itself (checkpoint_<date>)
        return "checkpoint_" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")

    def _next_in_queue(self, freeze: bool = False):
        """The head of this rank's queue as a decision, once there is one; None when closing
        with nothing left. ``freeze``: later metrics calls start the next report."""
        with self._cv:
            while not self._events and not self._closing:
                self._cv.wait()
            if not self._events:
                return None
            head = self._events[0]
            if isinstance(head, _Checkpoint):
                return "checkpoint", 0, self._new_name() if self._rank == 0 else ""
            head.frozen = head.frozen or freeze
            return "metrics", head.count, ""

    @property
    def _agreeing(self) -> bool:
        """Whether the ranks agree on the reports through the store (else every call is its own
        report, or there is one rank)."""
        return self._store is not None and self._world > 1 and self._coalesce

    def _follow(self, step: int):
        """Other ranks: rank 0's decision for report number ``step``."""
        if not self._agreeing:
            return self._next_in_queue()  # no agreement needed: every call is its own report
        key = f"{self._prefix}/{step}"
        pause = 0.005
        # check() and a pause rather than a blocking wait: the store's client is shared with
        # the training thread, and a wait would hold it.
        while not self._store.check([key]):
            with self._cv:
                if self._error is not None:
                    return None
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        kind, count, name = self._store.get(key).decode().split(":", 2)
        self._done_reading(key)
        if kind == "stop":
            with self._cv:
                if self._events:
                    raise ReportError(
                        f"rank {self._rank}: rank 0 ended its reports, this rank has "
                        f"{len(self._events)} more: call save_checkpoint and report the same "
                        "number of times on every worker")
            return None
        return kind, int(count), name

    def _done_reading(self, key: str) -> None:
        """Count this rank in as a reader of ``key``; the last of the other ranks deletes it (and
        its count), no rank needing it any more. Barrier-free: ``add`` is atomic in the store."""
        readers = f"{key}/read"
        if self._store.add(readers, 1) == self._world - 1:
            for done in (key, readers):
                try:
                    self._store.delete_key(done)
                except (AttributeError, NotImplementedError, RuntimeError):
                    pass  # a store that cannot delete keeps them, as before

    def _execute(self, decision: tuple[str, int, str]) -> None:
        kind, count, name = decision
        deadline = time.monotonic() + self._timeout_s
        with self._cv:
            while True:  # another rank waits here until its training thread made the same call
                head = self._events[0] if self._events else None
                if kind == "checkpoint" and isinstance(head, _Checkpoint):
                    item = self._events.popleft()
                    break
                if kind == "metrics" and isinstance(head, _Metrics) and head.count >= count:
                    latest = head.latest
                    if head.count == count:
                        self._events.popleft()
                    else:  # this rank has more calls already: they start the next report
                        head.count -= count
                    if not self._coalesce:
                        self._checkpoints -= 1
                    item = None
                    break
                # Wait for this rank's training thread to make the same calls: nothing queued
                # yet, or fewer metrics calls than rank 0's so far in the last (open) run.
                behind = head is None or (kind == "metrics" and isinstance(head, _Metrics)
                                          and len(self._events) == 1)
                if not behind and self._rank != 0:
                    raise ReportError(
                        f"rank {self._rank}: its reports differ from rank 0's (rank 0 reports "
                        f"{kind}, this rank has {type(head).__name__.strip('_').lower()} next): "
                        "call save_checkpoint and report the same number of times, in the same "
                        "order, on every worker")
                if time.monotonic() > deadline:
                    raise ReportError(
                        f"rank {self._rank}: rank 0 made a {kind} report that this rank did not "
                        f"make within timeout_s={self._timeout_s:g}")
                self._cv.wait(_POLL_S)
        if item is None:
            self._report_fn({**latest, COALESCED_KEY: count} if count > 1 else dict(latest), None)
            return
        try:
            item.written = self._report_checkpoint(item, name)
            if self._on_checkpoint is not None:
                self._on_checkpoint()
            if item.after is not None:
                item.after()
        finally:
            item.done.set()
            with self._cv:
                self._checkpoints -= 1
                self._cv.notify_all()

    def _report_checkpoint(self, item: _Checkpoint, name: str) -> dict | None:
        if item.write is None:
            self._report_fn(item.metrics, None)
            return None
        if name:  # written once, in place, and reported without a copy
            directory, filesystem = self._place(name)
            try:
                written = item.write(directory, filesystem)
            except BaseException:
                _remove(directory, filesystem)  # no partial checkpoint left behind
                raise
            item.write = None
            self._report_fn(item.metrics, directory, name)
            return written
        tmp = tempfile.mkdtemp(prefix="ray-train-xla-ckpt-")
        try:
            written = item.write(tmp, None)
            item.write = None  # the snapshot can go now
            self._report_fn(item.metrics, tmp)
            return written
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- this worker's reporter (held by the runtime) ---------------------------------------------


def _ray_report(metrics: dict, directory: str | None, name: str | None = None) -> None:
    """``ray.train.report``; ``name``: ``directory`` is that checkpoint's directory in the run's
    storage, already written (reported with ``checkpoint_upload_mode=NO_UPLOAD``)."""
    import ray.train

    if name:
        from ray.train import CheckpointUploadMode

        storage = ray.train.get_context().get_storage()
        checkpoint = ray.train.Checkpoint(directory, filesystem=storage.storage_filesystem)
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        return
    checkpoint = ray.train.Checkpoint.from_directory(directory) if directory else None
    ray.train.report(metrics, checkpoint=checkpoint)


def _remove(directory: str, filesystem) -> None:
    if filesystem is None:
        shutil.rmtree(directory, ignore_errors=True)
        return
    try:
        filesystem.delete_dir(directory)
    except Exception as exc:  # noqa: BLE001 (the write's own error is the one raised)
        logger.warning("could not remove the partial checkpoint %s: %s", directory, exc)


def in_place_directory() -> Callable[[str], tuple[str, Any]] | None:
    """``name -> (directory, filesystem)`` of a checkpoint written in place in the run's storage
    (the module docstring): the filesystem is None on a file system this process can write
    (local or shared, e.g. NFS), else the storage's pyarrow filesystem. None outside Ray Train
    V2 (Ray Train V1, no run)."""
    if os.environ.get("RAY_TRAIN_V2_ENABLED", "1") == "0":
        return None
    run = RunStorage.of_worker()
    if run is None:
        return None
    import pyarrow.fs

    filesystem = run.filesystem
    local = isinstance(filesystem, pyarrow.fs.LocalFileSystem)

    def place(name: str) -> tuple[str, Any]:
        directory = run.full(name)
        if local:
            os.makedirs(directory, exist_ok=True)
            return directory, None
        filesystem.create_dir(directory, recursive=True)
        return directory, filesystem

    return place


def _default_store() -> Any:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, ValueError):
        pass
    return None


def reporter() -> Reporter:
    """This worker's reporter, started on first use (its first call is on every rank)."""
    rt = runtime()
    with rt.lock:
        if rt.reporter is None:  # a failed one stays: its error is raised at every call
            rt.reporters += 1
            ctx = rt.ctx
            world = rt.world  # its store and generation: a recovery in place starts anew
            store = (world.store or _default_store()) if ctx.world_size > 1 else None
            rt.reporter = Reporter(
                _ray_report, rank=ctx.rank, world=ctx.world_size,
                max_in_flight=rt.options(ReportOptions, capture=True).max_in_flight,
                timeout_s=ctx.timeout_s, store=store,
                key_prefix=(world.key("reports", rt.reporters) if world.run_id else
                            f"ray_train_xla/reports/{os.getpid()}/{rt.reporters}"),
                coalesce=ctx.world_size == 1 or store is not None,
                on_checkpoint=events.checkpoint_committed, place=in_place_directory())
        return rt.reporter


def configure_reports(max_in_flight: int | None = None, overlap_snapshots: bool | None = None,
                      writer_process: bool | None = None) -> None:
    """Set how many checkpoints may wait for Ray at once on this worker (each holds a host copy
    of the state; default 2); whether the snapshot of sharded (DTensor) state is copied while
    the loop goes on, the next optimizer step waiting for it (``toolkit/checkpoint/staging.py``;
    default True; False: ``save_checkpoint`` and ``keep_in_memory`` return once the copy is
    made); and whether DTensor shards and replicated state are written by a writer process
    (``toolkit/checkpoint/writer.py``; default True; False: in the background reporter's
    thread). Values left None are as they are. Call it before the first report: a value that
    differs from one set before, or from one in effect, raises ``ValueError``."""
    if max_in_flight is not None and (isinstance(max_in_flight, bool) or
                                      not isinstance(max_in_flight, int) or max_in_flight < 1):
        raise ValueError(f"configure_reports: max_in_flight={max_in_flight!r} must be an int >= 1")
    for name, value in (("overlap_snapshots", overlap_snapshots),
                        ("writer_process", writer_process)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"configure_reports: {name}={value!r} must be True or False")
    runtime().configure(ReportOptions, max_in_flight=max_in_flight,
                        overlap_snapshots=overlap_snapshots, writer_process=writer_process)


def report_options() -> ReportOptions:
    """The reports' options in effect on this worker (``configure_reports``)."""
    return runtime().options(ReportOptions)


def report(metrics: Mapping[str, Any]) -> None:
    """Report ``metrics`` without a checkpoint, without waiting (see the module docstring:
    coalesced when they come faster than Ray takes them). Call it on every worker, the same
    number of times, like ``ray.train.report``."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"report: metrics must be a dict, got {type(metrics).__name__}")
    start = time.perf_counter()
    try:
        reporter().metrics(metrics)
    finally:
        events.add_stall(time.perf_counter() - start)


def flush_reports(timeout_s: float | None = None) -> None:
    """Wait until every report this worker made was taken by Ray (bounded by ``timeout_s``,
    default the run's), then raise the first background error if there was one. The training
    function's end does it; reports after it start a new reporter."""
    rt = runtime()
    with rt.lock:
        rep, rt.reporter = rt.reporter, None
    if rep is not None:
        start = time.perf_counter()
        try:
            rep.close(timeout_s)
        finally:
            events.add_stall(time.perf_counter() - start)
