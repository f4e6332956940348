"""Ray's own torch helpers, and a repeated ``init_process_group``, on XLA workers.

Installed by the backend on every XLA worker (all devices), after the process group exists
(on native TorchNeuron workers on Neuron, ``install_native``: ``prepare_data_loader`` only):

- ``ray.train.torch.get_device()`` / ``get_devices()`` return the worker's XLA device (Ray's
  versions know only CUDA and CPU, so models silently trained on the CPU).
- ``ray.train.torch.prepare_model`` then moves the model to the XLA device and wraps it in DDP
  over the default process group (which carries XLA tensors); ``prepare_data_loader`` shards as
  Ray does and moves batches to the XLA device. Under SPMD both raise and name
  ``rtx.prepare_model`` / ``rtx.prepare_data_loader``.
- ``torch.distributed.init_process_group`` called again by the training function (the torchrun
  recipe ``init_process_group("xla", init_method="xla://")``) returns without doing anything when
  the call agrees with the group the backend made, instead of torch's "initialize the default
  process group twice" error.
- Hugging Face Transformers' ``Trainer``: ``TrainingArguments``' default optimizer with
  torch >= 2.8, ``optim="adamw_torch_fused"``, runs torch's fused AdamW kernel, which has no XLA
  implementation (``fused=True requires all the params to be ... of supported devices``). When
  the ``Trainer`` creates its optimizer for parameters on the XLA device, ``adamw_torch_fused``
  becomes ``adamw_torch`` (the same AdamW update, unfused), with a warning. The patch is applied
  when ``transformers.trainer`` is imported (at once if it already is), so the worker does not
  import Transformers unless the training function does.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ray_train_xla.startup.patching import Patches
from ray_train_xla.toolkit.data import move_to_device
from ray_train_xla.toolkit.device import get_device

logger = logging.getLogger(__name__)

_patches = Patches()


def get_devices() -> list[torch.device]:
    """``ray.train.torch.get_devices`` on an XLA worker: its XLA device."""
    return [get_device()]


def _spmd_refusal(name: str) -> RuntimeError:
    return RuntimeError(
        f"ray.train.torch.{name} does not apply under TorchXLAConfig(spmd=True): one process "
        f"drives all of its node's devices and XLA shards the work. Use rtx.{name} (import "
        "ray_train_xla as rtx) and rtx.shard_batch instead.")


class _OnXLADevice:
    """A prepared DataLoader whose batches are moved to the worker's device (``get_device``:
    XLA, or native ``neuron``; nested containers, namedtuples and dataclasses keep their
    type)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __iter__(self) -> Iterator[Any]:
        device = get_device()
        for batch in self._loader:
            yield move_to_device(batch, device)


HF_TRAINER_MODULE = "transformers.trainer"
FUSED_ADAMW, PLAIN_ADAMW = "adamw_torch_fused", "adamw_torch"


def _unfuse_adamw(args: Any) -> None:
    """``args.optim`` (TrainingArguments) from ``adamw_torch_fused`` to ``adamw_torch`` when the
    Trainer trains on an XLA device: torch's fused AdamW kernel has no XLA implementation."""
    optim = getattr(args, "optim", None)
    if getattr(optim, "value", optim) != FUSED_ADAMW:
        return
    if getattr(args, "use_cpu", False) or getattr(args.device, "type", "") != "xla":
        return
    args.optim = type(optim)(PLAIN_ADAMW) if not isinstance(optim, str) else PLAIN_ADAMW
    logger.warning(
        'Trainer on %s: TrainingArguments(optim="%s") (the default with torch >= 2.8) runs '
        'torch\'s fused AdamW, which has no XLA kernel; using optim="%s" (the same update, '
        "unfused). Pass optim=\"%s\" to silence this.", args.device, FUSED_ADAMW, PLAIN_ADAMW,
        PLAIN_ADAMW)


def _patch_trainer(module: Any) -> None:
    """Make ``module.Trainer.create_optimizer`` (``transformers.trainer``) unfuse AdamW first."""
    trainer = getattr(module, "Trainer", None)
    original = getattr(trainer, "create_optimizer", None)
    if original is None:
        return

    def create_optimizer(self, *args: Any, **kwargs: Any):
        _unfuse_adamw(self.args)
        return original(self, *args, **kwargs)

    create_optimizer.__doc__ = original.__doc__
    _patches.set(trainer, "create_optimizer", create_optimizer)


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs ``then(module)`` right after the module ``name`` is first imported (found by the
    other finders, loaded by its own loader)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then, self._loader = name, then, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if hasattr(spec.loader, "exec_module"):
                    self._loader, spec.loader = spec.loader, self
                return spec
        return None

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.then(module)


_watchers: list[_PatchAfterImport] = []


def patch_transformers_trainer() -> None:
    """Unfuse Transformers' default AdamW on XLA (see the module docstring): now if
    ``transformers.trainer`` is imported, else when it is."""
    if HF_TRAINER_MODULE in sys.modules:
        _patch_trainer(sys.modules[HF_TRAINER_MODULE])
    elif not _watchers:
        _watchers.append(_PatchAfterImport(HF_TRAINER_MODULE, _patch_trainer))
        sys.meta_path.insert(0, _watchers[0])


def _prepare_data_loader_moving_here(original, spmd: bool = False):
    """Ray's ``prepare_data_loader`` that shards as Ray does and moves batches to this worker's
    device here: Ray's own move looks the device type up among its device managers, which know
    CUDA, CPU and a few others only ("Device type xla cannot be recognized", "... neuron ...")."""
    def prepare_data_loader(data_loader, add_dist_sampler=True, move_to_device=True,
                            auto_transfer=True):
        if spmd:
            raise _spmd_refusal("prepare_data_loader")
        loader = original(data_loader, add_dist_sampler=add_dist_sampler,
                          move_to_device=False, auto_transfer=False)
        return _OnXLADevice(loader) if move_to_device else loader

    prepare_data_loader.__doc__ = original.__doc__
    return prepare_data_loader


def _train_modules() -> tuple[list[Any], Any]:
    """The modules of Ray Train that hold its torch helpers, and Train V2's (None without it)."""
    import ray.train.torch as rtt
    import ray.train.torch.train_loop_utils as v1

    try:
        import ray.train.v2.torch.train_loop_utils as v2
    except ImportError:  # pragma: no cover - Ray without Train V2
        return [rtt, v1], None
    return [rtt, v1, v2], v2


def install_native() -> None:
    """Native TorchNeuron on Neuron: Ray's ``prepare_data_loader`` shards as Ray does and moves
    batches to the worker's ``neuron`` device (Ray's ``get_device`` and ``prepare_model`` use
    the device manager that ``native_neuron.py`` installs)."""
    if _patches:
        return
    for m in _train_modules()[0]:
        original = getattr(m, "prepare_data_loader", None)
        if original is not None:
            _patches.set(m, "prepare_data_loader", _prepare_data_loader_moving_here(original))


def install(spmd: bool) -> None:
    """Point Ray's torch helpers at the XLA device; tolerate a repeated init_process_group;
    unfuse Transformers' default AdamW. Under SPMD (``spmd``) Ray's prepare_model and
    prepare_data_loader raise, naming ours."""
    if _patches:
        return
    patch_transformers_trainer()
    _patch = functools.partial(_patches.set, only_if_present=True)
    modules, v2 = _train_modules()

    def make_prepare_model(original):
        def prepare_model(model, *args, **kwargs):
            if spmd:
                raise _spmd_refusal("prepare_model")
            return original(model, *args, **kwargs)

        prepare_model.__doc__ = original.__doc__
        return prepare_model

    for m in modules:
        model_fn = getattr(m, "prepare_model", None)
        loader_fn = getattr(m, "prepare_data_loader", None)
        _patch(m, "get_device", get_device)
        _patch(m, "get_devices", get_devices)
        if model_fn is not None:
            _patch(m, "prepare_model", make_prepare_model(model_fn))
        if loader_fn is not None:
            _patch(m, "prepare_data_loader", _prepare_data_loader_moving_here(loader_fn, spmd))
    # Where Ray's originals resolve the device (V1: air's torch_utils; V2: this module global),
    # so that functions imported by name before the backend ran agree too.
    from ray.air._internal import torch_utils

    _patch(torch_utils, "get_devices", get_devices)
    if v2 is not None:
        _patch(v2, "get_devices_distributed", get_devices)

    original_init = dist.init_process_group

    def init_process_group(backend: Any = None, init_method: Any = None, *args: Any, **kwargs: Any):
        if not dist.is_initialized():
            return original_init(backend, init_method, *args, **kwargs)
        world, rank = dist.get_world_size(), dist.get_rank()
        asked_world, asked_rank = kwargs.get("world_size", -1), kwargs.get("rank", -1)
        if asked_world not in (-1, None, world) or asked_rank not in (-1, None, rank):
            raise RuntimeError(
                f"init_process_group(world_size={asked_world}, rank={asked_rank}) on worker rank "
                f"{rank} (pid {os.getpid()}): ray_train_xla's backend already initialised the "
                f"process group with world_size={world}, rank={rank} from Ray's ranks. Remove "
                "the call or pass no world_size/rank.")
        logger.info("init_process_group(%r, init_method=%r): the default process group already "
                    "exists (%s, set up by ray_train_xla); nothing to do", backend, init_method,
                    dist.get_backend_config())
        return None

    init_process_group.__doc__ = original_init.__doc__
    _patch(dist, "init_process_group", init_process_group)
    _patch(dist.distributed_c10d, "init_process_group", init_process_group)


def uninstall() -> None:
    """Undo :func:`install`."""
    for watcher in _watchers:
        if watcher in sys.meta_path:
            sys.meta_path.remove(watcher)
    _watchers.clear()
    _patches.undo()
