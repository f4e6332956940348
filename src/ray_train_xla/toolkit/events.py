"""What the training path tells the observability modules (``toolkit/observability/``): the
toolkit's loaders, checkpoints and reports, and the worker's shutdown, call these and nothing
there. Each reaches this worker's step timeline (``observability/timeline.py``) while a training
function runs, and does nothing otherwise."""

from __future__ import annotations

from ray_train_xla.toolkit import steps
from ray_train_xla.toolkit.observability import timeline
from ray_train_xla.toolkit.runtime import runtime


def batch_handed_out(seconds: float, batch: object) -> None:
    """The training thread waited ``seconds`` for ``batch`` of the toolkit's loaders (its
    tokens and samples count in this step's model FLOPs)."""
    if (tl := runtime().timeline) is not None:
        tl.data_s += seconds
        tl.add_batch(batch)


def add_stall(seconds: float) -> None:
    """The training thread was blocked ``seconds`` in a checkpoint or report call."""
    if (tl := runtime().timeline) is not None:
        tl.stall_s += seconds


def arrived() -> None:
    """This rank reached the step's gradient synchronisation (its first collective): the
    timeline counts its own time of the step up to here (stragglers)."""
    if (tl := runtime().timeline) is not None:
        tl.arrived()


def checkpoint_saved() -> None:
    """``save_checkpoint`` returned: this step's state is on its way to storage."""
    if (tl := runtime().timeline) is not None:
        tl.checkpoint_saved(steps.steps_done())


def checkpoint_committed() -> None:
    """Ray took the oldest checkpoint in flight (the background reporter's thread)."""
    if (tl := runtime().timeline) is not None:
        tl.checkpoint_committed()


def restored(tier: str, seconds: float) -> None:
    """This worker restored its state from ``tier`` (memory or storage) in ``seconds``."""
    if (tl := runtime().timeline) is not None:
        tl.restored(tier, seconds)


def memory_kept(t: float) -> None:
    """The memory tier completed the snapshot this worker took at ``t``."""
    if (tl := runtime().timeline) is not None:
        tl.memory_kept(t)


def stopped() -> None:
    """Ray shuts the worker group down while the training function runs (another worker
    failed, or an elastic resize): the timeline writes its last events."""
    timeline.end(stopped=True)
