"""Step boundaries: where the toolkit learns that one training step ended.

A step ends at ``optimizer_step(opt)`` (after its ``opt.step()`` and graph cut), at
``step_done()``, or at a plain ``optimizer.step()``: while a training function runs, torch's
global optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``)
sees every ``step()`` of the process. This is how the loops of the sharded paths (FSDP2
``opt.step()``, FSDPv2 ``opt.step(); torch_xla.sync()``), Ray's ``prepare_optimizer``,
``xm.optimizer_step``, Accelerate and Hugging Face loops are seen. Each step counts once; the
rules, in order (``docs/observability.md`` gives them with examples):

1. **The loop marks its own steps.** From the first ``step_done()`` or ``optimizer_step`` of a
   training function on, the hook counts nothing (``marked``). A ``step_done()`` right after a
   step the hook counted, with no mark in between, ends that step (``pending``), so
   ``opt.step(); step_done()`` counts one step per iteration.
2. **One lead optimizer.** Otherwise the hook counts the ``step()`` of the lead optimizer, the
   first one stepped; any other optimizer's counts nothing, unless it steps twice with no step
   of the lead in between: it becomes the lead (``others``).
3. **Not steps.** A ``step()`` that only creates an optimizer's state before a checkpoint loads
   into it (``PRIMING``), or one ``GradScaler`` skips (no ``step()``).

A hooked step ends where ``step()`` returns: before a ``torch_xla.sync()`` that follows it, whose
time (and a first compilation) then belongs to the next step.

Each end calls the hooks registered here, in order, with the number of steps this worker has
finished; the timeline, the profile windows and the recompilation check hang off this one seam.
A hook runs on the training thread at every step: it must cost microseconds (append to a buffer,
compare an integer) and hand anything slower to a background thread. The optimizer hook adds
about 1.5 us to ``step()`` (0.6 us once the loop marks its own steps); an error in it (or in a
step hook it calls) is warned once and never raised into the training step.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from ray_train_xla.errors import RecoveryError

logger = logging.getLogger(__name__)

# step() called from these only creates the optimizer's state (before a checkpoint loads into it).
PRIMING = frozenset({"_init_optim_state", "prime_optimizer"})
PRIMING_DEPTH = 8  # frames looked up from the hook (torch's step wrapper, a scheduler's, dynamo's)


class StepCounter:
    """This worker's step count, its hooks and the optimizer hook's state (held by the
    runtime: one per training function; see the module docstring)."""

    def __init__(self) -> None:
        self.steps = 0
        self.hooks: list[Callable[[int], None]] = []
        self.handle: Any = None  # torch's RemovableHandle while the optimizer hook is installed
        self.marked = False  # the loop marks its own steps (step_done / optimizer_step)
        self.pending = False  # the last step was counted by the hook and no mark came since
        self.lead: weakref.ref | None = None  # the optimizer whose step() ends a step
        self.others: set[int] = set()  # other optimizers stepped since the lead's last step
        self.warned = False
        self.guard: Callable[[], None] | None = None  # called before each count (may raise)

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()

    def count(self) -> int:
        if self.guard is not None:
            self.guard()
        self.steps += 1
        for hook in self.hooks:
            hook(self.steps)
        return self.steps


def _counter() -> StepCounter:
    from ray_train_xla.toolkit.runtime import runtime

    rt = runtime()
    counter = rt.steps  # (every step: the lock only the first time)
    return counter if counter is not None else rt.part("steps", StepCounter)


def steps_done() -> int:
    """Steps this worker has finished (``optimizer_step`` / ``step_done`` calls, and the lead
    optimizer's ``step()`` while the loop marks none itself) so far."""
    return _counter().steps


def set_guard(guard: Callable[[], None] | None) -> None:
    """Call ``guard()`` before each step is counted from now on (it may raise: a step that must
    not happen, ``startup/recovery.py``); None: no more."""
    _counter().guard = guard


def add_step_hook(hook: Callable[[int], None]) -> None:
    """Call ``hook(steps_done)`` at the end of every step from now on (once per hook)."""
    hooks = _counter().hooks
    if hook not in hooks:
        hooks.append(hook)


def remove_step_hook(hook: Callable[[int], None]) -> None:
    hooks = _counter().hooks
    if hook in hooks:
        hooks.remove(hook)


def step_done() -> int:
    """Mark the end of one training step (``optimizer_step`` calls it); returns the count.

    From the first call on, ``optimizer.step()`` ends no step by itself (the loop marks them).
    A call right after a ``step()`` that ended a step (no mark in between) ends that same step:
    it counts nothing more, so ``opt.step(); rtx.step_done()`` counts one step (see the module
    docstring)."""
    counter = _counter()
    counter.marked = True
    if counter.pending:
        counter.pending = False
        return counter.steps
    return counter.count()


def marks_own_step() -> None:
    """``optimizer_step`` is about to step its optimizer and will end the step itself: the
    optimizer hook stands down from now on."""
    _counter().marked = True


# ---- plain optimizer.step(): torch's global optimizer step post-hook --------------------------


def _is_priming() -> bool:
    frame = sys._getframe(1).f_back  # (1: the hook) its callers, up to the one of step()
    for _ in range(PRIMING_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name in PRIMING:
            return True
        frame = frame.f_back
    return False


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global post-hook: ``optimizer.step()`` returned (see the module docstring)."""
    counter = _counter()
    if counter.marked:
        return
    try:
        if _is_priming():
            return
        lead = counter.lead() if counter.lead is not None else None
        if lead is not optimizer:
            if lead is not None and id(optimizer) not in counter.others:
                counter.others.add(id(optimizer))
                return
            counter.lead = weakref.ref(optimizer)  # the first stepped, or the lead went quiet
        counter.others.clear()
        counter.pending = True
        counter.count()
    except RecoveryError:
        raise  # a step that must not happen (startup/recovery.py): the user's error
    except Exception as exc:  # noqa: BLE001 (observation never fails the user's step)
        if not counter.warned:
            counter.warned = True
            logger.warning("the step count's optimizer hook failed (warned once; the training "
                           "step goes on): %s: %s", type(exc).__name__, exc)


def install_optimizer_hook() -> bool:
    """See plain ``optimizer.step()`` calls from now on (the training function's start does):
    register torch's global optimizer post-hook for this runtime's counter and start the rules
    afresh. False when torch has no global optimizer hooks."""
    counter = _counter()
    counter.marked, counter.pending, counter.lead = False, False, None
    counter.others.clear()
    if counter.handle is not None:
        return True
    try:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:
        return False
    # Run eagerly even inside a compiled step (no graph break to trace, no warning).
    hook = torch._disable_dynamo(_after_optimizer_step) if hasattr(torch, "_disable_dynamo") \
        else _after_optimizer_step
    counter.handle = register_optimizer_step_post_hook(hook)
    return True


def uninstall_optimizer_hook() -> None:
    """Stop seeing plain ``optimizer.step()`` calls (the training function's end, shutdown)."""
    counter = _counter()
    counter.close()
    counter.lead = None
    counter.others.clear()


def optimizer_hook_installed() -> bool:
    return _counter().handle is not None


def reset() -> None:
    """Forget the count, the hooks and the optimizer hook's state (a new counter; the hook of
    the old one, if installed, is removed)."""
    from ray_train_xla.toolkit.runtime import runtime

    uninstall_optimizer_hook()
    runtime().steps = StepCounter()
