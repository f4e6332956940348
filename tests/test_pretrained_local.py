"""``toolkit/pretrained.py`` in one process, without Ray: which files a model directory holds and
what is refused, the check of a checkpoint against a meta-device model (before anything is
allocated), the buffers a meta-device model gets back, a whole read against ``from_pretrained``
and an export in another dtype. (Sharded loads and exports on 4 workers:
``test_pretrained_ray.py``.)"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

from ray_train_xla.errors import CheckpointMismatchError  # noqa: E402
from ray_train_xla.toolkit import pretrained  # noqa: E402

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

PROBE = torch.tensor([[1, 5, 9, 77, 3, 127, 0, 42]])


def llama(tie: bool = False):
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tie)


def saved(tmp_path, config, name: str = "src", shard: str = "20KB", dtype=torch.bfloat16) -> str:
    torch.manual_seed(0)
    path = str(tmp_path / name)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path, max_shard_size=shard)
    return path


def on_meta(path: str, dtype=torch.float32):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def test_the_files_of_a_model_directory_and_what_is_refused(tmp_path):
    sharded = saved(tmp_path, llama(), "sharded")
    files = pretrained.safetensors_files(sharded)
    assert len(files) >= 3 and all(f.endswith(".safetensors") for f in files)
    single = saved(tmp_path, llama(), "single", shard="10MB")
    assert [os.path.basename(f) for f in pretrained.safetensors_files(single)] == ["model.safetensors"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "pytorch_model.bin").write_bytes(b"")
    (old / "config.json").write_text("{}")
    with pytest.raises(CheckpointMismatchError, match=r"\.bin weights.*save_pretrained\(new_path\)"):
        pretrained.safetensors_files(str(old))
    index = json.loads((tmp_path / "sharded" / pretrained.INDEX_FILE).read_text())
    gone = sorted(set(index["weight_map"].values()))[0]
    os.remove(tmp_path / "sharded" / gone)
    with pytest.raises(FileNotFoundError, match=f"lists files that are not there: {gone}"):
        pretrained.safetensors_files(sharded)
    with pytest.raises(FileNotFoundError, match="holds no"):
        pretrained.safetensors_files(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        pretrained.safetensors_files(str(tmp_path / "nowhere"))


def test_a_checkpoint_that_does_not_fit_is_refused_with_every_key_before_any_allocation(tmp_path):
    path = saved(tmp_path, llama(), shard="10MB")
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state["model.layers.0.mlp.gate.weight"] = state.pop("model.layers.0.mlp.gate_proj.weight")
    state["model.norm.weight"] = torch.ones(48)
    save_file(state, file, metadata={"format": "pt"})
    model = on_meta(path)
    with pytest.raises(CheckpointMismatchError) as info:
        pretrained.plan_names(model, pretrained.saved_shapes(path), path)
    message = str(info.value)
    assert "model.norm.weight: saved [48]" in message
    assert "missing from the checkpoint: model.layers.0.mlp.gate_proj.weight" in message
    assert "in the checkpoint but not in the LlamaForCausalLM: model.layers.0.mlp.gate.weight" in message
    assert all(p.device.type == "meta" for p in model.parameters())
    # Another dtype is no mismatch (it is converted), and a tied model needs one name of the pair.
    tied = saved(tmp_path, llama(tie=True), "tied", shard="10MB")
    names = pretrained.plan_names(on_meta(tied), pretrained.saved_shapes(tied), tied)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_a_whole_read_matches_from_pretrained_with_its_buffers_computed(tmp_path):
    """The path of one process per host (FSDPv2): materialised on the CPU in the training dtype,
    read whole, converted; the rotary frequencies computed, not read."""
    for config in (llama(), Qwen2Config(**{**llama(tie=True).to_dict(), "model_type": "qwen2"})):
        path = saved(tmp_path, config, type(config).__name__)
        model = on_meta(path, torch.float32)
        names = pretrained.plan_names(model, pretrained.saved_shapes(path), path)
        pretrained.materialize(model, "cpu")
        state = model.state_dict()
        pretrained.read_into({k: state[k] for k in names}, path)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for (name, buf), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
            assert torch.equal(buf, ref), name
        tied = config.tie_word_embeddings
        assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(PROBE).logits, reference(PROBE).logits,
                                       atol=0, rtol=0)


def test_buffers_nothing_computes_are_refused_unless_built_on_the_cpu():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(CheckpointMismatchError, match=r"Scaled\.scale.*rtx\.meta_parameters"):
        pretrained.materialize(model, "cpu")
    with pretrained.meta_parameters():
        model = Scaled()
    assert model.linear.weight.device.type == "meta" and model.scale.device.type == "cpu"
    pretrained.materialize(model, "cpu")
    assert torch.equal(model.scale, torch.arange(4.0)) and model.linear.weight.device.type == "cpu"
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the context is over


def test_an_export_in_one_process_in_another_dtype_loads_back(tmp_path):
    path = saved(tmp_path, llama(tie=True), shard="10MB", dtype=torch.float32)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({}, f)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = str(tmp_path / "out")
    summary = pretrained.export_pretrained(model, out, source=path, dtype="bf16",
                                           max_shard_bytes=20_000)
    files = sorted(os.listdir(out))
    weights = [f for f in files if f.endswith(".safetensors")]
    assert len(weights) >= 3 and summary["files"] == weights and summary["dtype"] == "bfloat16"
    assert {"config.json", "generation_config.json", pretrained.INDEX_FILE,
            "tokenizer_config.json"} <= set(files) and "sharded" not in files
    names = []
    for name in weights:
        with safe_open(os.path.join(out, name), framework="pt") as f:
            names += list(f.keys())
    assert "lm_head.weight" not in names and len(names) == len(set(names))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16)), key


def test_files_beside_the_index_and_keys_in_two_files_are_refused(tmp_path):
    path = saved(tmp_path, llama())
    first = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[0]
    save_file(load_file(os.path.join(path, first)), os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match="does not list \\(model.safetensors\\)"):
        pretrained.safetensors_files(path)
    os.remove(os.path.join(tmp_path / "src" / pretrained.INDEX_FILE))  # every file read now
    with pytest.raises(CheckpointMismatchError, match="in more than one safetensors file"):
        pretrained.saved_shapes(path)


def test_a_buffer_init_weights_leaves_alone_is_refused():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.ones(3), persistent=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.odd, self.linear = Odd(), torch.nn.Linear(3, 3)

        def _init_weights(self, module):  # computes nothing for Odd
            pass

    with torch.device("meta"):
        model = Model()
    with pytest.raises(CheckpointMismatchError, match=r"Odd\.table"):
        pretrained.materialize(model, "cpu")


def test_an_export_refuses_a_directory_with_a_model_and_clears_a_failed_exports_slices(tmp_path):
    path = saved(tmp_path, llama(), shard="10MB", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(FileExistsError, match="already holds a model"):
        pretrained.export_pretrained(model, path)
    out = tmp_path / "out"
    (out / pretrained.SHARDED_SUBDIR).mkdir(parents=True)
    save_file({"model.norm.weight": torch.zeros(32)},  # a failed export's slice, left behind
              str(out / pretrained.SHARDED_SUBDIR / "model-00001-of-00001.safetensors"))
    pretrained.export_pretrained(model, str(out), source=path)
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_a_uri_is_fetched_once_per_node_and_a_failed_fetch_reaches_the_other_workers(
        tmp_path, monkeypatch):
    path = saved(tmp_path, llama(), shard="10MB")
    cache = tmp_path / "cache"
    local = pretrained.pretrained_path(f"file://{path}", cache_dir=str(cache))
    assert sorted(os.listdir(local)) == sorted(os.listdir(path) + [".complete"])
    assert pretrained.pretrained_path(f"file://{path}", cache_dir=str(cache)) == local  # reused
    assert os.listdir(cache) == [os.path.basename(local)]  # no temporary copy left
    assert pretrained.pretrained_path(path) == path  # a local directory is read in place
    missing = f"file://{tmp_path}/nowhere"
    with pytest.raises(Exception, match="nowhere"):
        pretrained.pretrained_path(missing, cache_dir=str(cache))
    # Another worker of the node (local rank 1) waits for rank 0's copy and gets its error.
    monkeypatch.setattr("ray_train_xla.toolkit.ranks.local_rank", lambda: 1)
    with pytest.raises(OSError, match="local rank 0 could not fetch .*nowhere"):
        pretrained.pretrained_path(missing, cache_dir=str(cache), timeout_s=5)
    with pytest.raises(TimeoutError, match="within 0.3 s"):
        pretrained.pretrained_path(f"file://{tmp_path}/other", cache_dir=str(cache), timeout_s=0.3)
