"""FSDPv2 x TP under torch_xla SPMD without Ray: a tiny Hugging Face Llama (fsdp2_worker's) on 4
virtual XLA CPU devices as TP 2 x FSDPv2 2 against plain torch, the 2-D partition specs and
what each device holds, a sharded checkpoint restored onto TP 2 x FSDPv2 2 and onto FSDPv2 4,
replicas x TP; and the plan as partition specs (``tensor_parallel.partition_specs``), in this
process. The scenarios run in fresh processes (``sharded_worker.py``): torch_xla fixes SPMD mode
and the device count per process."""

from __future__ import annotations

import pytest
import torch
from test_sharded_local import run_scenario

# The specs on the mesh (fsdp 2, model 2), device d at fsdp d // 2, model d % 2: dim 0 over
# "model" and dim 1 over "fsdp" (column-wise [out, in], the vocabulary of the embedding and
# head), the reverse (row-wise), and dim 0 over "fsdp" alone, whole over "model" (FSDPv2's own).
COLWISE, ROWWISE = "{devices=[2,2]0,2,1,3}", "{devices=[2,2]0,1,2,3}"
FSDP_ONLY = "{devices=[2,2]0,1,2,3 last_tile_dim_replicate}"
# The batch: rows over "fsdp", the same rows on both devices of a TP group.
BATCH_SPEC = "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"


def expected_spec(name: str) -> str:
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                      "up_proj.weight")) or name in ("lm_head.weight", "model.embed_tokens.weight"):
        return COLWISE
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return ROWWISE
    assert name.endswith("norm.weight"), name
    return FSDP_ONLY


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("xla_tp")
    tp = run_scenario(out, "tp", out / "ckpt", devices=4)
    return tp, run_scenario(out, "tp_load", out / "ckpt", devices=4)


def test_tp2_fsdpv2_2_trains_as_plain_torch(runs):
    rec = runs[0]
    assert rec["devices"] == 4 and rec["layout"] == "dp_replicate=1,dp_shard=2,tp=2"
    assert rec["mesh"] == {"fsdp": 2, "model": 2}
    assert rec["wrapper"] == "SpmdFullyShardedDataParallel"
    assert rec["batch_specs"] == [BATCH_SPEC] * 3
    assert len(rec["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(rec["losses"], rec["ref_losses"])) <= 1e-5
    assert rec["max_diff"] <= 1e-5
    assert rec["diff_to_untrained"] > 1e-3  # it trained
    assert min(rec["norms"]) > 0.5  # rtx.clip_grad_norm_(model, 0.5) clipped every step


def test_parameters_gradients_and_optimizer_state_have_the_2d_specs(runs):
    rec = runs[0]
    specs = rec["specs"]
    assert len(specs) == 21
    assert specs == {name: expected_spec(name) for name in specs}
    assert rec["grad_specs"] == specs and rec["exp_avg_specs"] == specs
    assert rec["blocks_specs"] == specs  # each block wrapped on its own: the same specs
    for name, shapes in rec["shard_shapes"].items():
        whole = {"lm_head.weight": [64, 32], "model.embed_tokens.weight": [64, 32]}.get(name)
        if name.endswith("norm.weight"):  # whole on the two devices of a TP group
            assert shapes == [[16]] * 4, name
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            assert shapes == [[32, 16]] * 4, name
        elif name.endswith("down_proj.weight"):
            assert shapes == [[16, 32]] * 4, name
        elif whole:
            assert shapes == [[32, 16]] * 4, name
        else:  # q, k, v, o: each device holds a quarter, 16 x 16 (FSDP alone: 8 x 32)
            assert shapes == [[16, 16]] * 4, name
    holds = rec["holds"]
    assert holds == {"colwise rows by model, columns by fsdp": True,
                     "rowwise rows by fsdp, columns by model": True,
                     "embedding vocabulary by model": True,
                     "control: colwise rows by fsdp": False}


def test_sharded_checkpoint_of_tp_restores_on_tp_and_on_fsdpv2(runs):
    rec, load = runs
    assert rec["state_dict"] == {"whole_shapes": True, "q_spec": COLWISE}
    assert {".metadata", "__0_0.distcp", "extra.pt", "sharded.json"} <= set(rec["saved"]["files"])
    assert rec["restored_extra"] == {"step": 3} and rec["restored_exact"]
    # Each chunk once: the norms, whole over "model", are held by both devices of a TP group.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(rec["ckpt"]).read_metadata()
    tensors = {k: md for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    norms = [k for k in tensors if k.endswith("norm.weight")]
    assert norms and all(len(tensors[k].chunks) == 2 for k in norms), norms
    for key, md in tensors.items():
        assert sum(c.sizes.numel() for c in md.chunks) == md.size.numel(), (key, md.chunks)
    assert load["layout"] == "dp_replicate=1,dp_shard=4,tp=1"
    assert load["spec"] == "{devices=[4,1]0,1,2,3}"
    assert load["extra"] == {"step": 3}
    assert load["model_exact"] and load["optimizer_exact"]


def test_load_pretrained_splits_by_the_layout(runs):
    rec = runs[0]
    assert rec["pretrained"] == {"specs": rec["specs"], "exact": True}


def test_refusals_under_a_tp_layout(runs):
    mesh, layout, sp = runs[0]["refused"]
    assert mesh.startswith("ValueError: prepare_sharded_model: the layout has tp=2, but the "
                           "mesh's 'model' axis has 1 devices")
    assert layout.startswith("ValueError: configure_parallelism: dp_replicate=1,dp_shard=1,tp=4 "
                             "conflicts with dp_replicate=1,dp_shard=2,tp=2, set by the "
                             "config's parallelism")
    assert sp.startswith("ValueError: prepare_sharded_model: sequence_parallel and loss_parallel "
                         "are DTensor styles")


def test_replicas_times_tp_trains_as_plain_torch(runs):
    rec = runs[0]
    hsdp = rec["hsdp"]
    assert hsdp["mesh"] == {"data": 2, "fsdp": 1, "model": 2}
    assert hsdp["batch_specs"] == [BATCH_SPEC] * 3  # rows over ("data", "fsdp")
    assert max(abs(a - b) for a, b in zip(hsdp["losses"], rec["ref_losses"])) <= 1e-5
    assert hsdp["max_diff"] <= 1e-5
    split = "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"  # over model, whole over data
    assert hsdp["specs"] == {
        "model.layers.0.self_attn.q_proj.weight": split,
        "model.layers.0.self_attn.o_proj.weight": "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}",
        "model.embed_tokens.weight": split, "model.norm.weight": "{replicated}"}


# ---- the plan as partition specs, without torch_xla ------------------------------------------

def test_partition_specs_of_a_hugging_face_decoder():
    import fsdp2_worker as w

    from ray_train_xla.toolkit.tensor_parallel import partition_specs, tp_plan

    model = w.make_lm()
    specs = partition_specs(model, tp_plan(model))
    col, row = ("model", "fsdp"), ("fsdp", "model")
    assert specs == {name: (row if name.endswith(("o_proj.weight", "down_proj.weight")) else col)
                     for name, _ in model.named_parameters() if not name.endswith("norm.weight")}


def test_partition_specs_of_styles_and_ties():
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from ray_train_xla.toolkit.tensor_parallel import partition_specs

    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(8, 4), "up": torch.nn.Linear(4, 6),
                                 "down": torch.nn.Linear(6, 4), "norm": torch.nn.LayerNorm(4),
                                 "head": torch.nn.Linear(4, 8, bias=False)})
    model["head"].weight = model["emb"].weight  # tied
    styles = {"emb": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(),
              "norm": SequenceParallel(), "head": ColwiseParallel()}
    assert partition_specs(model, styles, "tp", "dp") == {
        "emb.weight": ("tp", "dp"), "up.weight": ("tp", "dp"), "up.bias": ("tp",),
        "down.weight": ("dp", "tp")}  # down's bias and the norm: whole over tp
    assert partition_specs(model, {"emb": ColwiseParallel()}) == {"emb.weight": ("fsdp", "model")}
    with pytest.raises(ValueError, match="emb.weight and head.weight are one tied parameter"):
        partition_specs(model, {"emb": RowwiseParallel(), "head": RowwiseParallel()})
    with pytest.raises(ValueError, match="up has PrepareModuleInput; under torch_xla SPMD"):
        partition_specs(model, {"up": PrepareModuleInput()})
    with pytest.raises(ValueError, match="norm is a LayerNorm, but ColwiseParallel splits"):
        partition_specs(model, {"norm": ColwiseParallel()})
