"""Training functions for the Neuron tests: what a worker got, checked by torch_xla's own init."""

import json
import os
import time

from conftest import write_record

NEURON_VARS = ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_ROOT_COMM_ID", "NEURON_PJRT_WORLD_SIZE",
               "NEURON_PJRT_PROCESS_INDEX", "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT",
               "NEURON_EXTRACT_GRAPHS_ONLY", "NEURON_COMPILE_CACHE_URL", "TORCHELASTIC_RUN_ID",
               "RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def neuron_env_probe(config):
    """Record the planned Neuron env and Ray's core, then run torch_xla's Neuron init on it."""
    import ray

    planned = {k: os.environ.get(k) for k in NEURON_VARS}
    ray_cores = ray.get_runtime_context().get_accelerator_ids().get("neuron_cores", [])
    import torch_xla._internal.neuron as neuron

    neuron.configure_pjrt_environment()
    import ray_train_xla as rtx

    write_record(config, f"rank{planned['RANK']}-{time.time_ns()}", {
        "graph_extraction_mark": rtx.metrics().get("xla/graph_extraction_only"),
        "node_id": ray.get_runtime_context().get_node_id(),
        "planned": planned,
        "ray_cores": list(ray_cores),
        "after_init": os.environ.get("NEURON_RT_VISIBLE_CORES"),
        "after_index": os.environ.get("NEURON_PJRT_PROCESS_INDEX"),
    })


def compile_records(record_dir):
    out = []
    for name in sorted(os.listdir(record_dir)):
        if name.startswith("compile-"):
            with open(os.path.join(record_dir, name)) as f:
                out.append(json.load(f))
    return out


def start_fake_xrt_server(config):
    """What torch_xla's XRT init does on local rank 0: start a server as a child process."""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, config["fake_server"], "120"])
    write_record(config, f"xrt-rank{os.environ['RANK']}", {
        "server": server.pid,
        "runtime": os.environ.get("RAY_TRAIN_XLA_RUNTIME"),
        "pjrt_device_planned": "PJRT_DEVICE" in os.environ,
        "group_world_size": os.environ.get("GROUP_WORLD_SIZE"),
    })


def import_torch_xla_early():
    """A worker setup hook that imports torch_xla before the backend sets the environment."""
    import torch_xla  # noqa: F401
