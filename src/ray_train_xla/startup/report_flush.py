"""The training function ends after its reports: on every worker, Ray Train's training thread
runs the training function wrapped so that, when it returns, it waits for the background
reporter (``toolkit/reporting.py``) to hand every report to Ray, and raises its error if one
failed, then for the uploads of finished profiles (``toolkit/profiling.py``). While it waits
the worker still counts as running, so Ray's controller keeps taking reports. A training
function that raises is not held (the run fails with its error).

The same wrapper starts the worker's step timeline (``toolkit/timeline.py``) with the function
and ends it when the function returns or raises (a failure, for goodput), writing its last
events into the run's storage. Around the function it also installs the step count's hook on
torch's optimizers (``toolkit/steps.py``), so a loop that calls a plain ``optimizer.step()`` has
its steps counted (once), and removes it when the function ends.

Ray Train V2 starts the function in ``ThreadRunner.run`` (``worker_group/thread_runner.py``),
after the backend's ``on_training_start``: that method is wrapped. V1 creates its session (and
the thread that will run the function) before ``on_training_start``
(``BackendExecutor.start_training``): that thread's target is wrapped before it starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ray_train_xla.startup.patching import Patches

_patches = Patches()


def _then_flush(fn: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(fn)
    def train_fn_then_flush(*args: Any, **kwargs: Any) -> Any:
        from ray_train_xla.toolkit import profiling, reporting, steps, timeline

        _hook_optimizers(steps)
        _begin_timeline(timeline)
        try:
            profiling.training_starts()  # a profile window of the first step starts here
            result = fn(*args, **kwargs)
            from ray_train_xla.toolkit.checkpoint.memory import flush_memory

            flush_memory()  # the memory tier's generation in flight, complete or its error
            reporting.flush_reports()
            profiling.flush()  # the traces of finished profile windows reach the run's storage
        except BaseException as exc:
            steps.uninstall_optimizer_hook()
            timeline.end(failed=True, error=f"{type(exc).__name__}: {exc}")
            raise
        steps.uninstall_optimizer_hook()
        timeline.end()
        return result

    return train_fn_then_flush


def _hook_optimizers(steps) -> None:
    """See plain ``optimizer.step()`` calls as step ends (the rules: ``toolkit/steps.py``)."""
    try:
        steps.install_optimizer_hook()
    except Exception as exc:  # noqa: BLE001 (the run goes on; optimizer_step/step_done still count)
        import logging

        logging.getLogger(__name__).warning("plain optimizer.step() calls will not be counted as "
                                            "steps: %s: %s", type(exc).__name__, exc)


def _begin_timeline(timeline) -> None:
    try:
        timeline.begin()
    except Exception as exc:  # noqa: BLE001 (the run goes on without its timeline)
        import logging

        logging.getLogger(__name__).warning("the step timeline did not start: %s: %s",
                                            type(exc).__name__, exc)


def install() -> None:
    """Wrap Ray Train's training-function start (idempotent)."""
    if _patches:
        return
    try:
        from ray.train.v2._internal.execution.worker_group.thread_runner import ThreadRunner
    except ImportError:
        ThreadRunner = None  # noqa: N806
    if ThreadRunner is not None:
        run = ThreadRunner.run

        def run_then_flush(self, target, *args, **kwargs):
            return run(self, _then_flush(target), *args, **kwargs)

        _patches.set(ThreadRunner, "run", run_then_flush)
    try:
        from ray.train._internal.session import get_session
    except ImportError:
        return
    session = get_session()
    thread = getattr(session, "training_thread", None)
    if thread is not None and not getattr(session, "training_started", True):
        _patches.set(thread, "_target", _then_flush(thread._target))


def uninstall() -> None:
    _patches.undo()
