"""Worker-side steps of native TorchTPU: refuse a worker TorchTPU would fail on (naming the fix),
point Ray's own device helpers at the ``tpu`` device, and load ``torch_tpu`` (which registers
the ``tpu_dist`` process group) before the group is created.

TorchTPU reads its environment once per process and claims the chips on the first device use
(``torch_tpu/_internal/device/_device_module.py``, the ``GetEnvOnce`` readers of its native
code): the plan is applied before the training function, and these steps never touch the
device. Runs on the workers only; torch, Ray and torch_tpu are imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import sys

from ray_train_xla.errors import WorkerSetupError
from ray_train_xla.startup.facts import who

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install torch-tpu (Python 3.11+, torch 2.11 to 2.15, libtpu)"
# Set by TorchTPU itself on a MegaScale client; set before it starts, it disables multislice.
SKIP_MEGASCALE_VAR = "SKIP_MEGASCALE_PJRT_CLIENT"
DEVICES_PER_HOST_VAR = "TORCH_TPU_DEVICES_PER_HOST"


def check_device_untouched() -> None:
    """TorchTPU's environment is read once, at the first device use: fail first, with the fix,
    if something in this process already used the ``tpu`` device."""
    tpu = getattr(sys.modules.get("torch"), "tpu", None)
    initialized = getattr(tpu, "is_initialized", None)
    if initialized is not None and initialized():
        raise WorkerSetupError(
            f"{who()}: the TPU device was already used in this process before TorchTPUConfig "
            "set up the process group (something created a tpu tensor or called torch.tpu.* in "
            "a worker setup hook or at the import of a module Ray loads on the worker), so "
            "TorchTPU has read its environment already. Move every tpu tensor and device call "
            "inside the training function.")


def check_one_chip() -> None:
    """TorchTPU binds a process to one chip: ``TPU_VISIBLE_DEVICES`` if it is one non-negative
    integer, else ``LOCAL_RANK``; the plan sets the chip Ray assigned."""
    chip = os.environ.get("TPU_VISIBLE_DEVICES", "")
    if not chip.isdigit():
        raise WorkerSetupError(
            f"{who()}: TPU_VISIBLE_DEVICES={chip!r} is not one chip, so TorchTPU would take the "
            "chip numbered by LOCAL_RANK instead of the one Ray assigned. Request "
            "resources_per_worker={'TPU': 1} and do not set TPU_VISIBLE_DEVICES in the "
            "runtime_env.")
    if os.environ.get(DEVICES_PER_HOST_VAR):
        raise WorkerSetupError(
            f"{who()}: {DEVICES_PER_HOST_VAR}={os.environ[DEVICES_PER_HOST_VAR]!r} is set (from "
            "the runtime_env or the node): with it TorchTPU's ranks of a host share a store "
            "under /dev/shm named after their parent process, which under Ray is the raylet, "
            "the same for every run on the node. Remove it.")


def prepare_tpu_worker() -> None:
    """After the plan is applied (``on_start``): check the worker, clear what would disable
    multislice, and let Ray's ``ray.train.torch.get_device``/``prepare_model`` use the chip."""
    check_device_untouched()
    check_one_chip()
    if os.environ.get("MEGASCALE_NUM_SLICES") and os.environ.pop(SKIP_MEGASCALE_VAR, None):
        logger.warning("%s: removed %s, which would keep TorchTPU from joining the other "
                       "slices", who(), SKIP_MEGASCALE_VAR)
    install_ray_device_manager()


def install_ray_device_manager() -> None:
    """Ray 2.60 picks its ``TPUTorchDeviceManager`` (``torch.device("tpu")``) only for workers
    given the ``TPU`` resource; set it for this worker in any case (Ray caches one manager per
    process in ``_torch_device_manager``), so Ray's ``get_device`` and ``prepare_model`` use
    the chip."""
    try:
        import ray.air._internal.device_manager as dm
        from ray.air._internal.device_manager.tpu import TPUTorchDeviceManager
    except ImportError:
        return
    with dm._torch_device_manager_lock:
        dm._torch_device_manager = TPUTorchDeviceManager()


def before_process_group() -> None:
    """Load torch_tpu (``torch_tpu._loader.load()``, what Ray's own ``tpu_dist`` path calls: it
    registers the ``tpu`` device and the ``tpu_dist`` backend when a TPU is visible) and check
    the worker once more, just before the process group is created."""
    try:
        import torch_tpu._loader as loader
    except ImportError as exc:
        raise WorkerSetupError(
            f"{who()}: TorchTPUConfig(device='tpu') needs torch-tpu on every worker, but it "
            f"cannot be imported ({exc}). Install it: {INSTALL_HINT}; or use "
            "TorchTPUConfig(device='cpu') to run on CPU.") from exc
    loader.load()
    import torch.distributed as dist

    if not hasattr(dist.Backend, "TPU_DIST"):
        raise WorkerSetupError(
            f"{who()}: torch_tpu did not register the 'tpu_dist' process group: it does so only "
            "when a TPU is visible to the process (a VFIO TPU device). Check the node with "
            "`ray-train-xla doctor`.")
    check_device_untouched()
    check_one_chip()
