"""A bound on a library call that takes no timeout and cannot be interrupted.

Some waits at start-up happen inside a library that does not honour ``timeout_s``: a
``TCPStore`` client that connected to a listener that never answers, torch_xla's PJRT client
creation (inside its ``xla://`` handler; on TPU and Neuron it waits for every process of the
job), the native Neuron process group's runtime barrier. Such a call cannot be stopped from
Python, so ``call_within`` runs it on a helper thread and the worker stops waiting for it at the
deadline: it raises an error that names what it waited for, and the helper thread is left
behind (Ray Train then ends the worker). That needs the call to release Python's global lock
while it waits, as torch's ``TCPStore`` does (measured). A call that keeps it holds every Python
thread of the worker, so a backstop outside Python (``faulthandler``'s timer) ends the process
``BACKSTOP_S`` later, after dumping every thread's stack (the stuck call among them) to its log.
The backstop is process-wide: it replaces a ``faulthandler.dump_traceback_later`` timer set
before, for the time of the call.
"""

from __future__ import annotations

import faulthandler
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ray_train_xla.errors import WorkerSetupError

T = TypeVar("T")

# Past the deadline, how long a call that honours the same deadline itself gets to raise its own
# (more precise) error before the watchdog gives up on it.
GRACE_S = 2.0
# Past that, how long the backstop waits before it ends a process whose waiting thread could not
# wake up.
BACKSTOP_S = 10.0


def call_within(fn: Callable[[], T], deadline: float, timeout_s: float, what: str, hint: str = "",
                error: type[WorkerSetupError] = WorkerSetupError, grace_s: float = GRACE_S) -> T:
    """``fn()``, or ``error`` naming ``what`` (and ``hint``: what it means, what to do) once
    ``deadline`` (``time.monotonic()``) and ``grace_s`` have passed without it returning.
    ``fn``'s own exception is raised as is."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting thread)
            outcome["error"] = exc

    start = time.monotonic()
    wait = max(0.0, deadline - time.monotonic()) + grace_s
    thread = threading.Thread(target=run, name=f"ray_train_xla-{what[:40]}", daemon=True)
    # The backstop (see the module docstring): faulthandler's own thread takes no Python lock.
    faulthandler.dump_traceback_later(wait + BACKSTOP_S, exit=True)
    try:
        thread.start()
        thread.join(wait)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if thread.is_alive():
        raise error(f"{what} did not finish within timeout_s={timeout_s:g} (waited "
                    f"{time.monotonic() - start:.1f} s); the call cannot be interrupted, so it "
                    f"is left running and this worker fails{': ' + hint if hint else ''}")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
