"""Shutdown, on every worker: end the step timeline and the toolkit's runtime of a training
function still running (its watcher of profile requests, torch's global optimizer hooks),
destroy the process group (bounded by ``timeout_s``: a dead peer must not hang it), undo the
worker-side patches, then run the device runtime's clean-up."""

from __future__ import annotations

import logging
import sys
import threading

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.startup import netinfo, runtime_steps
from ray_train_xla.startup.facts import who

logger = logging.getLogger(__name__)


def shutdown_worker() -> None:
    ctx = worker_context()
    if "ray_train_xla.toolkit.runtime" in sys.modules:  # a function still runs: Ray stops it
        from ray_train_xla.toolkit import events, runtime

        try:
            events.stopped()
        except Exception as exc:  # noqa: BLE001 (shutdown goes on)
            logger.warning("%s: the step timeline did not end: %s", who(), exc)
        runtime.end()  # its watcher of profile requests, torch's global optimizer hooks
        runtime.set_world(None)  # its store goes with the group

    def destroy() -> None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            logger.warning("%s: destroy_process_group failed: %s", who(), exc)

    thread = threading.Thread(target=destroy, name="ray_train_xla-shutdown", daemon=True)
    thread.start()
    thread.join(ctx.timeout_s)
    if thread.is_alive():
        logger.warning("%s: destroy_process_group did not finish within %.0f s; leaving it",
                       who(), ctx.timeout_s)
    netinfo.release_held()  # a port reserved for a store that never started (rank 0's worker)
    for patches in ("ray_helpers", "devmode"):  # those this worker installed
        module = sys.modules.get(f"ray_train_xla.startup.{patches}")
        if module is not None:
            module.uninstall()
    if ctx.planned:
        runtime_steps.cleanup(ctx)
