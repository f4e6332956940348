"""Checkpoints loaded into something they do not fit, without Ray: a hidden=64 model's sharded
(FSDPv2 on 2 XLA CPU devices) and replicated checkpoints into a hidden=32 model, a hidden=128
one, a bfloat16 one, one with a layer more and one with a layer less; and ``consolidate`` of
a sharded checkpoint whose shards do not make up its tensors. Every load raises
``CheckpointMismatchError`` naming the keys and both shapes and dtypes, before it changes
anything."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
from test_sharded_local import run_scenario


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    return out, run_scenario(out, "mismatch", devices=2)


HEAD = "CheckpointMismatchError: load_checkpoint: "


@pytest.mark.parametrize("kind", ["sharded", "replicated"])
def test_other_shapes_are_refused_naming_key_and_both_shapes(mismatch, kind):
    rec = mismatch[1][kind]
    prefix = "model."  # both under the plain module's names (FSDPv2's prefix is not stored)
    smaller, larger = rec["smaller"], rec["larger"]
    assert smaller.startswith(HEAD) and larger.startswith(HEAD), (smaller, larger)
    # Each weight, with the saved and the target shape and dtype.
    assert f"{prefix}0.weight: saved [64, 16] float32, into [32, 16] float32" in smaller
    assert f"{prefix}2.weight: saved [64, 64] float32, into [32, 32] float32" in smaller
    assert f"{prefix}0.weight: saved [64, 16] float32, into [128, 16] float32" in larger
    assert "does not fit the model (" in smaller
    if kind == "sharded":
        # The model is checked before the optimizer is primed (a step that would move it).
        assert rec["smaller/model_only"] == smaller
        # A model that fits with an optimizer that does not: the optimizer's entries named.
        subset = rec["optimizer_subset"]
        assert "does not fit the model and the optimizer" in subset
        # The optimizer state is stored under the parameters' names.
        assert ("in the checkpoint but not in the model and the optimizer: "
                "optimizer.state.2.bias.exp_avg, optimizer.state.2.bias.exp_avg_sq") in subset
    # Refused before anything was copied into the model (or the optimizer primed).
    for name in ("smaller", "larger", "bf16", "more_layers", "fewer_layers"):
        assert rec[f"{name}/untouched"], name


@pytest.mark.parametrize("kind", ["sharded", "replicated"])
def test_other_dtype_and_missing_or_unexpected_keys_are_named(mismatch, kind):
    rec = mismatch[1][kind]
    prefix = "model."  # both under the plain module's names (FSDPv2's prefix is not stored)
    assert f"{prefix}0.weight: saved [64, 16] float32, into [64, 16] bfloat16" in rec["bf16"]
    more, fewer = rec["more_layers"], rec["fewer_layers"]
    # make_model(depth=2): Linear 0, 2, 4, 6; the checkpoint (depth=1) has 0, 2, 4.
    assert f"missing from the checkpoint: {prefix}6.bias, {prefix}6.weight" in more
    assert f"{prefix}4.weight: saved [8, 64] float32, into [64, 64] float32" in more
    # make_model(depth=0): Linear 0, 2; the checkpoint's 4.* have no place.
    assert f"in the checkpoint but not in the model: {prefix}4.bias, {prefix}4.weight" in fewer
    assert rec["same"] == ""


def test_matching_loads_still_restore(mismatch):
    rec = mismatch[1]
    assert rec["sharded_restored"] and rec["replicated_restored"]


def test_consolidate_refuses_shards_that_do_not_make_up_a_tensor(mismatch, tmp_path):
    from ray_train_xla.tools.consolidate import ConsolidateError, consolidate

    out, _ = mismatch
    good = consolidate(str(out / "sharded64"), str(tmp_path / "ok.safetensors"))
    assert good["tensors"] == 6
    from safetensors.torch import load_file

    assert tuple(load_file(str(tmp_path / "ok.safetensors"))["0.weight"].shape) == (64, 16)

    # A .metadata that lists one shard fewer for a weight than it has (as when the shards of
    # another save are mixed in): that part of the tensor would be uninitialised memory.
    broken = tmp_path / "broken"
    shutil.copytree(out / "sharded64", broken)
    with open(broken / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    key = "model.2.weight"
    md = metadata.state_dict_metadata[key]
    assert len(md.chunks) == 2  # split over the 2 devices
    md.chunks.pop()
    with open(broken / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ConsolidateError) as info:
        consolidate(str(broken), str(tmp_path / "broken.safetensors"))
    message = str(info.value)
    assert message.startswith(f"cannot consolidate checkpoint {broken}: the shards do not make "
                              "up the tensors its metadata declares: ")
    assert f"{key}: [64, 64] float32 from shards [0, 0]+[32, 64] (2048 of 4096 elements)" in message
    assert "\n" not in message
    assert not os.path.exists(tmp_path / "broken.safetensors")
