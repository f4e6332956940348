"""Tensor and sequence parallelism with FSDP2 (``toolkit/tensor_parallel.py``), without Ray.

The plan mapping is checked on models built on the meta device. The training runs are
``tp_worker.py``'s: 4 gloo ranks on the CPU, a tiny Llama (and Qwen3) trained with AdamW and
clipping on meshes of ``(dp_replicate, dp_shard, tp)``, each step's loss and the final
parameters against one unsharded process training the same model on the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.14

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")
EXACT = 1e-5  # the unsharded run's losses and parameters, within rounding


# ------------------------------------------------------------------ the plan, on the meta device

def meta_model(kind: str = "llama", **overrides):
    import transformers

    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = configs[kind](**{**sizes, **overrides})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def layouts(style) -> tuple:
    return (type(style).__name__, tuple(map(str, style.input_layouts)),
            tuple(map(str, style.output_layouts)), style.use_local_output)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_the_models_own_plan_maps_to_torch_styles_per_module(kind):
    from ray_train_xla.toolkit import tensor_parallel as tp

    model = meta_model(kind)
    if hasattr(model, "tp_plan"):  # transformers 5.25 assembles the same plan itself
        assert tp.hf_plan(model) == model.tp_plan
    styles = tp.tp_plan(model)
    assert len(styles) == 2 * 7 + 2  # each layer's 7 projections, the embedding and the head
    col = ("ColwiseParallel", ("R",), ("S(-1)",), True)
    row = ("RowwiseParallel", ("S(-1)",), ("R",), True)
    for i in range(2):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            assert layouts(styles[f"model.layers.{i}.{name}"]) == col, name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert layouts(styles[f"model.layers.{i}.{name}"]) == row, name
    # The vocabulary-parallel embedding, and the head gathering the logits.
    assert layouts(styles["model.embed_tokens"]) == ("RowwiseParallel", ("R",), ("R",), True)
    assert layouts(styles["lm_head"]) == ("ColwiseParallel", ("R",), ("R",), True)
    # The logits left split on the vocabulary for torch's loss_parallel.
    assert layouts(tp.tp_plan(model, loss_parallel=True)["lm_head"]) == (
        "ColwiseParallel", ("R",), ("S(-1)",), False)


def test_sequence_parallel_splits_the_stream_between_the_layers():
    from ray_train_xla.toolkit import tensor_parallel as tp

    model = meta_model("llama")
    styles = tp.tp_plan(model, sequence_parallel=True)
    layer = "model.layers.1"
    assert layouts(styles["model.embed_tokens"]) == ("RowwiseParallel", ("R",), ("S(1)",), False)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        sp = styles[f"{layer}.{norm}"]
        assert type(sp).__name__ == "SequenceParallel" and not sp.use_local_output
        assert tuple(map(str, sp.sequence_sharding)) == ("S(1)",)
    attn, mlp = styles[f"{layer}.self_attn"], styles[f"{layer}.mlp"]
    assert type(attn).__name__ == type(mlp).__name__ == "PrepareModuleInput"
    # The decoder layer calls self_attn(hidden_states=...) and mlp(hidden_states).
    assert {k: str(v) for k, v in attn.input_kwarg_layouts.items()} == {"hidden_states": "S(1)"}
    assert {k: str(v) for k, v in attn.desired_input_kwarg_layouts.items()} == {"hidden_states": "R"}
    assert tuple(map(str, mlp.input_layouts)) == ("S(1)",) and attn.use_local_output
    assert tuple(map(str, mlp.desired_input_layouts)) == ("R",) and mlp.use_local_output
    assert layouts(styles[f"{layer}.self_attn.o_proj"]) == ("RowwiseParallel", ("S(-1)",), ("S(1)",), False)
    assert layouts(styles[f"{layer}.self_attn.q_proj"]) == ("ColwiseParallel", ("R",), ("S(-1)",), True)
    assert styles["model.norm"].use_local_output  # the final norm hands the head its slice
    assert layouts(styles["lm_head"]) == ("ColwiseParallel", ("S(1)",), ("R",), True)


def test_sequence_parallel_refuses_layers_it_does_not_know():
    import transformers

    from ray_train_xla.toolkit import tensor_parallel as tp

    model = meta_model("llama")
    with torch.device("meta"):
        for layer in model.model.layers:
            layer.gate = torch.nn.Linear(64, 64)  # neither a norm nor in the plan
    tp.tp_plan(model)  # without sequence parallelism it stays as it is
    with pytest.raises(ValueError, match=r"model.layers.\*.gate \(Linear\) is neither a norm nor"):
        tp.tp_plan(model, sequence_parallel=True)
    with torch.device("meta"):
        base = transformers.LlamaModel(meta_model("llama").config)  # no head
    assert "lm_head" not in tp.tp_plan(base, sequence_parallel=True)
    with pytest.raises(ValueError, match="loss_parallel needs an output projection"):
        tp.tp_plan(base, loss_parallel=True)


def test_per_head_norms_keep_a_weight_whose_gradient_sums_over_the_tp_group():
    from ray_train_xla.toolkit import tensor_parallel as tp

    styles = tp.tp_plan(meta_model("qwen3"))
    for norm in ("q_norm", "k_norm"):  # replicated_with_grad_allreduce in Qwen3's plan
        style = styles[f"model.layers.0.self_attn.{norm}"]
        assert type(style).__name__ == "SequenceParallel" and style.use_local_output
        assert tuple(map(str, style.sequence_sharding)) == ("S(0)",)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([Block(), Block(), Block()])


def test_wildcards_expand_to_the_models_modules_and_unknown_keys_are_refused():
    from ray_train_xla.toolkit import tensor_parallel as tp

    model = Net()
    assert tp.expand({"layers.*.wq": "a", "tok": "b"}, model) == {
        "layers.0.wq": "a", "layers.1.wq": "a", "layers.2.wq": "a", "tok": "b"}
    assert tp.expand({"layers.1.w*": "a"}, model) == {"layers.1.wq": "a", "layers.1.wo": "a"}
    with pytest.raises(ValueError, match="'layers.*.wk' names nothing"):
        tp.expand({"layers.*.wk": "a"}, model)
    with pytest.raises(ValueError, match="'layers.*.wq.weight' names a parameter"):
        tp.expand({"layers.*.wq.weight": "a"}, model)
    with pytest.raises(ValueError, match="Net is not a Hugging Face model; pass plan="):
        tp.tp_plan(model)


def test_tp_not_dividing_heads_or_widths_is_refused_naming_the_modules():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ray_train_xla.toolkit import tensor_parallel as tp

    model = meta_model("llama")
    styles = tp.tp_plan(model)
    tp.check_divisible(model, styles, 2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_key_value_heads "
                       r"\(model.layers.\*.self_attn\)=2 of LlamaForCausalLM.*Valid tp: 1, 2$"):
        tp.check_divisible(model, styles, 4)
    wide = meta_model("llama", intermediate_size=98, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"tp=4 does not divide "
                       r"model.layers.\*.mlp.gate_proj.out_features=98; "
                       r"model.layers.\*.mlp.up_proj.out_features=98; "
                       r"model.layers.\*.mlp.down_proj.in_features=98 .*Valid tp: 1, 2$") as e:
        tp.check_divisible(wide, tp.tp_plan(wide), 4)
    assert "num_attention_heads" not in str(e.value)  # 4 heads: not the problem
    # A plan of one's own: the widths it splits.
    with pytest.raises(ValueError, match=r"tp=3 does not divide layers.\*.wq.out_features=8; "
                       r"layers.\*.wo.in_features=8 of Net"):
        tp.check_divisible(Net(), tp.expand({"layers.*.wq": ColwiseParallel(),
                                             "layers.*.wo": RowwiseParallel()}, Net()), 3)


def test_plans_and_meshes_it_cannot_follow_are_refused():
    import transformers

    from ray_train_xla.toolkit import tensor_parallel as tp

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.mlp.up_proj": "packed_colwise"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"no torch equivalent here: \{'model.layers.\*.mlp.up_proj': "
                       "'packed_colwise'}.*Pass plan="):
        tp.tp_plan(model)
    config.base_model_tp_plan = {}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        tp.tp_plan(model)
    mesh = types.SimpleNamespace(mesh_dim_names=("replicate", "fsdp"))
    with pytest.raises(ValueError, match=r"the mesh dims \('replicate', 'fsdp'\) are not"):
        tp.parallelize(Net(), mesh)
    mesh.mesh_dim_names = ("dp_replicate", "dp_shard", "tp")
    with pytest.raises(ValueError, match="a plan of your own carries its own SequenceParallel"):
        tp.parallelize(Net(), mesh, {"layers.*.wq": None}, sequence_parallel=True)


# --------------------------------------------------------- training on 4 ranks against one process

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    # The native path never imports torch_xla; Transformers would import it where it is installed.
    env = dict(os.environ, USE_TORCH_XLA="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([SRC_DIR, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "tp_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    assert proc.returncode == 0 and "error" not in results, (results.get("error"), proc.stderr[-4000:])
    return results


def exact(rec: dict) -> None:
    assert rec["keys_match"]
    assert rec["loss_diff"] <= EXACT and rec["param_diff"] <= EXACT, rec
    assert rec["moved"] > 1e-3  # the parameters did train


def test_tp2_fsdp2_with_activation_checkpointing_trains_as_one_process(runs):
    rec = runs["tp2_dp2"]
    exact(rec)
    where = rec["placements"]
    dims = "('dp_shard', 'tp')"
    # FSDP2 shards dim 0 over dp_shard inside each TP slice (torch's _StridedShard).
    assert where["model.layers.0.self_attn.q_proj.weight"] == [dims, ["_S(0, 2)", "S(0)"]]
    assert where["model.layers.1.mlp.down_proj.weight"] == [dims, ["S(0)", "S(1)"]]
    assert where["model.embed_tokens.weight"] == [dims, ["_S(0, 2)", "S(0)"]]  # by vocabulary
    # Without sequence parallelism the norms are not split over tp: FSDP2 alone shards them.
    assert where["model.layers.0.input_layernorm.weight"] == ["('dp_shard',)", ["S(0)"]]


def test_sequence_parallel_with_the_loss_on_split_logits_trains_as_one_process(runs):
    rec = runs["tp2_dp2_sp"]
    exact(rec)
    assert rec["logits"] == ["DTensor", "(Shard(dim=2),)"]  # split on the vocabulary
    assert "length 15 is not a multiple of tp=2" in rec["uneven"]
    assert rec["placements"]["model.layers.1.post_attention_layernorm.weight"] == [
        "('dp_shard', 'tp')", ["S(0)", "R"]]


def test_tp4_sequence_parallel_with_tied_embeddings_trains_as_one_process(runs):
    rec = runs["tp4_tied_sp"]
    exact(rec)
    assert rec["tied_after"]  # embed_tokens and lm_head are one parameter again
    assert rec["placements"]["model.embed_tokens.weight"] == ["('dp_shard', 'tp')", ["_S(0, 4)", "S(0)"]]
    # A sequence SP cannot split evenly: refused before any collective.
    assert rec["uneven"] == ("sequence_parallel: the sequence length 15 is not a multiple of "
                             "tp=4; pad each batch to a multiple of 4")


def test_hsdp_by_tp_and_per_head_norms_train_as_one_process(runs):
    rec = runs["hsdp_tp2_qwen3"]
    exact(rec)
    dims = "('dp_replicate', 'dp_shard', 'tp')"
    assert rec["placements"]["model.layers.0.self_attn.k_proj.weight"] == [dims, ["R", "_S(0, 2)", "S(0)"]]
    assert rec["placements"]["model.layers.0.self_attn.q_norm.weight"] == [dims, ["R", "S(0)", "R"]]


def test_bf16_mixed_precision_trains_close_to_fp32(runs):
    rec = runs["tp2_dp2_bf16"]
    assert 0 < rec["loss_diff"] < 0.05  # bf16 compute: near, not equal
    assert rec["mean_diff"] < rec["moved"] / 10
    assert rec["placements"]["model.layers.0.self_attn.q_proj.weight"][1] == ["_S(0, 2)", "S(0)"]


def test_the_comparison_fails_when_tp_is_wrong(runs):
    # TP peers fed different rows (a loader splitting by global rank), Qwen3's per-head norms
    # not summed over the TP group, colwise and rowwise swapped: none trains as one process.
    for name in ("peers_differ", "qwen3_no_norm_sum"):
        rec = runs[name]
        assert rec["loss_diff"] > 1e-4 and rec["param_diff"] > 1e-2, (name, rec)
    swapped = runs["swapped"]
    assert "error" in swapped or swapped["param_diff"] > 1e-2, swapped


def test_tp1_without_replicas_is_todays_fsdp2(runs):
    rec = runs["today"]
    new, old = rec["placements"]
    assert list(new) == list(old)
    assert all(a == ["('dp_shard',)", b[1]] and b[0] == "('fsdp',)" and b[1] == ["S(0)"]
               for a, b in zip(new.values(), old.values()))
    assert rec["bit_exact"] and rec["param_diff"] <= EXACT
