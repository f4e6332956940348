"""The internals of Ray (and of the libraries beside it) that the worker-side patches replace or
wrap, as the installed versions have them: each patch is listed in docs/architecture.md
("Patches of Ray's internals"), and this test fails when a Ray upgrade changes what one relies
on, rather than the patch going silently unused (``Patches.set(..., only_if_present=True)``
skips an attribute that is gone). No cluster: imports and signatures only."""

from __future__ import annotations

import importlib
import inspect
import os

import pytest

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Ray's own torch helpers, replaced on XLA workers (startup/ray_helpers.py): every module that
# holds them, with the parameters our replacements pass on.
HELPERS = {
    "get_device": [],
    "get_devices": [],
    "prepare_model": ["model", "move_to_device", "parallel_strategy", "parallel_strategy_kwargs"],
    "prepare_data_loader": ["data_loader", "add_dist_sampler", "move_to_device", "auto_transfer"],
}
HELPER_MODULES = ("ray.train.torch", "ray.train.torch.train_loop_utils",
                  "ray.train.v2.torch.train_loop_utils")


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize("module", HELPER_MODULES)
def test_rays_torch_helpers_are_where_ray_helpers_replaces_them(module):
    m = importlib.import_module(module)
    for name, expected in HELPERS.items():
        assert callable(getattr(m, name, None)), f"{module}.{name} is gone"
        assert params(getattr(m, name)) == expected, (module, name)


def test_where_rays_helpers_resolve_the_device():
    from ray.air._internal import torch_utils
    from ray.train.v2.torch import train_loop_utils as v2

    assert params(torch_utils.get_devices) == []  # V1's prepare_* ask it for the device
    assert params(v2.get_devices_distributed) == []  # V2's


def test_the_training_function_runs_in_the_configs_train_func_context():
    """Ray Train (V2 and V1) enters ``BackendConfig.train_func_context`` (public) around the
    training function on every worker: ours waits for the reports there."""
    from ray.train.backend import BackendConfig

    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig, TorchXLAConfig
    from ray_train_xla.startup.train_function import training_function

    assert isinstance(inspect.getattr_static(BackendConfig, "train_func_context"), property)
    for config in (TorchXLAConfig(), TorchNeuronConfig(), TorchTPUConfig()):
        assert config.train_func_context is training_function


def test_each_patch_is_listed_with_the_ray_version_it_was_tested_on():
    import ray

    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Patches of Ray's internals", 1)[1].split("\n## ", 1)[0]
    for target in ("get_devices_distributed",
                   "ray.air._internal.torch_utils.get_devices", "prepare_model",
                   "prepare_data_loader", "init_process_group"):
        assert target in section, target
    assert f"Ray {ray.__version__}" in section


def test_what_checkpoints_in_place_and_the_memory_tier_rely_on():
    import ray.train
    import ray.util
    from ray.train import CheckpointUploadMode
    from ray.train.v2._internal.execution.storage import StorageContext

    report = params(ray.train.report)
    assert "checkpoint_dir_name" in report and "checkpoint_upload_mode" in report
    assert CheckpointUploadMode.NO_UPLOAD.value == "NO_UPLOAD"
    for attr in ("experiment_fs_path", "storage_filesystem"):
        assert attr in inspect.getsource(StorageContext), attr
    assert "all_namespaces" in params(ray.util.list_named_actors)
    # The directory names Ray gives the checkpoints it copies: ours follow them.
    from ray_train_xla.toolkit.reporting import Reporter

    rep = Reporter(lambda *a, **k: None, rank=0, world=1, max_in_flight=1, timeout_s=5,
                   place=lambda name: name)
    ours, rays = rep._new_name(), StorageContext.make_default_checkpoint_dir_name()
    rep.close()
    assert len(ours) == len(rays) and ours[:11] == rays[:11] == "checkpoint_", (ours, rays)
