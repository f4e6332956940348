"""A checkpoint before a preempted node goes away.

Ray Train V2 watches Ray's node drains (a spot reclaim, an autoscaler scale-down, or
``ray drain-node``) and reports them to the workers through ``ray.train.get_preemption_info()``;
when the drain deadline passes it restarts the run from the latest checkpoint. Calling
:func:`checkpoint_if_preempted` every step (or every few steps) saves that checkpoint in time,
so the restarted run loses no step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ray_train_xla.toolkit.checkpoint.seam import save_checkpoint
from ray_train_xla.toolkit.runtime import runtime


def checkpoint_if_preempted(
    state: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    metrics: Mapping[str, Any] | None = None,
    wait: bool = True,
):
    """Save a checkpoint the first time Ray Train reports a preemption of this run's nodes;
    return the ``ray.train.PreemptionInfo`` (None when there is none).

    Call it on every worker the same number of times (``get_preemption_info`` is a barrier
    across workers, like ``ray.train.report``). ``state`` is what ``save_checkpoint`` takes, or a
    function returning it (only called when saving). The metrics get ``preempted=1`` and the
    drain deadline (``preemption_deadline_ms``). By default the call returns once the checkpoint
was reported (``wait=True``), so it is safe before the node goes. Needs Ray Train V2.
    """
    import ray.train

    get_info = getattr(ray.train, "get_preemption_info", None)
    if get_info is None:
        raise RuntimeError("checkpoint_if_preempted needs Ray Train V2 with "
                           "ray.train.get_preemption_info (RAY_TRAIN_V2_ENABLED=1)")
    info = get_info()
    if info is None:
        return None
    key = (info.deadline_ms, tuple(info.preempted_node_ids))
    saved = runtime().preempt_saved  # the drains a checkpoint was made for
    if key not in saved:
        saved.add(key)
        saved_metrics = {**(metrics or {}), "preempted": 1,
                         "preemption_deadline_ms": info.deadline_ms or 0}
        save_checkpoint(state() if callable(state) else state, saved_metrics, wait=wait)
    return info
