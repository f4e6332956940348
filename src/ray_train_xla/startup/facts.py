"""Start-up step 1, on every worker: report where this worker runs and what Ray gave it, and
take free ports on rank 0's node."""

from __future__ import annotations

import logging
import os
import socket
import threading

import ray

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.planning.topology import PRESET_VARS, WorkerFacts
from ray_train_xla.startup import netinfo

logger = logging.getLogger(__name__)

TPU_METADATA_TIMEOUT_S = 10.0


def node_ip() -> str:
    """This node's Ray address (the host name outside Ray)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests): the host name still names the machine
        return socket.gethostname()


def who() -> str:
    """This worker, named for an error message (rank, local rank, node, pid)."""
    return worker_context().who(node_ip())


def gather_facts() -> WorkerFacts:
    """Report where this worker runs and what Ray gave it."""
    ctx = ray.get_runtime_context()
    ip = ray.util.get_node_ip_address()
    accelerators = {
        name: tuple(str(i) for i in ids)
        for name, ids in ctx.get_accelerator_ids().items()
        if ids
    }
    tpu_worker_id, tpu_name, tpu_type, tpu_topology, tpu_slice_hosts = (
        tpu_host_identity() if accelerators.get("TPU") else (None, "", "", "", None))
    return WorkerFacts(
        node_id=ctx.get_node_id(),
        node_ip=ip,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        accelerator_ids=accelerators,
        pjrt_device=os.environ.get("PJRT_DEVICE", ""),
        has_efa=netinfo.has_efa(),
        network_interface=netinfo.interface_for_ip(ip) or "",
        preset_env={k: os.environ[k] for k in PRESET_VARS if os.environ.get(k)},
        tpu_worker_id=tpu_worker_id,
        tpu_name=tpu_name,
        tpu_accelerator_type=tpu_type,
        tpu_topology=tpu_topology,
        tpu_slice_hosts=tpu_slice_hosts,
    )


def tpu_host_identity() -> tuple[int | None, str, str, str, int | None]:
    """This TPU host's worker id, slice name, slice accelerator type (``v4-64``), chip topology
    (``2x4x4``) and the slice's number of hosts, read the way Ray reads them (GKE's
    ``TPU_WORKER_ID``, ``TPU_NAME``, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``, else the GCE
    metadata server), so hosts can be ordered as torch_xla numbers them, the process bounds
    follow the slice's topology and a worker group holding part of a slice is refused.
    Everything within TPU_METADATA_TIMEOUT_S, else unknown (None, "", "", "", None)."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager as tpu

    found: list = []

    def read() -> None:
        found.append((tpu.get_current_node_tpu_worker_id(), tpu.get_current_node_tpu_name() or "",
                      tpu.get_current_node_tpu_pod_type() or "",
                      tpu.get_current_node_tpu_topology() or "",
                      tpu.get_num_workers_in_current_tpu_pod()))

    # Ray's metadata requests have no timeout; off GCE and GKE they must not hold up the start.
    thread = threading.Thread(target=read, name="ray_train_xla-tpu-metadata", daemon=True)
    thread.start()
    thread.join(TPU_METADATA_TIMEOUT_S)
    if not found:
        logger.warning("pid %d: no TPU worker id, accelerator type or topology within %.0f s "
                       "(TPU_WORKER_ID, TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY or GCE metadata); hosts "
                       "are ordered as Ray orders nodes and laid out as a TPU v4 slice",
                       os.getpid(), TPU_METADATA_TIMEOUT_S)
        return None, "", "", "", None
    return found[0]


def reserve_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on this node. The first (``MASTER_PORT``) stays bound
    and listening in this worker until its rendezvous store takes the socket over
    (``rendezvous.join``), so no other process can take it in between."""
    return netinfo.free_ports(count, ipv6=":" in ray.util.get_node_ip_address(), hold=1)
