"""Step boundaries: where the toolkit learns that one training step ended.

``optimizer_step`` ends a step (and ``step_done`` does, for loops that step their optimizer some
other way). Each end calls the hooks registered here, in order, with the number of steps this
worker has finished; the timeline, the profile windows and the recompilation check hang off
this one seam. A hook runs on the training thread at every step: it must cost microseconds
(append to a buffer, compare an integer) and hand anything slower to a background thread.
"""

from __future__ import annotations

from collections.abc import Callable

_steps = 0
_hooks: list[Callable[[int], None]] = []


def steps_done() -> int:
    """Steps this worker has finished (``optimizer_step`` / ``step_done`` calls) so far."""
    return _steps


def add_step_hook(hook: Callable[[int], None]) -> None:
    """Call ``hook(steps_done)`` at the end of every step from now on (once per hook)."""
    if hook not in _hooks:
        _hooks.append(hook)


def remove_step_hook(hook: Callable[[int], None]) -> None:
    if hook in _hooks:
        _hooks.remove(hook)


def step_done() -> int:
    """Mark the end of one training step (``optimizer_step`` calls it); returns the count."""
    global _steps
    _steps += 1
    for hook in _hooks:
        hook(_steps)
    return _steps


def reset() -> None:
    """Forget the count and the hooks (a new training function in this process)."""
    global _steps
    _steps = 0
    _hooks.clear()
