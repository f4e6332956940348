"""Shutdown, on every worker: end the step timeline of a training function still running (and
remove the step count's optimizer hook), destroy the process group (bounded by ``timeout_s``: a
dead peer must not hang it), undo the worker-side patches, then run the runtime's clean-up."""

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
    if "ray_train_xla.toolkit.timeline" in sys.modules:  # the function still runs: Ray stops it
        from ray_train_xla.toolkit import timeline

        try:
            timeline.end(stopped=True)
        except Exception as exc:  # noqa: BLE001 (shutdown goes on)
            logger.warning("%s: the step timeline did not end: %s", who(), exc)

    def destroy() -> None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            logger.warning("%s: destroy_process_group failed: %s", who(), exc)

    for name in ("profiling", "compile_causes"):  # their watcher and step hooks
        module = sys.modules.get(f"ray_train_xla.toolkit.{name}")
        if module is not None:
            module.uninstall()
    steps = sys.modules.get("ray_train_xla.toolkit.steps")
    if steps is not None:  # torch's global optimizer hook, if the function still runs
        steps.uninstall_optimizer_hook()
    thread = threading.Thread(target=destroy, name="ray_train_xla-shutdown", daemon=True)
    thread.start()
    thread.join(ctx.timeout_s)
    if thread.is_alive():
        logger.warning("%s: destroy_process_group did not finish within %.0f s; leaving it",
                       who(), ctx.timeout_s)
    netinfo.release_held()  # a port reserved for a store that never started (rank 0's worker)
    if "ray_train_xla.startup.report_flush" in sys.modules:
        from ray_train_xla.startup import report_flush

        report_flush.uninstall()
    if "ray_train_xla.startup.ray_helpers" in sys.modules:
        from ray_train_xla.startup import ray_helpers

        ray_helpers.uninstall()
    if "ray_train_xla.startup.devmode" in sys.modules:
        from ray_train_xla.startup import devmode

        devmode.uninstall()
    if ctx.planned:
        runtime_steps.cleanup(ctx)
