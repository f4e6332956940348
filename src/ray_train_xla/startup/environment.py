"""Start-up step 2, on every worker: apply the planned environment, then the runtime's steps."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import ray

from ray_train_xla.errors import WorkerSetupError
from ray_train_xla.planning.contract import DEVICE_VAR, RUNTIME_VAR, reload
from ray_train_xla.planning.planner import get_runtime
from ray_train_xla.startup import runtime_steps


def planned_env(index: Mapping[str, Any]) -> dict[str, str]:
    """This worker's planned environment, fetched from this node's object (see
    ``driver.backend.distribute``)."""
    node = ray.get_runtime_context().get_node_id()
    envs = ray.get(index[node]) if node in index else {}
    env = envs.get(f"{node}/{os.getpid()}")
    if env is None:
        raise WorkerSetupError(f"pid {os.getpid()}: no environment was planned for this worker")
    return env


def apply_env(index: Mapping[str, Any]) -> None:
    """Set this worker's planned environment (refusing a torch_xla that was imported too early
    to see it), then run the runtime's start-up steps."""
    env = planned_env(index)
    runtime = get_runtime(env[DEVICE_VAR], env[RUNTIME_VAR])
    if runtime.env_read_at_import and "torch_xla" in sys.modules:
        raise WorkerSetupError(
            f"worker rank {env['RANK']} (pid {os.getpid()}): torch_xla was imported before "
            f"ray_train_xla set the {runtime.name} environment, so torch_xla would ignore it. "
            "Import torch_xla inside the training function, not in a worker setup hook or at "
            "the top of a module Ray imports when the worker starts."
        )
    os.environ.update(env)
    runtime_steps.prepare(reload())
