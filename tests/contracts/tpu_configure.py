"""Run torch_xla's own TPU topology code on planned environments.

Reads a JSON list of ``[env, local_rank, local_world_size]`` on stdin. Imports torch_xla once,
then for each case forks a fresh child whose environment is exactly ``env``, calls
``torch_xla._internal.tpu.configure_topology(local_rank, local_world_size)`` (what ``xmp.spawn``
runs per process; every value is a ``setdefault``, so what the plan set must survive it) and
reads back what torch_xla and libtpu take from the environment: the worker id and task id as
``torch_xla._internal.tpu`` reads them, the process-bounds size, the worker IPs and whether the
process is in SPMD mode. Prints a JSON list, one result per case. An environment with
``RTX_GCE_TPU_METADATA`` (JSON: the ``tpu-env`` keys and the worker ``ips``) has torch_xla read
the slice from the GCE metadata server instead of the environment, that server's answers
replaced by these.
"""

import json
import os
import sys

import torch_xla._internal.tpu as tpu
import torch_xla.runtime as xr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fork import run_forked  # noqa: E402

WATCHED = ("TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS",
           "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID", "XLA_USE_SPMD")


def _gce_metadata(metadata: dict) -> None:
    """Serve ``metadata`` as the GCE metadata server would (``tpu-env`` as YAML,
    ``worker-network-endpoints`` as ``name:uid:ip,...``): torch_xla's metadata path with only the
    HTTP read replaced."""
    endpoints = ",".join(f"w{i}:u{i}:{ip}" for i, ip in enumerate(metadata.pop("ips")))
    tpu_env = "\n".join(f"{k}: '{v}'" for k, v in metadata.items())
    tpu._get_metadata = lambda key: {"tpu-env": tpu_env,
                                     "worker-network-endpoints": endpoints}[key]


def _bounds_size():
    try:
        return tpu.process_bounds_size()
    except ValueError as exc:  # torch_xla 2.9 reads 3 entries only (MeshShape); v7 has 4
        return f"ValueError: {exc}"


def case(local_rank: int, local_world: int):
    def body() -> dict:
        metadata = os.environ.pop("RTX_GCE_TPU_METADATA", None)
        if metadata:
            _gce_metadata(json.loads(metadata))
        tpu.configure_topology(local_rank, local_world, base_port=8476)
        return {
            "env": {k: os.environ.get(k) for k in WATCHED},
            "task_id": tpu.task_id(),
            "process_bounds_size": _bounds_size(),
            "worker_ips": tpu.get_worker_ips(),
            "is_spmd": xr.is_spmd(),
        }
    return body


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    json.dump([run_forked(env, case(lr, lw)) for env, lr, lw in cases], sys.stdout)
