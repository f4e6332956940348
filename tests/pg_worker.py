"""One worker's ``init_process_group`` outside Ray, for the rendezvous tests.

The environment (the planned torchrun contract and ``RAY_TRAIN_XLA_*``) comes from the test.
With ``--preimport``, torch_xla is imported before the clock starts (CPU only: on Neuron the
import is what is under test). ``--native`` starts the native TorchNeuron group
(``init_native_process_group``; the torch-neuronx double must be on the path).
``--hang-in-client-creation`` makes torch_xla's PJRT client creation, as its ``xla://`` handler
reaches it (``xr.world_size()``, ``xr.process_count()``), wait forever: what it does on TPU or
Neuron while a process of the job is missing (with ``--holding-the-gil``, in a C call that keeps
Python's global lock). Prints one JSON line: whether it worked, the error
type and message, the seconds spent in ``init_process_group``, and (on success) the timeout of
the store the process group uses.
"""

import json
import sys
import time

from ray_train_xla.startup.process_group import init_native_process_group, init_process_group

if "--preimport" in sys.argv:  # CPU: take the import's time out of the measured wait
    import torch_xla  # noqa: F401
    import torch_xla.distributed.xla_backend  # noqa: F401
if "--hang-in-client-creation" in sys.argv:
    import threading

    import torch_xla.runtime as xr

    def client_never_created() -> int:
        if "--holding-the-gil" in sys.argv:  # a C call that keeps Python's lock while it waits
            import ctypes

            ctypes.PyDLL(None).sleep(3600)
        threading.Event().wait()  # a client waiting for a TPU host that never comes
        return 1

    xr.world_size = xr.process_count = client_never_created
start_group = init_process_group
if "--native" in sys.argv:
    import torch.distributed  # noqa: F401
    import torch_neuronx  # noqa: F401  (the double: its import is not what is timed)

    start_group = init_native_process_group

start = time.monotonic()
out: dict = {}
try:
    start_group()
    import torch.distributed as dist

    out.update(ok=True, world=dist.get_world_size(), rank=dist.get_rank())
    try:
        from torch_xla._internal import rendezvous as xla_rendezvous

        store = xla_rendezvous._store
        out["xla_store_timeout_s"] = store.timeout.total_seconds() if store else None
    except ImportError:
        pass
    dist.destroy_process_group()
except Exception as exc:
    out.update(ok=False, error_type=type(exc).__name__, error=str(exc))
out["elapsed_s"] = time.monotonic() - start
print(json.dumps(out), flush=True)
