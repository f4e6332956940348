"""Run torch_xla's own Neuron initialisation on planned environments.

Reads a JSON list of environments on stdin. Imports torch_xla once, then for each environment
forks a fresh child whose environment is exactly that one, calls
``torch_xla._internal.neuron.configure_pjrt_environment()`` there, and reports what the child's
environment holds afterwards (or the error). Prints a JSON list, one result per environment.
"""

import json
import os
import sys

import torch_xla._internal.neuron as neuron

WATCHED = ("NEURON_RT_VISIBLE_CORES", "NEURON_PJRT_PROCESS_INDEX", "PJRT_LOCAL_PROCESS_RANK",
           "NEURON_RT_ROOT_COMM_ID", "NEURON_PJRT_WORLD_SIZE", "PJRT_LOCAL_PROCESS_COUNT")


def run_one(env: dict) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: exactly the planned environment, then torch_xla's init
        os.close(read_fd)
        os.environ.clear()
        os.environ.update(env)
        try:
            neuron.configure_pjrt_environment()
            out = {"ok": True, "env": {k: os.environ.get(k) for k in WATCHED}}
        except Exception as exc:  # report, do not raise: the parent asserts
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        os.write(write_fd, json.dumps(out).encode())
        os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


if __name__ == "__main__":
    envs = json.load(sys.stdin)
    json.dump([run_one(env) for env in envs], sys.stdout)
