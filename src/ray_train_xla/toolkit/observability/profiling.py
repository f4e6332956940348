"""Profiles of every rank: a window of steps, captured on every rank, written into the run's
storage under ``profiles/<first step>/rank-<r>/`` (how to ask for one, what each stack writes:
``docs/debugging.md``).

A window comes from the config (``profile_steps=(start, count)``), the training function
(``profile_steps``, on every rank) or outside (``ray-train-xla profile`` writes a request under
``profiles/requests/``). Rank 0's ``RequestWatcher`` accepts a request with a first step a safe
margin ahead (``MIN_MARGIN_STEPS``, and ``MARGIN_S`` seconds of steps at its measured rate),
writes ``profiles/accepted/<id>.json`` and publishes the window in the process group's store,
where the other ranks' watchers wait for it. A rank that learns of a window after its first
step captures nothing and writes ``rank-<r>/missed.json``.

A window (start, count) starts its trace when step ``start - 1`` ends and stops it when step
``start + count - 1`` ends (steps counted by ``toolkit/steps.py``); outside a window the step
hook compares one integer. The traces are written on the training thread when the window ends
and uploaded in the background (:func:`flush` waits for them); each rank's directory ends with
``profile.json`` (its steps, profiler and files), written last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit import steps as _steps
from ray_train_xla.toolkit.runtime import runtime

logger = logging.getLogger(__name__)

PROFILES = "profiles"
REQUESTS = f"{PROFILES}/requests"
ACCEPTED = f"{PROFILES}/accepted"
POLL_S = 2.0  # how often rank 0 looks for requests in the run's storage
MARGIN_S = 2.0  # a request's first step is at least this many seconds of steps ahead...
MIN_MARGIN_STEPS = 5  # ... and at least this many steps
WAIT_S = 10.0  # one blocking wait of a follower's watcher on the store (then it looks again)
_NEVER = 1 << 62


@dataclass(frozen=True)
class Window:
    """Steps ``start`` .. ``start + count - 1`` (1-based: step k is the k-th step)."""

    start: int
    count: int
    source: str = "function"  # "config", "function" or the id of a request from outside

    def __post_init__(self) -> None:
        check_window(self.start, self.count)

    @property
    def begin_after(self) -> int:
        """The step at whose end the trace starts."""
        return self.start - 1

    @property
    def end_after(self) -> int:
        """The step at whose end the trace stops (the window's last step)."""
        return self.start + self.count - 1

    @property
    def steps(self) -> range:
        return range(self.start, self.start + self.count)

    def overlaps(self, other: Window) -> bool:
        return self.start <= other.end_after and other.start <= self.end_after


def check_window(start: Any, count: Any) -> None:
    for name, value in (("start", start), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"profile window {name}={value!r} is not valid: expected an int >= 1 "
                             "(steps are counted from 1)")


def margin_steps(steps_per_s: float) -> int:
    """How many steps ahead of rank 0 a window requested from outside starts."""
    return max(MIN_MARGIN_STEPS, math.ceil(max(steps_per_s, 0.0) * MARGIN_S))


def accept(request_id: str, count: int, steps_done: int, steps_per_s: float) -> Window:
    """The window rank 0 gives a request made when it had finished ``steps_done`` steps."""
    return Window(steps_done + margin_steps(steps_per_s) + 1, count, request_id)


# ---- the request protocol, on a RunStorage ------------------------------------------------------


def write_request(storage, steps: int) -> str:
    """Ask the run for a window of ``steps`` steps (from outside); returns the request's id."""
    check_window(1, steps)
    request_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    body = {"id": request_id, "steps": steps, "requested_at": time.time(),
            "by": f"{socket.gethostname()}:{os.getpid()}"}
    storage.write_bytes(f"{REQUESTS}/{request_id}.json", json.dumps(body).encode())
    return request_id


def read_json(storage, relative: str) -> dict | None:
    raw = storage.read_bytes(relative)
    return None if raw is None else json.loads(raw)


def pending_requests(storage) -> list[dict]:
    """Requests not accepted yet, oldest first."""
    requests = storage.list(REQUESTS)
    if not requests:  # (the usual answer: one listing per poll)
        return []
    accepted = {p.rsplit("/", 1)[-1] for p in storage.list(ACCEPTED)}
    out = []
    for path in requests:
        name = path.rsplit("/", 1)[-1]
        if not name.endswith(".json") or name in accepted:
            continue
        try:
            body = read_json(storage, path)
            check_window(1, body["steps"])
        except Exception as exc:  # noqa: BLE001 (a bad request is reported and set aside)
            logger.warning("profile request %s is not valid (%s): ignored", path, exc)
            storage.write_bytes(f"{ACCEPTED}/{name}", json.dumps({"error": str(exc)}).encode())
            continue
        out.append(body)
    return sorted(out, key=lambda b: b.get("requested_at", 0))


def record_accepted(storage, window: Window, world_size: int, steps_done: int) -> None:
    body = {**asdict(window), "id": window.source, "world_size": world_size,
            "accepted_at_step": steps_done, "accepted_at": time.time(),
            "directory": f"{PROFILES}/{window.start}"}
    storage.write_bytes(f"{ACCEPTED}/{window.source}.json", json.dumps(body).encode())


def wait_for_profile(storage, request_id: str, timeout_s: float, poll_s: float = 0.5) -> dict:
    """Wait until every rank's trace of an accepted request is in the storage (each rank's
    ``profile.json``, written last, or its ``missed.json``). Returns the accepted window with
    ``complete``, ``state`` and ``ranks`` (rank -> "written" or "missed")."""
    deadline = time.monotonic() + timeout_s
    out: dict = {"complete": False, "state": "not accepted by the run (is it going?)"}
    while True:
        accepted = read_json(storage, f"{ACCEPTED}/{request_id}.json")
        if accepted is not None and "error" in accepted:
            return {**out, "state": f"refused: {accepted['error']}"}
        if accepted is not None:
            window = Window(accepted["start"], accepted["count"], request_id)
            ranks = {}
            for r in range(accepted["world_size"]):
                names = {p.rsplit("/", 1)[-1] for p in storage.list(rank_dir(window, r))}
                if names & {"profile.json", "missed.json"}:
                    ranks[r] = "written" if "profile.json" in names else "missed"
            out = {**accepted, "ranks": ranks,
                   "complete": len(ranks) == accepted["world_size"],
                   "state": f"{len(ranks)} of {accepted['world_size']} ranks done"}
            if out["complete"]:
                return out
        if time.monotonic() >= deadline:
            return out
        time.sleep(poll_s)


def rank_dir(window: Window, rank: int) -> str:
    return f"{PROFILES}/{window.start}/rank-{rank}"


# ---- the profilers ------------------------------------------------------------------------------


class _StepSpans:
    """One named range per step (a subclass's ``_span_for``), opened at a step's start and
    closed at its end."""

    def _open(self, step: int) -> None:
        self._span = self._span_for(step)
        self._span.__enter__()

    def _close(self) -> None:
        self._span.__exit__(None, None, None)

    def step(self, next_step: int) -> None:
        self._close()
        self._open(next_step)


class XLATracer(_StepSpans):
    """torch_xla's in-process profiler session (started and stopped at exact steps; ``trace()``
    against its server captures a duration), one ``train_step`` event per step: it writes
    ``plugins/profile/<time>/<host>.xplane.pb`` and ``<host>.trace.json.gz``."""

    name = "torch_xla"

    def start(self, local_dir: str, first_step: int) -> None:
        import torch_xla.debug.profiler as xp

        xp.start_trace(local_dir)
        self._open(first_step)

    def _span_for(self, step: int) -> Any:
        import torch_xla

        return torch_xla._XLAC.profiler.TraceMe("train_step", step_num=step, _r=1)

    def stop(self, local_dir: str, rank: int) -> None:
        import torch_xla.debug.profiler as xp

        self._close()
        xp.stop_trace()


class TorchTracer(_StepSpans):
    """``torch.profiler``: CPU and the device's activity where torch lists it, one
    ``ProfilerStep#<k>`` range per step, a Chrome trace."""

    name = "torch.profiler"

    def start(self, local_dir: str, first_step: int) -> None:
        import torch.profiler as tp

        wanted = {tp.ProfilerActivity.CPU, getattr(tp.ProfilerActivity, "PrivateUse1", None)}
        activities = [a for a in tp.supported_activities() if a in wanted]
        self._prof = tp.profile(activities=activities)
        self._prof.start()
        self._open(first_step)

    def _span_for(self, step: int) -> Any:
        import torch.profiler as tp

        return tp.record_function(f"ProfilerStep#{step}")

    def stop(self, local_dir: str, rank: int) -> None:
        self._close()
        self._prof.stop()
        self._prof.export_chrome_trace(os.path.join(local_dir, f"rank-{rank}.pt.trace.json"))


class TorchTPUTracer(TorchTracer):
    """TorchTPU: ``torch.profiler``, with the wheel's device trace directed into the rank's
    directory (``TORCH_TPU_PROFILER_OUTPUT_DIR``, read when its profiler starts)."""

    name = "torch.profiler (torch_tpu)"

    def start(self, local_dir: str, first_step: int) -> None:
        os.environ["TORCH_TPU_PROFILER_OUTPUT_DIR"] = os.path.join(local_dir, "torch_tpu")
        super().start(local_dir, first_step)


def tracer_for_worker():
    ctx = worker_context()
    if not ctx.native:
        return XLATracer()
    return TorchTPUTracer() if ctx.device == "tpu" else TorchTracer()


# ---- the worker's windows -----------------------------------------------------------------------


class Profiles:
    """The windows of one worker and the step hook that captures them."""

    def __init__(self, rank: int, world: int, storage=None, tracer_factory=tracer_for_worker,
                 local_root: str | None = None) -> None:
        self.rank, self.world = rank, world
        self._storage, self._tracer_factory, self._local_root = storage, tracer_factory, local_root
        self._lock = threading.Lock()
        self._pending: list[Window] = []
        self._active: tuple[Window, Any, str] | None = None  # window, tracer, local dir
        self._next = _NEVER  # the step at whose end something happens
        self.done: list[Window] = []
        self.missed: list[Window] = []
        self._uploads: list[threading.Thread] = []

    @property
    def storage(self):
        """The run's storage (resolved on first use, from any thread); outside a Ray Train run,
        a local directory (``<tmp>/ray_train_xla-run``), looked up again next time."""
        if self._storage is None:
            from ray_train_xla.toolkit.run_storage import RunStorage

            self._storage = RunStorage.of_worker()
            if self._storage is None:
                return RunStorage.at(os.path.join(tempfile.gettempdir(), "ray_train_xla-run"))
        return self._storage

    def windows(self) -> list[Window]:
        """Every window of this worker: captured, running and scheduled."""
        with self._lock:
            active = [self._active[0]] if self._active else []
            return sorted(set(self.done + self.missed + active + self._pending),
                          key=lambda w: w.start)

    def add(self, window: Window, on_training_thread: bool = True) -> None:
        """Schedule ``window``. A window already past on this rank is recorded as missed (from
        another thread: also one that would start with the next step, which only the training
        thread may start); one overlapping another is refused."""
        with self._lock:
            for other in self._pending + ([self._active[0]] if self._active else []):
                if window.overlaps(other):
                    raise ValueError(f"profile window of steps {window.start}-{window.end_after} "
                                     f"overlaps the window of steps {other.start}-"
                                     f"{other.end_after}: one window at a time")
            done = _steps.steps_done()
            if window.begin_after < done or (window.begin_after == done > 0
                                             and not on_training_thread):
                self._miss(window, done)
                return
            self._pending.append(window)
            self._pending.sort(key=lambda w: w.start)
            self._reschedule()
        if window.begin_after == done and on_training_thread:  # starts with the next step
            self.on_step(done, force=True)
        # (a window of step 1 from another thread starts with the training function:
        # training_starts)

    def _reschedule(self) -> None:
        if self._active is not None:
            self._next = self._active[0].begin_after + 1  # every step of the window
        elif self._pending:
            self._next = self._pending[0].begin_after
        else:
            self._next = _NEVER

    def on_step(self, n: int, force: bool = False) -> None:
        """The step hook: step ``n`` ended."""
        if n < self._next and not force:
            return
        with self._lock:
            if self._active is not None:
                if force:  # no step ended: the running window goes on
                    return
                window, tracer, local = self._active
                if n >= window.end_after:
                    self._active = None
                    self._stop(window, tracer, local)
                else:
                    tracer.step(n + 1)
                    self._next = n + 1
                    return
            while self._pending and self._pending[0].begin_after <= n:
                window = self._pending.pop(0)
                if window.begin_after < n:
                    self._miss(window, n)
                    continue
                self._start(window)
                break
            self._reschedule()

    def _start(self, window: Window) -> None:
        local = tempfile.mkdtemp(prefix=f"ray_train_xla-profile-{window.start}-rank{self.rank}-",
                                 dir=self._local_root)
        tracer = self._tracer_factory()
        try:
            tracer.start(local, window.start)
        except Exception as exc:  # noqa: BLE001 (a profile never fails the run)
            logger.warning("rank %d: the %s profiler did not start for steps %d-%d: %s",
                           self.rank, getattr(tracer, "name", "?"), window.start,
                           window.end_after, exc)
            shutil.rmtree(local, ignore_errors=True)
            self.missed.append(window)
            return
        self._active = (window, tracer, local)
        logger.info("rank %d: profiling steps %d-%d (%s)", self.rank, window.start,
                    window.end_after, tracer.name)

    def _stop(self, window: Window, tracer, local: str) -> None:
        try:
            tracer.stop(local, self.rank)
        except Exception as exc:  # noqa: BLE001
            logger.warning("rank %d: the %s profiler failed to stop at step %d: %s", self.rank,
                           tracer.name, window.end_after, exc)
            shutil.rmtree(local, ignore_errors=True)
            self.missed.append(window)
            return
        self.done.append(window)
        thread = threading.Thread(target=self._upload, args=(window, tracer.name, local),
                                  name="ray_train_xla-profile-upload", daemon=True)
        self._uploads.append(thread)
        thread.start()

    def _upload(self, window: Window, profiler: str, local: str) -> None:
        target = rank_dir(window, self.rank)
        try:
            files = self.storage.upload_dir(local, target)
            body = {**asdict(window), "rank": self.rank, "world_size": self.world,
                    "steps": list(window.steps), "profiler": profiler, "host": socket.gethostname(),
                    "files": [f[len(target) + 1:] for f in files]}
            self.storage.write_bytes(f"{target}/profile.json", json.dumps(body).encode())
            logger.info("rank %d: profile of steps %d-%d written to %s", self.rank, window.start,
                        window.end_after, self.storage.full(target))
        except Exception as exc:  # noqa: BLE001
            logger.warning("rank %d: could not write the profile of steps %d-%d to %s: %s",
                           self.rank, window.start, window.end_after,
                           self.storage.full(target), exc)
        finally:
            shutil.rmtree(local, ignore_errors=True)

    def _miss(self, window: Window, at_step: int) -> None:
        self.missed.append(window)
        logger.warning("rank %d: the profile window of steps %d-%d reached this rank at step %d, "
                       "after its start: not captured here", self.rank, window.start,
                       window.end_after, at_step)
        with contextlib.suppress(Exception):  # (the warning above says it)
            self.storage.write_bytes(f"{rank_dir(window, self.rank)}/missed.json", json.dumps(
                {**asdict(window), "rank": self.rank, "at_step": at_step}).encode())

    def flush(self, timeout_s: float = 300.0) -> None:
        """Wait for the uploads of finished windows (the end of the training function)."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._uploads):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._uploads = [t for t in self._uploads if t.is_alive()]


# ---- requests from outside: rank 0 accepts, the others follow -----------------------------------


class RequestWatcher:
    """A daemon thread. Rank 0: looks for requests in the run's storage every ``poll_s``, accepts
    each and publishes its window under ``<prefix>/<n>`` in the store; other ranks wait for it on
    a store connection of their own. Both add the window to ``profiles``."""

    def __init__(self, profiles: Profiles, connect, prefix: str, poll_s: float = POLL_S,
                 wait_s: float = WAIT_S) -> None:
        self._profiles, self._prefix = profiles, prefix
        self._connect = connect  # () -> a store client for this thread alone
        self._poll_s, self._wait_s = poll_s, wait_s
        self._stop = threading.Event()
        self._seq = 0
        self._samples: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._run, name="ray_train_xla-profile-requests",
                                        daemon=True)

    def start(self) -> RequestWatcher:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            (self._lead if self._profiles.rank == 0 else self._follow)(self._connect())
        except Exception as exc:  # noqa: BLE001 (the store went away with the run)
            if not self._stop.is_set():
                logger.info("rank %d: profile requests from outside no longer watched: %s",
                            self._profiles.rank, exc)

    def _lead(self, store) -> None:
        # (the first look one interval in: not while the training function starts)
        while not self._stop.wait(self._poll_s):
            self._sample()
            try:
                requests = pending_requests(self._profiles.storage)
            except Exception as exc:  # noqa: BLE001 (storage briefly unavailable)
                logger.debug("profile requests not read: %s", exc)
                continue
            for request in requests:
                self.publish(store, request)

    def _sample(self) -> None:
        self._samples = (self._samples + [(time.monotonic(), _steps.steps_done())])[-2:]

    def publish(self, store, request: dict) -> Window:
        if len(self._samples) < 2:  # no rate yet: measure one over a moment
            self._sample()
            self._stop.wait(0.25)
            self._sample()
        (t0, s0), (t1, s1) = self._samples
        done = _steps.steps_done()
        window = accept(request["id"], int(request["steps"]), done,
                        (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0)
        busy = [w for w in self._profiles.windows() if w.end_after >= window.start]
        if busy:  # after the last window still to come
            window = Window(max(w.end_after for w in busy) + 1, window.count, window.source)
        record_accepted(self._profiles.storage, window, self._profiles.world, done)
        store.set(f"{self._prefix}/{self._seq}", json.dumps(asdict(window)))
        self._seq += 1
        try:
            self._profiles.add(window, on_training_thread=False)
        except ValueError as exc:  # a window the training function added meanwhile
            logger.warning("rank 0: profile window not scheduled: %s", exc)
        logger.info("rank 0: profile request %s accepted: steps %d-%d (at step %d)",
                    window.source, window.start, window.end_after, done)
        return window

    def _follow(self, store) -> None:
        from datetime import timedelta

        while not self._stop.is_set():
            key = f"{self._prefix}/{self._seq}"
            try:
                store.wait([key], timedelta(seconds=self._wait_s))
            except Exception:  # noqa: BLE001 (the wait timed out: look again)
                if self._stop.is_set():
                    return
                store.check(["ray_train_xla/alive"])  # raises once the store is gone
                continue
            body = json.loads(store.get(key))
            self._seq += 1
            try:
                self._profiles.add(Window(**body), on_training_thread=False)
            except ValueError as exc:  # overlaps a window of this rank's own
                logger.warning("rank %d: profile window from rank 0 not scheduled: %s",
                               self._profiles.rank, exc)


# ---- this worker ---------------------------------------------------------------------------------

def _store_client():
    """A connection of its own to the run's store (rank 0's ``MASTER_ADDR:MASTER_PORT``)."""
    from datetime import timedelta

    import torch.distributed as dist

    ctx = worker_context()
    return dist.TCPStore(ctx.master_addr, ctx.master_port, world_size=ctx.world_size,
                         is_master=False, timeout=timedelta(seconds=ctx.timeout_s),
                         wait_for_workers=False)


def install(watch_requests: bool = True) -> Profiles:
    """Start this worker's profiles (every rank, as the training function starts; held by the
    runtime): the config's window and the watcher of requests from outside."""
    uninstall()
    rt = runtime()
    ctx = rt.ctx
    profiles = _worker_profiles()
    if ctx.profile_steps is not None:
        try:
            profiles.add(Window(*ctx.profile_steps, "config"))
        except ValueError as exc:
            logger.warning("rank %d: profile_steps not scheduled: %s", ctx.rank, exc)
    if watch_requests and ctx.master_addr and ctx.master_port:
        rt.profile_watcher = RequestWatcher(profiles, _store_client,
                                            f"ray_train_xla/{ctx.run_id or 'run'}/profile").start()
    return profiles


def uninstall() -> None:
    rt = runtime()
    watcher, rt.profile_watcher = rt.profile_watcher, None
    if watcher is not None:
        watcher.stop()
    profiles, rt.profiles = rt.profiles, None
    if profiles is not None:
        _steps.remove_step_hook(profiles.on_step)


def _worker_profiles() -> Profiles:
    rt = runtime()
    with rt.lock:
        if rt.profiles is None:  # outside a training function (one process): no watcher
            rt.profiles = Profiles(rt.ctx.rank, rt.ctx.world_size)
            _steps.add_step_hook(rt.profiles.on_step)
        return rt.profiles


def profile_steps(start: int, count: int) -> Window:
    """Capture steps ``start`` .. ``start + count - 1`` on this rank (call it with the same values
    on every rank) into the run's storage under ``profiles/<start>/rank-<r>/``. Raises
    ValueError for a window already past, or one that overlaps another."""
    window = Window(start, count, "function")
    if window.begin_after < _steps.steps_done():
        raise ValueError(f"profile_steps({start}, {count}): step {start} has already started "
                         f"(this worker finished {_steps.steps_done()} steps)")
    _worker_profiles().add(window)
    return window


def profile_windows() -> list[Window]:
    """This worker's profile windows: captured, running and scheduled."""
    profiles = runtime().profiles
    return profiles.windows() if profiles is not None else []


def training_starts() -> None:
    """On the training thread, as the training function starts: a window of the first step
    (``profile_steps=(1, n)`` in the config) starts now."""
    profiles = runtime().profiles
    if profiles is not None:
        profiles.on_step(_steps.steps_done(), force=True)


def flush(timeout_s: float = 300.0) -> None:
    """Wait until the traces of finished windows are in the run's storage."""
    profiles = runtime().profiles
    if profiles is not None:
        profiles.flush(timeout_s)
