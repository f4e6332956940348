"""Run TorchTPU's own launch code on given environments; runs in the torch-tpu virtual
environment (``test_native_tpu_contract.py`` creates it), never with ray_train_xla.

Reads a JSON list of cases on stdin; each case is run in a forked child of one process that
imported ``torch_tpu`` once, because TorchTPU memoizes the environment variables it reads, per
process (the C++ ``GetEnvOnce`` behind ``torch_tpu._internal.env``). A case:

- ``kind: "launch"``: the launcher parent of one host. The environment is ``env`` alone (what a
  launcher on that host would have: ``TPU_WORKER_HOSTNAMES``, ``TORCH_TPU_TOPOLOGY``); then
  ``set_tpu_launch_env(nnodes=..., nproc_per_node=...)``; the result is the environment after.
- ``kind: "node_rank"``: ``_calculate_topological_node_rank(coords, topology, fallback)`` and
  ``_get_slice_host_coordinates(topology)``.
- ``kind: "hardware"``: devices per chip by generation (``hardware.get_devices_per_chip``), the
  v7 local topologies (``hardware._V7_TOPOLOGY``), the one-host topologies by PCI device id
  (``_TOPOLOGY_BY_TPU_PCI_DEVICE_ID``), the PCI device names and Google's vendor id, and the chips
  of a host of a multi-host slice (``distributed._CHIPS_PER_HOST``).

Only the reads of real TPU hardware are replaced: the PCI/VFIO scan of ``hardware.py``
(``_scan_pci_tpus``: the case's chip count and TPU generation) and the child-process query of the
chip coordinates (``distributed._query_local_device_coords``: the case's coordinates).
"""

import json
import os
import sys
import traceback

os.environ.setdefault("PYTHONWARNINGS", "ignore")
for name in [k for k in os.environ if k.startswith(("TPU_", "TORCH_TPU_", "MEGASCALE_"))]:
    del os.environ[name]
for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX",
             "RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(name, None)

from torch_tpu._internal.distributed import distributed  # noqa: E402
from torch_tpu._internal.utils import hardware  # noqa: E402

PCI_IDS = {"v4": "0x005e", "v5p": "0x0062", "v5e": "0x0063", "v6e": "0x006f", "v7": "0x0076"}


def hardware_facts() -> dict:
    """Devices per chip of each generation (``get_devices_per_chip`` with the PCI scan's
    generation replaced) and the v7 local topologies."""
    per_chip, original = {}, hardware.get_tpu_version
    for generation, version in (("v4", "V4"), ("v5p", "V5P"), ("v5e", "V5E"), ("v6e", "V6E"),
                                ("v7", "V7")):
        hardware.get_tpu_version = lambda v=version: hardware.TpuVersion[v]
        per_chip[generation] = hardware.get_devices_per_chip()
    hardware.get_tpu_version = original
    return {"devices_per_chip": per_chip, "v7_topology": dict(hardware._V7_TOPOLOGY),
            "topologies": {pci: dict(table)
                           for pci, table in hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID.items()},
            "pci_names": dict(hardware._PCI_DEVICE_ID_TO_NAME),
            "pci_vendor": hardware._GOOGLE_PCI_VENDOR_ID,
            "chips_per_host": list(distributed._CHIPS_PER_HOST)}


def run(case: dict) -> dict:
    if case["kind"] == "hardware":
        return hardware_facts()
    if case["kind"] == "node_rank":
        try:
            rank = distributed._calculate_topological_node_rank(
                case["coords"], case["topology"], case.get("fallback"))
        except ValueError as exc:
            rank = f"ValueError: {exc}"
        hosts = [list(h) for h in distributed._get_slice_host_coordinates(case["topology"])]
        return {"node_rank": rank, "hosts": hosts}
    table = hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID[PCI_IDS[case["generation"]]]
    hardware._scan_pci_tpus = lambda: (case["chips"], table)
    coords = case.get("coords")
    distributed._query_local_device_coords = lambda: coords
    os.environ.update(case["env"])
    before = dict(os.environ)
    distributed.set_tpu_launch_env(nnodes=case.get("nnodes"),
                                   nproc_per_node=case.get("nproc_per_node"))
    after = dict(os.environ)
    return {"set": {k: v for k, v in after.items() if before.get(k) != v},
            "env": {k: v for k, v in after.items()
                    if k.startswith(("TORCH_TPU_", "NODE_RANK", "NNODES", "MASTER_"))}}


def main() -> None:
    cases = json.load(sys.stdin)
    results = []
    for case in cases:
        if case["kind"] in ("node_rank", "hardware"):  # pure functions: no environment read
            results.append(run(case))
            continue
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a fresh process as far as TorchTPU's memoized reads go
            os.close(read)
            try:
                out = run(case)
            except Exception as exc:  # noqa: BLE001 (reported to the test)
                out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            with os.fdopen(write, "w") as f:
                json.dump(out, f)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        results.append(json.loads(text))
    print("RESULTS=" + json.dumps(results))


if __name__ == "__main__":
    main()
