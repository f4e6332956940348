"""Recovery in place (``recovery="in_place"`` on any config, with ``memory_every``): a fault in
a live worker process costs a new process group and a restore from host memory, not a new
worker group.

``train_loop_per_worker=rtx.recoverable(train_func)`` runs ``train_func`` inside the training
function Ray Train starts (``train_function.py`` around it). When it raises on any rank:

1. that rank writes its fault (rank, step, error, time) under the next generation's keys in the
   run's store (``World``, ``toolkit/runtime.py``; the first to write is the fault's origin),
   then destroys its process groups: a peer blocked in a collective with it fails at once
   (gloo: the connection closed) and comes here with its own error, so no rank waits out
   ``timeout_s``;
2. every rank waits (``timeout_s``) until every rank wrote its fault, and all decide alike from
   what they read: go on, or fail the run. The run fails (every rank raises: the origin its
   own error, the others :class:`RecoveryError` naming it) when ``max_in_place_restarts``
   recoveries were made already, when the fault comes at the same step as the one before (the
   same memory generation restored, the same steps after it), or when the ranks handed a
   different number of reports to Ray (Ray's report barrier would hang). A rank that never
   writes (its process died) leaves the others to the timeout, or to Ray Train, which sees the
   dead worker and restarts the group (``FailureConfig``) with the memory tier's copies;
3. every rank hands its reports to Ray, ends the generation's runtime (its timeline records the
   fault, the memory tier's writer ends), starts the next generation's process group on the
   run's store, and calls ``train_func`` again in the same process: the device, the compiled
   graphs and the imports stay. ``load_checkpoint`` restores the memory tier's newest complete
   generation; a step taken before it raises :class:`RecoveryError` (the function would train
   from its initial state).

Ray Train is told nothing and starts nothing: the workers, their PIDs and their placement stay.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ray_train_xla.errors import RecoveryError
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.startup.facts import who

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def recoverable(train_func: F) -> F:
    """``train_func`` run again in this process after a fault, on every rank, when the config
    sets ``recovery="in_place"`` (see the module docstring); as it is otherwise. Pass it as
    ``TorchTrainer(train_loop_per_worker=rtx.recoverable(train_func), ...)``; the function
    must restore with ``rtx.load_checkpoint`` before its first step."""

    @functools.wraps(train_func)
    def run(*args: Any, **kwargs: Any) -> Any:
        from ray_train_xla.toolkit.runtime import runtime

        while True:
            runtime().recoverable = True  # (the runtime of this generation)
            try:
                result = train_func(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 (recovered, or raised again by recover)
                recover(exc)
                continue
            _returned()
            return result

    return run  # type: ignore[return-value]


def recover(exc: Exception) -> None:
    """Recover from ``exc`` in place on this rank (the module docstring's steps), or raise."""
    import torch.distributed as dist

    from ray_train_xla.startup import process_group, train_function
    from ray_train_xla.toolkit import runtime, steps

    ctx = worker_context()
    world = runtime.world()
    if (not ctx.in_place_restarts or isinstance(exc, RecoveryError) or world.store is None
            or not dist.is_initialized()):
        raise exc
    began = time.monotonic()
    rt = runtime.runtime()
    nxt, store = world.next(), world.store
    fault = {"rank": ctx.rank, "at": _position(rt), "error": f"{type(exc).__name__}: {exc}"[:2000],
             "t": time.time(), "calls": list(rt.reporter.calls) if rt.reporter else [0, 0]}
    try:
        fault["order"] = store.add(nxt.key("faults"), 1)
        store.set(nxt.key("fault", ctx.rank), json.dumps(fault))
    except Exception as store_error:  # the store is gone with rank 0's process
        _give_up(exc, f"the run's store cannot be reached ({type(store_error).__name__}: "
                      f"{store_error}); rank 0's process is gone")
    # What outlives the generation: its reports (handed to Ray below) and the memory tier's
    # writer (ended once the groups are gone: a generation in flight fails with them).
    reports, tier = rt.reporter, rt.memory_tier
    rt.reporter = rt.memory_tier = None
    del rt  # (it holds the generation's groups)
    train_function.end_function(exc)  # the timeline records the fault; the runtime ends
    _drop_groups(exc)
    faults = _gather(store, nxt, exc)
    origin = min(faults, key=lambda f: f["order"])
    why = decide(faults, world.faults, ctx.in_place_restarts)
    if why:
        if origin["rank"] == ctx.rank:
            exc.add_note(f"ray_train_xla: not recovered in place: {why}")
            raise exc
        raise RecoveryError(f"{who()}: not recovered in place: {why}. The fault: rank "
                            f"{origin['rank']} at {_said(origin['at'])}: {origin['error']}") from exc
    if reports is not None:
        try:
            reports.close()  # every rank hands the same reports to Ray
        except Exception as report_error:  # noqa: BLE001
            _give_up(exc, f"the reports made before the fault did not reach Ray "
                          f"({type(report_error).__name__}: {report_error})")
    if tier is not None:
        tier.end()
    nxt = nxt.after(origin)
    process_group.start_generation(nxt)
    train_function.start_function()
    steps.set_guard(_restore_first)
    logger.warning("%s: recovered in place (generation %d) from rank %d's fault at %s in %.2f s: "
                   "%s", who(), nxt.generation, origin["rank"], _said(origin["at"]),
                   time.monotonic() - began, origin["error"].splitlines()[0][:300])


def _drop_groups(exc: Exception) -> None:
    """Destroy this generation's process groups so that a peer blocked in a collective with
    this rank fails now. gloo closes a group's connections only when the group's C++ object is
    freed (``shutdown`` and ``abort`` leave them open), and FSDP2 and DTensor keep some alive
    past ``destroy_process_group``: the connections of this rank's gloo listener and to its
    peers' (as gloo published them, ``gloo_endpoints``) are shut down here, as a freed group
    would. What the failed function's frames held goes first (``traceback.clear_frames``)."""
    import gc
    import traceback

    import torch.distributed as dist

    from ray_train_xla.toolkit import runtime

    endpoints = runtime.world().gloo
    traceback.clear_frames(exc.__traceback__)
    dist.destroy_process_group()
    gc.collect()
    if endpoints:
        closed = shut_connections(endpoints, worker_context().rank)
        logger.info("%s: %d gloo connection(s) shut down", who(), closed)


def shut_connections(endpoints: tuple, rank: int) -> int:
    """Shut down this process's TCP connections of gloo: those accepted on its own listener
    (``endpoints[rank]``) and those to another rank's; returns how many."""
    import os
    import socket

    mine = endpoints[rank][1]
    peers = {(ip, port) for r, (ip, port) in enumerate(endpoints) if r != rank}
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            fds[target[8:-1]] = int(name)
    closed = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = (_endpoint(fields[1]), _endpoint(fields[2]),
                                           fields[3], fields[9])
            if state != "01" or inode not in fds or not (local[1] == mine or remote in peers):
                continue  # 01: established
            try:
                with socket.socket(fileno=os.dup(fds[inode])) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                closed += 1
            except OSError:
                pass
    return closed


def _endpoint(text: str) -> tuple[str, int]:
    """(IP, port) of a ``/proc/net/tcp`` address: hex, each 32-bit word little-endian; an
    IPv4-mapped IPv6 address as its IPv4 one."""
    import socket

    host, port = text.rsplit(":", 1)
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def decide(faults: list[dict[str, Any]], before: tuple, budget: int) -> str:
    """Why the run cannot recover in place from ``faults`` (every rank's, this generation),
    after the faults ``before`` (the origins of the earlier recoveries), "" when it can. Every
    rank decides alike: from the same records."""
    origin = min(faults, key=lambda f: f["order"])
    if len(before) >= budget:
        return (f"max_in_place_restarts={budget} recoveries in place were made already (the "
                f"faults: {', '.join(_said(f['at']) for f in before)})")
    if before and list(before[-1]["at"]) == list(origin["at"]):
        return (f"the fault repeats at {_said(origin['at'])}, where the recovery before it "
                "came from")
    calls = {tuple(f["calls"]) for f in faults}
    if len(calls) > 1:
        return ("the ranks handed different numbers of checkpoints and reports to Ray before "
                f"the fault ({sorted((f['rank'], f['calls']) for f in faults)}): Ray Train "
                "restarts the group instead (FailureConfig)")
    return ""


def _returned() -> None:
    """This rank's function returned: a rank that fails after it (after their last collective)
    learns at once that this one will not come to a recovery."""
    from ray_train_xla.toolkit.runtime import world

    current = world()
    if worker_context().in_place_restarts and current.store is not None:
        try:
            current.store.set(current.next().key("returned", current.rank), "1")
        except Exception:  # noqa: BLE001 (the store is gone: no rank is recovering)
            pass


def _position(rt) -> list[int]:
    """Where this rank is: [the memory generation it restored (-1: none), steps since]."""
    tier = rt.memory_tier
    restored = tier.restored["gen"] if tier is not None and tier.restored else -1
    return [restored, rt.steps.steps if rt.steps is not None else 0]


def _said(at) -> str:
    restored, steps = at
    return (f"step {steps}" if restored < 0 else
            f"step {steps} after memory generation {restored}")


def _gather(store, nxt, exc: Exception) -> list[dict[str, Any]]:
    """Every rank's fault of generation ``nxt`` from the store, waiting ``timeout_s``; gives
    up at once when a rank's function returned (it will not come)."""
    ctx = worker_context()
    keys = [nxt.key("fault", r) for r in range(nxt.size)]
    deadline = time.monotonic() + ctx.timeout_s
    pause = 0.005
    while True:
        missing = [r for r, k in enumerate(keys) if not _has(store, k)]
        if not missing:
            return [json.loads(store.get(k)) for k in keys]
        returned = [r for r in missing if _has(store, nxt.key("returned", r))]
        if returned:
            _give_up(exc, f"rank(s) {returned} returned from the training function before the "
                          "fault (it came after their last collective): Ray Train restarts the "
                          "group (FailureConfig)")
        if time.monotonic() > deadline:
            _give_up(exc, f"rank(s) {missing} did not come to the recovery within timeout_s="
                          f"{ctx.timeout_s:g} (their process may be gone: Ray Train then "
                          "restarts the group, FailureConfig)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001 (a store that is gone has nothing)
        return False


def _give_up(exc: Exception, why: str):
    """Raise ``exc``: recovery in place cannot go on (the whole-group restart takes over)."""
    logger.error("%s: not recovered in place: %s", who(), why)
    exc.add_note(f"ray_train_xla: not recovered in place: {why}")
    raise exc


def _restore_first() -> None:
    """A step after a recovery in place, before ``load_checkpoint``: refused."""
    raise RecoveryError(
        f"{who()}: the training function took a step after a recovery in place without "
        "restoring: call rtx.load_checkpoint(...) before the first step (it restores the "
        "memory tier's newest generation); otherwise the run would go on from its initial state")
