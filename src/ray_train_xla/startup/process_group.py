"""Start-up step 3, on every worker: initialise torch.distributed as planned, bounded by
``timeout_s`` (the patches that follow it are ``worker_patches``).

Three steps, each reported as what it is when it fails: torch_xla's initialisation
(``import torch_xla``, which reads the planned environment, and SPMD), the rendezvous on a store
we own (``rendezvous.join``, bounded by ``timeout_s``, naming ranks that did not arrive), and the
process group itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import socket
import struct
import time
import warnings
from datetime import timedelta

from ray_train_xla.errors import WorkerSetupError, XLAInitError
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.startup import native_neuron, native_tpu, rendezvous
from ray_train_xla.startup.facts import who
from ray_train_xla.startup.watchdog import call_within
from ray_train_xla.toolkit.runtime import World, set_world

logger = logging.getLogger(__name__)


def init_process_group() -> None:
    """Initialise the default process group as planned (``TorchXLAConfig``)."""
    import torch.distributed as dist

    ctx = worker_context()
    backend, init_method = ctx.pg_backend, ctx.init_method
    timeout = timedelta(seconds=ctx.timeout_s)
    if dist.is_initialized():
        return
    xla_pg = backend == "xla" or init_method == "xla://"
    try:
        if xla_pg or ctx.spmd:
            _init_torch_xla(xla_pg, ctx.spmd)
    except Exception as exc:
        raise XLAInitError(f"{who()}: {describe_xla_init_error(exc)}") from exc
    try:
        store = rendezvous.join(ctx, timeout)
    except WorkerSetupError as exc:  # RendezvousTimeoutError, or rank 0's port taken
        raise type(exc)(f"{who()}: {exc}") from exc.__cause__
    try:
        if ctx.devmode:
            from ray_train_xla.startup import devmode

            devmode.register_backend()
        if init_method == "xla://" and rendezvous.install_for_xla_handler(store):
            call_within(
                lambda: dist.init_process_group(backend, init_method=init_method, timeout=timeout),
                time.monotonic() + timeout.total_seconds(), timeout.total_seconds(),
                "torch_xla's xla:// process-group start (the device runtime's PJRT client "
                "creation, which waits for every process of the job)",
                hint=("a process of the job did not get there, or the device runtime could not "
                      "connect the processes (TPU: every host of the slice; Neuron: "
                      "NEURON_RT_ROOT_COMM_ID)"))
            group_store = None
        else:
            group_store = _init_with_store(backend, store, ctx, timeout)
    except Exception as exc:
        listeners = (gloo_listeners(getattr(exc, "attempt_store", store), ctx.world_size)
                     if "Gloo" in str(exc) else "")
        raise WorkerSetupError(
            f"{who()}: every rank arrived at the rendezvous, then init_process_group("
            f"{backend!r}, init_method={init_method!r}) failed within timeout_s="
            f"{timeout.total_seconds():g}: {type(exc).__name__}: {exc}. If another worker failed "
            f"first, its error is the cause.{listeners}"
        ) from exc
    set_world(World(ctx.run_id, ctx.rank, ctx.world_size, store=store,
                    gloo=_published(backend, group_store, ctx.world_size)))


def start_generation(world: World) -> None:
    """Start the default process group of ``world``'s generation (a recovery in place, every
    rank after its groups of the generation before were destroyed), on the run's store, bounded
    by ``timeout_s``; the world is this worker's from then on."""
    ctx = worker_context()
    timeout = timedelta(seconds=ctx.timeout_s)
    try:
        group_store = _init_with_store(ctx.pg_backend, world.store, ctx, timeout,
                                       prefix=world.key())
    except Exception as exc:
        raise WorkerSetupError(
            f"{who()}: the process group of generation {world.generation} did not start within "
            f"timeout_s={ctx.timeout_s:g}: {type(exc).__name__}: {exc}") from exc
    set_world(dataclasses.replace(
        world, gloo=_published(ctx.pg_backend, group_store, ctx.world_size)))


def _published(backend: str, group_store, world: int) -> tuple:
    """Every rank's gloo listener of a default group of gloo, as published (recovery in place
    shuts their connections down: ``recovery.py``); () for another backend or one rank."""
    if backend != "gloo" or group_store is None or world == 1:
        return ()
    found = gloo_endpoints(group_store, world)
    return tuple(found) if all(isinstance(e, tuple) for e in found) else ()


# A gloo connection that fails at start (``connectFullMesh``) is tried again this many times.
GLOO_START_ATTEMPTS = 3


def is_gloo_connect_error(exc: BaseException) -> bool:
    """gloo could not connect a pair while creating a group: a peer's listener got a
    connection that was then closed, refused or reset (seen when a connection from another
    process reaches a listener that reuses the port its peer had)."""
    text = str(exc)
    return "Gloo connectFullMesh failed" in text or ("gloo" in text and "Connection closed by peer" in text)


def _init_with_store(backend: str, store, ctx, timeout: timedelta, prefix: str = ""):
    """``init_process_group`` on ``store``, every attempt under its own key prefix (under
    ``prefix``: the run's, by default). When gloo
    fails to connect on any rank, every rank learns it through the store, drops what it set up
    and tries again together (at most ``GLOO_START_ATTEMPTS`` times, within ``timeout``);
    any other error ends it on every rank. Returns the store the group uses."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    deadline = time.monotonic() + timeout.total_seconds()
    prefix = prefix or f"ray_train_xla/{ctx.run_id or 'run'}"
    for attempt in range(GLOO_START_ATTEMPTS):
        attempt_store = dist.PrefixStore(f"{prefix}/pg{attempt}", store)
        error = None
        if attempt:
            # A failed attempt leaves torch's group counter one up on its rank: every rank must
            # name the new default group alike (its keys in the store start with the name).
            world = distributed_c10d._world  # torch's record of its groups
            world.group_count = 0
        try:
            call_within(
                functools.partial(dist.init_process_group, backend, store=attempt_store,
                                  rank=ctx.rank, world_size=ctx.world_size, timeout=timeout),
                deadline, timeout.total_seconds(), *_what_starts(backend))
        except Exception as exc:  # noqa: BLE001 (told to every rank below, then raised)
            error = exc
        if ctx.world_size == 1:
            if error is not None:
                raise error
            return attempt_store
        outcome = "ok" if error is None else "retry" if is_gloo_connect_error(error) else "fail"
        told = f"{prefix}/pg{attempt}/outcome"
        if error is not None and (outcome == "fail" or attempt == GLOO_START_ATTEMPTS - 1):
            # Tell the others not to wait (the store may be gone with rank 0), then fail with
            # this rank's own error.
            with contextlib.suppress(Exception):
                store.set(f"{told}/{ctx.rank}", "fail")
            error.attempt_store = attempt_store  # where its gloo listeners were published
            raise error
        outcomes = _exchange(store, told, ctx.rank, ctx.world_size, outcome, deadline)
        if all(o == "ok" for o in outcomes):
            return attempt_store
        if dist.is_initialized():  # this rank's group started (or half started): drop it
            dist.destroy_process_group()
        failed = [r for r, o in enumerate(outcomes) if o != "ok"]
        if "fail" in outcomes or attempt == GLOO_START_ATTEMPTS - 1:
            raise WorkerSetupError(
                f"{who()}: the process group started here, but not on rank(s) {failed}: their "
                "error is the cause")
        logger.warning("%s: gloo could not connect rank(s) %s at process-group start (attempt "
                       "%d of %d): every rank starts the group again", who(), failed,
                       attempt + 1, GLOO_START_ATTEMPTS)


def _what_starts(backend: str) -> tuple[str, str]:
    """What ``init_process_group(backend)`` waits for, and what a wait past the deadline means,
    for the watchdog's message."""
    if backend == "neuron":
        return ("the native Neuron process group's start (ProcessGroupNeuron: the Neuron "
                "runtime's set-up and its barrier across ranks, which takes no timeout)",
                "a rank did not reach the barrier (its worker failed or is still starting), or "
                "the Neuron runtime could not connect the ranks through NEURON_RT_ROOT_COMM_ID")
    return (f"init_process_group({backend!r})",
            "a rank did not finish starting the group (its worker failed or is stuck)")


def _exchange(store, prefix: str, rank: int, world: int, value: str, deadline: float) -> list[str]:
    """Every rank's ``value`` through the store, waiting for all until ``deadline``."""
    import torch.distributed as dist

    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{r}" for r in range(world)]
    left = max(0.001, deadline - time.monotonic())
    try:
        store.wait(keys, timedelta(seconds=left))
    except (dist.DistError, RuntimeError) as exc:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise WorkerSetupError(
            f"{who()}: rank(s) {missing} did not finish starting the process group within "
            "timeout_s (they may still be connecting, or failed)") from exc
    return [store.get(k).decode() for k in keys]


def gloo_endpoints(store, world: int, group: str = "0",
                   device: str = "cpu") -> list[tuple[str, int] | str]:
    """Where each rank's gloo listener of ``group`` (the default group: "0") said it listens,
    read back from ``store`` as gloo's ``connectFullMesh`` published it: (IP, port), or why
    there is none ("none", "unreadable (...)")."""
    found: list[tuple[str, int] | str] = []
    for r in range(world):
        key = f"{group}//{device}//0/{r}"  # torch's group/device prefixes, then gloo's device 0
        try:
            if not store.check([key]):
                found.append("none")
                continue
            raw = store.get(key)
            n = struct.unpack_from("<Q", raw, 0)[0]
            size = struct.unpack_from("<Q", raw, 8 + n)[0]
            addr = raw[16 + n:16 + n + size]
            family, port = struct.unpack_from("<H", addr, 0)[0], struct.unpack_from(">H", addr, 2)[0]
            ip = (socket.inet_ntop(socket.AF_INET, addr[4:8]) if family == socket.AF_INET
                  else socket.inet_ntop(socket.AF_INET6, addr[8:24]))
            found.append((ip, port))
        except Exception as exc:  # noqa: BLE001 (a diagnostic: never hide the original error)
            found.append(f"unreadable ({type(exc).__name__})")
    return found


def gloo_listeners(store, world: int, group: str = "0", device: str = "cpu") -> str:
    """``gloo_endpoints`` for an error message: for a failed connection, whether the address a
    rank connected to is the one its peer published."""
    found = [f"rank {r}: {e[0]}:{e[1]}" if isinstance(e, tuple) else f"rank {r}: {e}"
             for r, e in enumerate(gloo_endpoints(store, world, group, device))]
    return " gloo listeners as published: " + "; ".join(found) + "."


def init_native_process_group() -> None:
    """``TorchNeuronConfig``/``TorchTPUConfig``: the native steps on Neuron or TPU, then the
    planned group (``neuron`` or ``tpu_dist``; ``gloo`` on CPU)."""
    device = worker_context().device
    if device == "neuron":
        native_neuron.before_process_group()
    elif device == "tpu":
        native_tpu.before_process_group()
    init_process_group()


def _init_torch_xla(xla_pg: bool, spmd: bool) -> None:
    """Import torch_xla (it reads the planned environment now), enable SPMD where planned, and
    register the ``xla`` backend and ``xla://`` handler."""
    import torch_xla  # noqa: F401

    if spmd:
        import torch_xla.runtime as xr

        # The plan sets XLA_USE_SPMD (read at import); use_spmd() still does what the running
        # device needs (Neuron re-initialises for SPMD) and only warns that the variable is set.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="XLA_USE_SPMD is being deprecated")
            xr.use_spmd()
    if xla_pg:
        import torch_xla.distributed.xla_backend  # noqa: F401


_VAR_NAME = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")


def describe_xla_init_error(exc: BaseException, environ=None) -> str:
    """Say that torch_xla's initialisation rejected this worker's environment, with the value of
    every variable the error names (the one at fault is among them)."""
    environ = os.environ if environ is None else environ
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch_xla":
        return f"torch_xla cannot be imported on this worker ({text}): install torch-xla there."
    named = list(dict.fromkeys(_VAR_NAME.findall(str(exc))))
    values = ", ".join(f"{k}={environ[k]!r}" if k in environ else f"{k} unset"
                       for k in named)
    where = f" Variables it names, as this worker has them: {values}." if values else ""
    return (
        f"torch_xla's initialisation failed (import torch_xla / SPMD set-up, before any "
        f"rendezvous): {text}.{where} They come from the plan (see `ray-train-xla plan`) or "
        "from TorchXLAConfig.env; a variable set before ray_train_xla applied the plan (or "
        "torch_xla imported too early) also ends here."
    )
