"""The workers' rendezvous, on a store we own, so that ``timeout_s`` bounds it.

torch_xla's ``xla://`` handler (``torch_xla/_internal/rendezvous.py``) builds its ``TCPStore``
with torch's default timeout (300 s) and its own choice of master (PJRT process 0), whatever
timeout ``init_process_group`` was given; the store's constructor is where a missing rank makes
the others wait. So every worker here:

1. creates the store itself: a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (served by rank 0,
   the node where those were planned), with ``timeout_s`` as its timeout;
2. checks in (``<run id>/arrived/<rank>``) and waits until every rank has, for what is left of
   ``timeout_s``; a rank that gives up names the ranks that did not check in;
3. hands the store to the process group: to torch_xla's handler for ``xla://`` (which uses a
   store already created in its module), as ``store=`` otherwise.

Worker side only (imports torch).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from ray_train_xla.errors import RendezvousTimeoutError
from ray_train_xla.planning.contract import WorkerContext

SHOWN_RANKS = 16


def join(ctx: WorkerContext, timeout: timedelta) -> Any:
    """Create or connect to the job's store and wait until every rank has arrived, all within
    ``timeout``; return the store. Raises RendezvousTimeoutError naming who did not arrive."""
    import torch.distributed as dist

    rank, world = ctx.rank, ctx.world_size
    addr, port = ctx.master_addr, ctx.master_port
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        store = dist.TCPStore(addr, port, world_size=world, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
    except (dist.DistError, RuntimeError) as exc:
        raise RendezvousTimeoutError(
            f"could not reach the rendezvous store that rank 0 serves at {addr}:{port} within "
            f"timeout_s={timeout.total_seconds():g}: rank 0 did not arrive, or {addr} is not "
            f"reachable from this node ({type(exc).__name__}: {_first_line(exc)})") from exc
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
