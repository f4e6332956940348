"""The workers' rendezvous, on a store we own, so that ``timeout_s`` bounds it.

torch_xla's ``xla://`` handler (``torch_xla/_internal/rendezvous.py``) builds its ``TCPStore``
with torch's default timeout (300 s) and its own choice of master (PJRT process 0), whatever
timeout ``init_process_group`` was given; the store's constructor is where a missing rank makes
the others wait. So every worker here:

1. creates the store itself: a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (served by rank 0,
   the node where those were planned), with ``timeout_s`` as its timeout. Rank 0 serves it on
   the listening socket its worker has held since the port was reserved (``facts.reserve_ports``),
   so no other process can take the port in between; a rank 0 that does not hold it binds the
   port itself, and a port taken by another process is named as such. The other ranks' connection
   is bounded by a watchdog (``watchdog.call_within``): a ``TCPStore`` client that reached a
   listener which never answers waits forever, whatever its timeout;
2. checks in (``<run id>/arrived/<rank>``) and waits until every rank has, for what is left of
   ``timeout_s``; a rank that gives up names the ranks that did not check in;
3. hands the store to the process group: to torch_xla's handler for ``xla://`` (which uses a
   store already created in its module), as ``store=`` otherwise.

Worker side only (imports torch).
"""

from __future__ import annotations

import functools
import os
import socket
import time
from datetime import timedelta
from typing import Any

from ray_train_xla.errors import RendezvousTimeoutError, WorkerSetupError
from ray_train_xla.planning.contract import WorkerContext
from ray_train_xla.startup import netinfo
from ray_train_xla.startup.watchdog import call_within

SHOWN_RANKS = 16


def join(ctx: WorkerContext, timeout: timedelta) -> Any:
    """Create or connect to the job's store and wait until every rank has arrived, all within
    ``timeout``; return the store. Raises RendezvousTimeoutError naming who did not arrive,
    WorkerSetupError when rank 0 cannot serve the store (its port taken by another process)."""
    import torch.distributed as dist

    rank, world = ctx.rank, ctx.world_size
    addr, port = ctx.master_addr, ctx.master_port
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        store = _serve(addr, port, world, timeout, deadline)
    else:
        netinfo.release_held(port)  # this worker reserved the port, but rank 0 is another one
        store = _connect(addr, port, world, timeout, deadline)
    prefix = f"ray_train_xla/{ctx.run_id or 'run'}"
    store.set(f"{prefix}/arrived/{rank}", str(os.getpid()))
    if store.add(f"{prefix}/count", 1) == world:
        store.set(f"{prefix}/all", "1")
    left = max(0.001, deadline - time.monotonic())
    try:
        store.wait([f"{prefix}/all"], timedelta(seconds=left))
    except (dist.DistError, RuntimeError) as exc:
        try:
            missing = [r for r in range(world) if not store.check([f"{prefix}/arrived/{r}"])]
        except (dist.DistError, RuntimeError):
            missing = None  # rank 0 gave up first, and its store went with it
        if missing is None:
            who = ("rank 0, which serves the store, gave up before every rank arrived (it "
                   "arrived earlier); its error names the ranks that did not arrive")
        elif missing:
            who = (f"{_ranks_text(missing, world)} did not arrive (their workers did not start, "
                   "failed earlier, or are still busy before the process group)")
        else:
            who = "the last ranks arrived only after the deadline"
        raise RendezvousTimeoutError(
            f"rendezvous timed out after timeout_s={timeout.total_seconds():g}: {who}") from exc
    return store


# A rank 0 that does not hold its port (the worker that reserved it is another one, releasing it
# now) tries to bind it again for this long before it names the port taken.
BIND_RETRY_S = 5.0


def _serve(addr: str, port: int, world: int, timeout: timedelta, deadline: float) -> Any:
    """Rank 0's store: on the socket held since the port was reserved, else bound here."""
    import torch.distributed as dist

    fd = netinfo.take_held(port)
    if fd is not None:
        return dist.TCPStore(addr, port, world_size=world, is_master=True, timeout=timeout,
                             wait_for_workers=False, master_listen_fd=fd)
    retry_until = min(deadline, time.monotonic() + BIND_RETRY_S)
    while True:
        try:
            return dist.TCPStore(addr, port, world_size=world, is_master=True, timeout=timeout,
                                 wait_for_workers=False)
        except (dist.DistError, RuntimeError) as exc:
            taken = "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower()
            if taken and time.monotonic() < retry_until:
                time.sleep(0.2)
                continue
            why = (("another process took that port (EADDRINUSE) after it was reserved for this "
                    "run. The other ranks cannot start either. Start the run again (it reserves "
                    "a new port); if it happens again, look for a process on that node that "
                    f"binds ports it did not reserve ({_first_line(exc)})") if taken
                   else f"{type(exc).__name__}: {_first_line(exc)}")
            raise WorkerSetupError(
                f"rank 0 cannot serve the rendezvous store at {addr}:{port}: {why}") from exc


def _connect(addr: str, port: int, world: int, timeout: timedelta, deadline: float) -> Any:
    """A client of rank 0's store, bounded by ``deadline`` even when what answers at
    ``addr:port`` is not a store."""
    import torch.distributed as dist

    if not _listener_at(addr, port, deadline):
        raise RendezvousTimeoutError(
            f"could not reach the rendezvous store that rank 0 serves at {addr}:{port} within "
            f"timeout_s={timeout.total_seconds():g}: nothing accepted a connection there, so "
            f"rank 0 did not arrive, or {addr} is not reachable from this node")

    try:
        return call_within(
            functools.partial(dist.TCPStore, addr, port, world_size=world, is_master=False,
                              timeout=timeout), deadline, timeout.total_seconds(),
            f"connecting to the rendezvous store that rank 0 serves at {addr}:{port}",
            hint=("the connection was accepted but no store answered there: another process "
                  "listens on that port (rank 0 could not serve its store on it; its error says "
                  "why), or rank 0's store is stuck"),
            error=RendezvousTimeoutError)
    except (dist.DistError, RuntimeError) as exc:
        if isinstance(exc, WorkerSetupError):
            raise
        raise RendezvousTimeoutError(
            f"could not connect to the rendezvous store that rank 0 serves at {addr}:{port} "
            f"within timeout_s={timeout.total_seconds():g}: rank 0 or its store went away "
            f"({type(exc).__name__}: {_first_line(exc)})") from exc


def _listener_at(addr: str, port: int, deadline: float) -> bool:
    """True once something accepts a TCP connection at ``addr:port`` (closed at once), False
    when nothing did before ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((addr, port), timeout=min(left, 5.0)):
                return True
        except OSError:
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))

def install_for_xla_handler(store: Any) -> bool:
    """Make torch_xla's ``xla://`` handler use ``store`` instead of creating its own (it keeps
    the store in the module global ``_store``); False if this torch_xla has no such global."""
    from torch_xla._internal import rendezvous as xla_rendezvous

    if not hasattr(xla_rendezvous, "_store"):
        return False
    with xla_rendezvous._store_lock:
        xla_rendezvous._store = store
    return True


def _ranks_text(missing: list[int], world: int) -> str:
    shown = ", ".join(str(r) for r in missing[:SHOWN_RANKS])
    more = f" and {len(missing) - SHOWN_RANKS} more" if len(missing) > SHOWN_RANKS else ""
    return f"rank{'s' if len(missing) > 1 else ''} {shown}{more} (of {world})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
