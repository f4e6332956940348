"""What runs around the training function on every worker: Ray Train's public
``BackendConfig.train_func_context``, which our configs return (``driver/config.py``) and Ray
Train enters in the worker's training thread around the function (V2 and V1 alike, after the
backend's ``on_training_start``).

On entry it makes the function's runtime (``toolkit/runtime.py``: the options and components of
the toolkit); with ``compile_causes=True`` it has torch_xla analyse this worker's compilations,
before the function compiles anything (``toolkit/observability/compile_causes.py``); it installs
the step count's hook on torch's optimizers (``toolkit/steps.py``), so a loop that calls a plain
``optimizer.step()`` has its steps counted (once), and starts what watches the steps (the
profile windows and their watcher of requests, ``toolkit/observability/profiling.py``; the
comparison of the ranks' compiled graphs) and the step timeline
(``toolkit/observability/timeline.py``). When the function returns, the worker waits for the memory tier's
generation in flight, for the background reporter to hand every report to Ray (raising its
error if one failed: ``toolkit/reporting.py``), then for the uploads of finished profiles;
while it waits the worker still counts as running, so Ray's controller keeps taking reports.
When the function raises, nothing is waited for: the run fails with its error, and the
timeline records the failure (for goodput). Either way the timeline's last events reach the
run's storage and the runtime is closed (torch's global hooks it added are removed).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def training_function() -> Iterator[None]:
    """Ray Train's ``train_func_context`` under TorchXLAConfig, TorchNeuronConfig and
    TorchTPUConfig (see the module docstring)."""
    from ray_train_xla.toolkit import reporting
    from ray_train_xla.toolkit.checkpoint.memory.tier import flush_memory
    from ray_train_xla.toolkit.observability import profiling

    start_function()
    try:
        yield
        flush_memory()  # the memory tier's generation in flight, complete or its error
        reporting.flush_reports()
        profiling.flush()  # the traces of finished profile windows reach the run's storage
    except BaseException as exc:
        end_function(exc)
        raise
    end_function()


def start_function() -> None:
    """A fresh runtime and what watches the steps (the training function starts, or starts
    again after a recovery in place: ``recovery.py``)."""
    from ray_train_xla.toolkit import runtime, steps
    from ray_train_xla.toolkit.observability import compile_causes, profiling, timeline

    runtime.begin()
    _optional("torch_xla's analysis of compilations is off", compile_causes.analyse_this_process)
    _optional("plain optimizer.step() calls will not be counted as steps",
              steps.install_optimizer_hook)
    _optional("profiles and graph checks are off", profiling.install, compile_causes.install)
    _optional("the step timeline did not start", timeline.begin)
    profiling.training_starts()  # a profile window of the first step starts here


def end_function(error: BaseException | None = None) -> None:
    """The training function ended (``error``: with it): its timeline's last events reach the
    run's storage and its runtime is closed."""
    from ray_train_xla.toolkit import runtime
    from ray_train_xla.toolkit.observability import timeline

    if error is None:
        timeline.end()
    else:
        timeline.end(failed=True, error=f"{type(error).__name__}: {error}")
    runtime.end()


def _optional(what: str, *starts) -> None:
    """Start something the run can go on without (observation), in steps: a failure is warned."""
    try:
        for start in starts:
            start()
    except Exception as exc:  # noqa: BLE001 (the run goes on without it)
        logger.warning("%s: %s: %s", what, type(exc).__name__, exc)
