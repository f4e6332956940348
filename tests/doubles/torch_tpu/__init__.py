"""Test double of native TorchTPU (``torch-tpu`` on PyPI), whose ``tpu`` device needs a TPU.

Written from the wheel's launch and worker code (``docs/native-tpu-spec.md``; the launch half is
also checked against the real package in tests/test_native_tpu_contract.py). ``_loader.load()``
registers a ``tpu_dist`` c10d backend whose creator replays what a rank of TorchTPU does with its
environment, in order, and fails as it would:

1. reads its variables once per process (``GetEnvOnce``: later changes are not seen);
2. requires RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
   TORCH_TPU_SLICEBUILDER_ADDRESSES and TORCH_TPU_TOPOLOGY (``discovery.cc``); its own address
   is ``addresses[RANK % len]``, exactly ``host:port``, and its port (TPU_PROCESS_PORT) is bound
   for the life of the process, so two ranks given one port on a node fail;
3. takes the chip from TPU_VISIBLE_DEVICES if it is one integer, else LOCAL_RANK, and claims it
   exclusively on the node (``environment.cc``); TORCH_TPU_TOPOLOGY must be comma form with one
   chip per address; WORLD_SIZE beyond the addresses means multislice (MEGASCALE_* needed);
4. rank 0 serves the handshake on TORCH_TPU_INTERNAL_HANDSHAKE_PORT (36423 by default; a port in
   use fails), the others dial MASTER_ADDR there within TORCH_TPU_INTERNAL_HANDSHAKE_TIMEOUT_S
   (``handshake.py``);
5. refuses TORCH_TPU_DEVICES_PER_HOST (the /dev/shm store keyed by the raylet's pid).

Communication is delegated to gloo on CPU tensors. What each rank saw is written to
``$RTX_TEST_RECORD_DIR/tpu_pg_rank<r>-*.json``. After its process group, ``torch.tpu`` exists
(``current_device()`` is 0, ``set_device(i != 0)`` raises) and ``tpu`` names the PrivateUse1
device; tensors cannot live there (no kernels), so training runs on CPU tensors.
"""

from __future__ import annotations

import json
import os
import socket
import time
import types

import torch
import torch.distributed as dist

RECORD_VAR = "RTX_TEST_RECORD_DIR"
_state = {"initialized": False, "env": None, "sockets": []}
_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES",
         "MASTER_ADDR", "MASTER_PORT", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY",
         "TPU_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS", "TORCH_TPU_XPROF_SESSION_ID",
         "TORCH_TPU_INTERNAL_HANDSHAKE_PORT", "TORCH_TPU_INTERNAL_HANDSHAKE_TIMEOUT_S",
         "TORCH_TPU_DEVICES_PER_HOST", "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES",
         "MEGASCALE_SLICE_ID", "MEGASCALE_PORT", "ACCELERATE_TORCH_DEVICE")


def _env() -> dict:
    """The variables, read once per process (TorchTPU's ``GetEnvOnce``)."""
    if _state["env"] is None:
        _state["env"] = {k: os.environ.get(k) for k in _VARS}
    return _state["env"]


def _node() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return socket.gethostname()


def _claim_chip(record_dir, node: str, chip: str) -> None:
    if not record_dir:
        return
    folder = os.path.join(record_dir, "chips", node)
    os.makedirs(folder, exist_ok=True)
    try:
        fd = os.open(os.path.join(folder, chip), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        raise RuntimeError(f"TPU chip {chip} on node {node} is already in use by another "
                           "process") from None
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)


def _handshake(env: dict, rank: int, world: int) -> None:
    port = int(env["TORCH_TPU_INTERNAL_HANDSHAKE_PORT"] or 36423)
    timeout = float(env["TORCH_TPU_INTERNAL_HANDSHAKE_TIMEOUT_S"] or 60)
    if rank == 0:
        server = socket.socket()
        try:
            server.bind(("", port))
        except OSError as exc:
            server.close()
            raise RuntimeError(f"handshake port {port} is not free on rank 0's host: {exc}") from None
        server.listen(world)
        server.settimeout(timeout)
        try:
            for _ in range(world - 1):
                conn, _ = server.accept()
                conn.recv(16)
                conn.sendall(b"ok")
                conn.close()
        finally:
            server.close()
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((env["MASTER_ADDR"], port), timeout=timeout) as conn:
                conn.sendall(str(rank).encode())
                if conn.recv(2) == b"ok":
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"handshake with rank 0 at {env['MASTER_ADDR']}:{port} timed "
                                   "out") from None
            time.sleep(0.05)


def _create_process_group(store, rank: int, size: int, timeout):
    env = _env()
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                           "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY")
               if not env[k]]
    if missing:
        raise RuntimeError(f"missing required environment variables for distributed training: "
                           f"{missing}; run via torchrun")
    if env["TORCH_TPU_DEVICES_PER_HOST"]:
        raise RuntimeError("TORCH_TPU_DEVICES_PER_HOST: node-local store under /dev/shm keyed "
                           "by the parent pid (the raylet)")
    if int(env["RANK"]) != rank or int(env["WORLD_SIZE"]) != size:
        raise RuntimeError(f"RANK/WORLD_SIZE {env['RANK']}/{env['WORLD_SIZE']} differ from the "
                           f"process group's {rank}/{size}")
    addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    own = addresses[rank % len(addresses)]
    parts = own.split(":")
    if len(parts) != 2:
        raise RuntimeError(f"Invalid address format in {own} for current rank")
    process_port = int(parts[1])
    sock = socket.socket()
    try:
        sock.bind(("", process_port))  # TPU_PROCESS_PORT, held while the process lives
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"TPU_PROCESS_PORT {process_port} (from {own}) is not free: {exc}") from None
    _state["sockets"].append(sock)
    visible = env["TPU_VISIBLE_DEVICES"] or ""
    chip = visible if visible.isdigit() else env["LOCAL_RANK"]
    os.environ["TPU_VISIBLE_DEVICES"] = os.environ["TPU_VISIBLE_CHIPS"] = chip
    topology = env["TORCH_TPU_TOPOLOGY"]
    dims = topology.split(",")
    if len(dims) not in (3, 4) or not all(d.isdigit() for d in dims):
        raise RuntimeError(f"TORCH_TPU_TOPOLOGY={topology!r}: bounds must be comma-separated")
    chips = 1
    for d in dims:
        chips *= int(d)
    if chips != len(addresses):
        raise RuntimeError(f"topology {topology} has {chips} chips for {len(addresses)} processes")
    if size % len(addresses):
        raise RuntimeError(f"invalid world_size configuration: expected 1 or a multiple of "
                           f"{len(addresses)}, got {size}")
    if size > len(addresses) and not (env["MEGASCALE_COORDINATOR_ADDRESS"]
                                      and env["MEGASCALE_NUM_SLICES"]):
        raise RuntimeError("multislice without MEGASCALE_COORDINATOR_ADDRESS/_NUM_SLICES")
    node = _node()
    _claim_chip(os.environ.get(RECORD_VAR), node, chip)
    _handshake(env, rank, size)
    _state["initialized"] = True
    _register_device()
    view = {"rank": rank, "node": node, "chip": chip, "own_address": own, "pid": os.getpid(),
            "ppid": os.getppid(), "env": dict(env)}
    record_dir = os.environ.get(RECORD_VAR)
    if record_dir:
        with open(os.path.join(record_dir, f"tpu_pg_rank{rank}-{time.time_ns()}.json"), "w") as f:
            json.dump(view, f)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _set_device(device) -> None:
    index = device.index if isinstance(device, torch.device) else device
    if index not in (None, 0):
        raise RuntimeError(f"set_device({index}): every TorchTPU process uses device 0")


def _register_device() -> None:
    """``tpu`` as the PrivateUse1 name and ``torch.tpu``, once the process group exists (see the
    torch_neuronx double for why not at import)."""
    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")
        # The real package registers its C++ PrivateUse1 hooks, which torch.distributed asks for
        # the current accelerator (barrier); the double has none and its tensors are on the CPU.
        torch._C._get_accelerator = lambda: torch.device("cpu")
    torch.tpu = types.SimpleNamespace(
        current_device=lambda: 0, set_device=_set_device, synchronize=lambda *a: None,
        is_available=lambda: True, is_initialized=lambda: _state["initialized"],
        device_count=lambda: 1)


def _use_device() -> None:
    """What a tpu tensor does first: claim the chip, reading the environment (tests)."""
    _env()
    _state["initialized"] = True
    _register_device()
