"""Test double of native torch-neuronx (Neuron SDK 2.30+), which cannot be installed here.

Written from the documented process-group init (``torch_neuronx/distributed/backend.py``,
``_neuron_runtime_setup``; see docs/trainium.md, native TorchNeuron). Importing it registers a
``neuron`` c10d backend whose creator replays that init on the real environment, in order:

1. asserts the Neuron runtime is not initialised yet;
2. takes the local rank from ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, else groups ranks by host
   IP through the store; sets ``NEURON_RT_VISIBLE_CORES`` to the local rank only if unset;
3. sets ``NEURON_RT_ROOT_COMM_ID`` to ``$MASTER_ADDR:<port rank 0 chose>`` only if unset (a rank
   with it preset while others lack it makes them block on the store);
4. initialises the "runtime": claims every visible core of the node exclusively (a core held by
   another process fails like ``nrt_init``), then asserts exactly one visible core;
5. waits at the runtime's barrier for every rank, without a timeout (``_nrt_barrier``);
   ``RTX_TEST_NEURON_BARRIER_HANG=1`` makes it wait forever.

Like the real package it reads its collective settings once, at import (``READ_AT_IMPORT``,
recorded with every rank's view), and with ``tests/doubles/autoload`` on the path torch imports
it at ``import torch`` through the ``torch.backends`` entry point. The actual communication is
delegated to gloo on CPU. Beyond what the real package enforces, it
checks the whole world (``world_problems``: distinct cores per node, one root comm id, not
``localhost`` on several nodes, a shared cache directory, the Accelerate device) and records what
every rank saw as ``$RTX_TEST_RECORD_DIR/neuron_pg_rank<r>.json``. ``runtime_view`` and
``world_problems`` are pure (``tests/neuron_contract.py``), so tests apply the same checks to
planned environments.
"""

from __future__ import annotations

import json
import os
import socket
import time
import types

import torch
import torch.distributed as dist

from neuron_contract import (  # tests/neuron_contract.py: the checks, also used on plans
    NOT_BEFORE,
    ONE_DEVICE,
    ROOT,
    VISIBLE,
    process_error,
    runtime_view,
    world_problems,
)

RECORD_VAR = "RTX_TEST_RECORD_DIR"
BARRIER_HANG_VAR = "RTX_TEST_NEURON_BARRIER_HANG"
_state = {"initialized": False, "device": 0, "setups": 0}

# Read once, at import, as torch_neuronx/distributed/backend.py and distributed/utils.py read
# them (the real package keeps the values it saw then; so does this record).
READ_AT_IMPORT_VARS = ("NEURON_USE_SPLIT_ALLGATHER", "NEURON_USE_SPLIT_REDUCE_SCATTER",
                       "COLLECTIVE_BUCKETSIZE_IN_MB", "COLLECTIVE_MIN_BUCKETS")
READ_AT_IMPORT = {k: os.environ.get(k) for k in READ_AT_IMPORT_VARS}


def is_neuron_runtime_initialized() -> bool:
    return _state["initialized"]


def current_device() -> int:
    return _state["device"]


def _lazy_init() -> None:
    """What any neuron tensor or ``torch.neuron`` call does first: initialise the runtime."""
    _state["initialized"] = True


def _autoload() -> None:
    """torch's ``torch.backends`` entry point: ``tests/doubles/autoload`` declares it, so a
    process with that directory on its path imports this double at ``import torch``, as torch
    autoloads the real package."""


# ---------------------------------------------------------------------------------------------
# The process group.
# ---------------------------------------------------------------------------------------------


def _node() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return socket.gethostname()


def _claim_cores(record_dir: str | None, node: str, cores: list[str]) -> None:
    """``nrt_init`` takes the visible cores exclusively; a core another process holds fails."""
    if not record_dir:
        return
    folder = os.path.join(record_dir, "cores", node)
    os.makedirs(folder, exist_ok=True)
    for core in cores:
        try:
            fd = os.open(os.path.join(folder, core), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise RuntimeError(f"Failed to initialize Neuron Runtime: status code 1 (NeuronCore "
                               f"{core} on node {node} is held by another process)") from None
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)


def _get(store, key: str) -> str:
    return store.get(key).decode()


def _create_neuron_process_group(store, rank: int, size: int, timeout):
    if _state["initialized"]:
        raise AssertionError(NOT_BEFORE)
    record_dir = os.environ.get(RECORD_VAR)
    node = _node()
    host = socket.gethostbyname(socket.gethostname())
    store.set(f"rtx_host_{rank}", host)
    hosts = [_get(store, f"rtx_host_{i}") for i in range(size)]
    root_port = 0
    if os.environ.get(ROOT) is None:
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                root_port = s.getsockname()[1]
            store.set("NEURON_RT_PORT", str(root_port))
        else:
            root_port = int(_get(store, "NEURON_RT_PORT"))
    view = runtime_view(os.environ, rank, node, [i for i, h in enumerate(hosts) if h == host],
                        root_port)
    os.environ[VISIBLE] = view["visible_cores_text"]
    os.environ[ROOT] = view["root_comm_id"]
    view.update(pid=os.getpid(), setups_before=_state["setups"], read_at_import=READ_AT_IMPORT)
    _claim_cores(record_dir, node, view["visible_cores"])
    error = process_error(view)
    if error:
        raise AssertionError(ONE_DEVICE)
    _state.update(initialized=True, device=view["local_rank"], setups=_state["setups"] + 1)
    _register_device()
    _nrt_barrier(store, rank, size)
    store.set(f"rtx_view_{rank}", json.dumps(view))
    views = [json.loads(_get(store, f"rtx_view_{i}")) for i in range(size)]
    view["problems"] = world_problems(views)
    if record_dir:
        with open(os.path.join(record_dir, f"neuron_pg_rank{rank}-{time.time_ns()}.json"), "w") as f:
            json.dump(view, f)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nrt_barrier(store, rank: int, size: int) -> None:
    """The runtime's barrier at the end of its set-up (``_nrt_barrier(0, rank, size)``): it waits
    for every rank and takes no timeout. ``RTX_TEST_NEURON_BARRIER_HANG=1`` makes it wait
    forever on this rank, as for a peer that never reaches it."""
    if os.environ.get(BARRIER_HANG_VAR) == "1":
        while True:
            time.sleep(1)
    store.add("rtx_nrt_barrier", 1)
    while store.add("rtx_nrt_barrier", 0) < size:
        time.sleep(0.05)


def _register_device() -> None:
    """The ``neuron`` device name and ``torch.neuron``. The real package does this at import;
    the double waits for its process group, because without the real C++ hooks a renamed
    PrivateUse1 breaks torch.distributed's device lookup (``barrier``) in every other process
    that autoloads it (the CPU tests)."""
    if torch._C._get_privateuse1_backend_name() != "neuron":
        torch.utils.rename_privateuse1_backend("neuron")
    torch.neuron = types.SimpleNamespace(current_device=current_device, synchronize=lambda: None,
                                         is_available=lambda: True)


dist.Backend.register_backend("neuron", _create_neuron_process_group, devices=["cpu"])
