"""``ray-train-xla consolidate --hf``: a Hugging Face ``save_pretrained`` directory from a sharded
or replicated checkpoint of a tiny ``LlamaForCausalLM`` (tied and untied embeddings), loaded back
with ``AutoModelForCausalLM.from_pretrained``; the config from ``--config`` or from the
checkpoint's ``hf_config``; the refusals; and the run without torch_xla. No Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from ray_train_xla.tools.cli import main  # noqa: E402

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")
INPUT = torch.tensor([[1, 5, 9, 77, 3, 127, 0, 42, 8, 64]])


def tiny_llama(tie: bool, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A random tiny Llama (every weight random, the norms too) in ``dtype``, in eval mode."""
    torch.manual_seed(1 if tie else 2)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    # As Transformers builds it in dtype (its rotary buffers stay float32, as from_pretrained's).
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    return model.eval()


def save_sharded(path, model_state: dict, extra: dict) -> None:
    """A sharded checkpoint as toolkit/checkpoint/sharded.py's write_staged writes it (one rank)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...", TypedStorage
        dcp.save({"model": model_state}, checkpoint_id=str(path), no_dist=True)
    torch.save(extra, os.path.join(path, "extra.pt"))
    with open(os.path.join(path, "sharded.json"), "w") as f:
        json.dump({"format": "torch.distributed.checkpoint", "planner": "torch_xla SPMDSavePlanner",
                   "workers": 1, "devices": 1, "keys": ["model"]}, f)


def save_replicated(path, model_state: dict, extra: dict) -> None:
    os.makedirs(path)
    torch.save({"model": model_state, **extra}, os.path.join(path, "checkpoint.pt"))


def state_of(model, prefix: str = "") -> dict:
    return {prefix + k: v for k, v in model.state_dict().items()}


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before (from_pretrained's progress bars)
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def error_line(capsys, argv: list[str], code: int) -> str:
    got, _, err = run(capsys, argv)
    assert got == code, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ray-train-xla consolidate: error: "), lines[0]
    return lines[0]


def weights_of(out_dir) -> dict[str, list[str]]:
    """{safetensors file: the tensor names it holds}."""
    names = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, name), framework="pt") as f:
                names[name] = sorted(f.keys())
    return names


def assert_same_model(out_dir, source: LlamaForCausalLM, tie: bool) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir)).eval()
    assert type(loaded) is LlamaForCausalLM and loaded.dtype == source.dtype
    got_state = loaded.state_dict()
    assert all(torch.equal(got_state[k], v) for k, v in source.state_dict().items())
    with torch.no_grad():
        expected, got = source(INPUT).logits, loaded(INPUT).logits
    assert expected.std() > 0.05  # random weights: logits far from constant, so the check means something
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    tied = loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert tied is tie
    with open(os.path.join(out_dir, "config.json")) as f:
        assert json.load(f)["tie_word_embeddings"] is tie


@pytest.mark.parametrize("tie, kind, prefix, shard_size", [
    (True, "sharded", "", "10KB"),
    (False, "sharded", "_orig_module.", "10KB"),
    (True, "replicated", "_orig_module.", None),
    (False, "replicated", "", None),
])
def test_export_loads_back_with_the_same_logits(capsys, tmp_path, tie, kind, prefix, shard_size):
    model = tiny_llama(tie)
    ckpt = tmp_path / "ckpt"
    (save_sharded if kind == "sharded" else save_replicated)(ckpt, state_of(model, prefix), {"step": 1})
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)  # --config: a model directory, or its config.json
    config = str(model_dir) if tie else str(model_dir / "config.json")
    out = tmp_path / "exported"
    argv = ["consolidate", str(ckpt), str(out), "--hf", "--config", config, "--json"]
    code, stdout, err = run(capsys, argv + (["--max-shard-size", shard_size] if shard_size else []))
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["sharded"] is (kind == "sharded") and summary["architecture"] == "LlamaForCausalLM"
    assert summary["tied"] == (["lm_head.weight"] if tie else [])
    files = sorted(os.listdir(out))
    assert {"config.json", "generation_config.json"} <= set(files) and summary["files"] == files
    weights = weights_of(out)
    written = sorted(n for names in weights.values() for n in names)
    expected = sorted(k for k in model.state_dict() if not (tie and k == "lm_head.weight"))
    assert written == expected  # a tied weight is written once, under its source's name
    if shard_size:
        assert len(weights) > 2 and "model.safetensors" not in weights
        with open(out / "model.safetensors.index.json") as f:
            index = json.load(f)
        assert sorted(index["weight_map"]) == expected
        assert set(index["weight_map"].values()) == set(weights)
        # Every shard at most 10 kB, unless it is one tensor larger than that.
        assert all(os.path.getsize(out / name) <= 10_000 + 1_000 or len(names) == 1
                   for name, names in weights.items())
    else:
        assert list(weights) == ["model.safetensors"]
        assert "model.safetensors.index.json" not in files
    assert_same_model(out, model, tie)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # no staging directory left


@pytest.mark.parametrize("kind", ["sharded", "replicated"])
def test_the_config_saved_in_the_checkpoint(capsys, tmp_path, kind):
    # bfloat16 weights with a config that says float32: the export takes the config's dtype (the
    # pretrained model's stored dtype) unless --dtype says otherwise.
    model = tiny_llama(tie=False, dtype=torch.bfloat16)
    hf_config = model.config.to_dict() | {"dtype": "float32"}
    save = save_sharded if kind == "sharded" else save_replicated
    save(tmp_path / "with", state_of(model), {"step": 1, "hf_config": hf_config})
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # other files are kept
    (out / "training_args.bin").write_bytes(b"")
    code, stdout, err = run(capsys, ["consolidate", str(tmp_path / "with"), str(tmp_path / "fp32"),
                                     "--hf"])
    assert code == 0, err
    assert "LlamaForCausalLM (float32)" in stdout
    upcast = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"))
    assert upcast.dtype == torch.float32
    assert all(torch.equal(upcast.state_dict()[k], v.float()) for k, v in model.state_dict().items())
    code, stdout, err = run(capsys, ["consolidate", str(tmp_path / "with"), str(out), "--hf",
                                     "--dtype", "bfloat16"])
    assert code == 0, err
    assert "LlamaForCausalLM (bfloat16)" in stdout and "config from the checkpoint's hf_config" in stdout
    with open(out / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "training_args.bin").exists()
    assert_same_model(out, model, tie=False)

    save(tmp_path / "without", state_of(model), {"step": 1})
    line = error_line(capsys, ["consolidate", str(tmp_path / "without"), str(tmp_path / "o"),
                               "--hf"], 2)
    assert f"checkpoint {tmp_path / 'without'} holds no 'hf_config' entry" in line
    assert "--config MODEL_DIR" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["sharded", "replicated"])
def test_another_model_of_the_checkpoint_by_its_entry(capsys, tmp_path, kind):
    """A checkpoint of two models (``save_checkpoint({"model": model, "ema": ema, ...})``):
    ``--model ema`` exports the second, to either format; an entry it does not hold is named."""
    import torch.distributed.checkpoint as dcp

    model, ema = tiny_llama(tie=True), tiny_llama(tie=False)
    opt = {"state": {"lm_head.weight": {"exp_avg": torch.ones(2)}}}  # an optimizer's entry
    ckpt = tmp_path / "ckpt"
    if kind == "sharded":  # as format version 3 writes it: each model under its entry
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": opt},
                     checkpoint_id=str(ckpt), no_dist=True)
        torch.save({"step": 1, "hf_config": ema.config.to_dict()}, ckpt / "extra.pt")
        (ckpt / "sharded.json").write_text(json.dumps(
            {"format_version": 3, "keys": ["ema", "model", "optimizer"],
             "models": ["model", "ema"], "optimizers": ["optimizer"]}))
    else:
        save_replicated(ckpt, model.state_dict(), {"ema": ema.state_dict(), "step": 1,
                                                   "optimizer": opt,
                                                   "hf_config": ema.config.to_dict()})
    code, stdout, err = run(capsys, ["consolidate", str(ckpt), str(tmp_path / "hf"), "--hf",
                                     "--model", "ema", "--json"])
    assert code == 0, err
    assert json.loads(stdout)["model"] == "ema"
    assert_same_model(tmp_path / "hf", ema, tie=False)
    code, _, err = run(capsys, ["consolidate", str(ckpt), str(tmp_path / "ema.safetensors"),
                                "--model", "ema"])
    assert code == 0, err
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "ema.safetensors"))
    assert sorted(got) == sorted(ema.state_dict())
    assert all(torch.equal(got[k], v) for k, v in ema.state_dict().items())
    line = error_line(capsys, ["consolidate", str(ckpt), str(tmp_path / "x.safetensors"),
                               "--model", "reference"], 2)
    assert f"checkpoint {ckpt} has no model entry 'reference' to consolidate" in line
    line = error_line(capsys, ["consolidate", str(ckpt), str(tmp_path / "y.safetensors"),
                               "--model", "optimizer"], 2)
    assert f"checkpoint {ckpt}: its 'optimizer' entry is not a model's state dict" in line
    assert not (tmp_path / "y.safetensors").exists()


def test_a_checkpoint_that_does_not_fit_the_config_writes_nothing(capsys, tmp_path):
    model = tiny_llama(tie=False)
    state = state_of(model, "_orig_module.")
    state["_orig_module.model.layers.1.mlp._checkpoint_wrapped_module.up_proj.weight"] = \
        state.pop("_orig_module.model.layers.1.mlp.up_proj.weight")  # the wrapper's prefix goes too
    state["_orig_module.extra.weight"] = torch.ones(3)
    save_sharded(tmp_path / "ckpt", state, {"step": 1})
    config = tmp_path / "three-layers"
    LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 3,
                   "intermediate_size": 48}).save_pretrained(config)
    out = tmp_path / "out"
    line = error_line(capsys, ["consolidate", str(tmp_path / "ckpt"), str(out), "--hf",
                               "--config", str(config)], 2)
    assert line.startswith(f"ray-train-xla consolidate: error: checkpoint {tmp_path / 'ckpt'} does "
                           f"not fit the LlamaForCausalLM of --config {config}")
    assert "model.layers.0.mlp.up_proj.weight: saved [64, 32] float32, into [48, 32] float32" in line
    assert "missing from the checkpoint: model.layers.2." in line
    assert "in the checkpoint but not in the LlamaForCausalLM" in line and "extra.weight" in line
    assert "_checkpoint_wrapped_module" not in line and "_orig_module" not in line
    # A config that ties weights the checkpoint holds apart.
    tied_config = tmp_path / "tied"
    LlamaConfig(**{**model.config.to_dict(), "tie_word_embeddings": True}).save_pretrained(tied_config)
    save_replicated(tmp_path / "untied", state_of(model), {})
    line = error_line(capsys, ["consolidate", str(tmp_path / "untied"), str(out), "--hf",
                               "--config", str(tied_config / "config.json")], 2)
    assert "ties lm_head.weight to model.embed_tokens.weight" in line and "different values" in line
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "three-layers", "tied", "untied"]  # nothing written


def test_refusals_are_one_line(capsys, tmp_path, monkeypatch):
    model = tiny_llama(tie=True)
    ckpt = tmp_path / "ckpt"
    save_replicated(ckpt, state_of(model), {"hf_config": model.config.to_dict()})
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    line = error_line(capsys, ["consolidate", str(ckpt), str(a_file), "--hf"], 2)
    assert f"OUT_DIR {a_file} is a file" in line
    held = tmp_path / "held"
    held.mkdir()
    (held / "model.safetensors").write_bytes(b"")
    line = error_line(capsys, ["consolidate", str(ckpt), str(held), "--hf"], 2)
    assert f"OUT_DIR {held} already holds a model (model.safetensors)" in line
    assert (held / "model.safetensors").read_bytes() == b""  # not overwritten
    old_weights = tmp_path / "old-weights"
    old_weights.mkdir()
    (old_weights / "pytorch_model.bin").write_bytes(b"")
    line = error_line(capsys, ["consolidate", str(ckpt), str(old_weights), "--hf"], 2)
    assert "already holds a model (pytorch_model.bin)" in line
    for extra, words in [
        (["--torch", str(tmp_path / "x.pt")], "--torch does not go with --hf"),
        (["--max-shard-size", "5 potatoes"], "--max-shard-size '5 potatoes' is not a size"),
        (["--max-shard-size", "0MB"], "--max-shard-size '0MB' is not a size"),
        (["--config", str(tmp_path / "nowhere")], f"--config {tmp_path / 'nowhere'} does not exist"),
        (["--config", str(held)], f"--config {held} holds no config.json"),
        (["--config", str(a_file)], "cannot read"),
    ]:
        assert words in error_line(capsys, ["consolidate", str(ckpt), str(tmp_path / "o"), "--hf",
                                            *extra], 2)
    line = error_line(capsys, ["consolidate", str(ckpt), str(tmp_path / "o.safetensors"),
                               "--config", str(held)], 2)
    assert "--config, --max-shard-size and --dtype go with --hf" in line
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    line = error_line(capsys, ["consolidate", str(ckpt), str(tmp_path / "o"), "--hf"], 1)
    assert "pip install transformers" in line
    assert sorted(os.listdir(tmp_path)) == ["a-file", "ckpt", "held", "old-weights"]


def test_help_says_how_to_export_for_hugging_face(capsys):
    assert main(["consolidate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--hf", "save_pretrained", "--config MODEL_DIR", "--max-shard-size SIZE",
                  "hf_config", "never overwritten", "--dtype DTYPE", "one tensor at a time"):
        assert words in text, words


# A fresh interpreter where torch_xla cannot be imported (as in test_core_imports.py), and where
# every attempt to find it is counted: Transformers and Accelerate, which import it at their
# import where it is installed, must not even look for it.
WITHOUT_XLA = r"""
import importlib.abc, json, os, sys

tried = []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch_xla":
            tried.append(name)
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
from ray_train_xla.tools.cli import main
assert main(["consolidate", sys.argv[1], sys.argv[2], "--hf", "--json"]) == 0
assert "torch_xla" not in sys.modules
assert not tried, tried  # so, where it is installed, it is not imported either
assert "USE_TORCH_XLA" not in os.environ  # set only while Transformers was imported and used
print("ok")
"""


def test_without_torch_xla(tmp_path):
    model = tiny_llama(tie=True)
    save_sharded(tmp_path / "ckpt", state_of(model, "_orig_module."),
                 {"step": 1, "hf_config": model.config.to_dict()})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")]))
    env.pop("USE_TORCH_XLA", None)
    proc = subprocess.run([sys.executable, "-c", WITHOUT_XLA, str(tmp_path / "ckpt"),
                           str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "ok" and json.loads(lines[0])["tied"] == ["lm_head.weight"]
    assert_same_model(tmp_path / "out", model, tie=True)


# Run in a fresh interpreter, so that memory freed by the test's own work (building and saving
# the checkpoint) does not hide what the export allocates: the imports and first-use costs on a
# tiny checkpoint first, then the export measured, through a pyarrow filesystem object that
# counts the bytes read.
STREAMED_EXPORT = r"""
import json, sys
import pyarrow.fs
from fsspec.implementations.local import LocalFileSystem
sys.path.insert(0, sys.argv[2])
from host_memory import PeakGrowth
from ray_train_xla.tools.consolidate import consolidate_hf

read = [0]
class Counting(LocalFileSystem):
    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode=mode, **kwargs)
        plain = f.read
        def counted(*args):
            data = plain(*args)
            read[0] += len(data)
            return data
        f.read = counted
        return f

root = sys.argv[1]
fs = pyarrow.fs.SubTreeFileSystem(root, pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(Counting())))
consolidate_hf("tiny", root + "/warm", filesystem=fs, dtype="bfloat16")
read[0] = 0
with PeakGrowth() as growth:
    summary = consolidate_hf("run/checkpoint_000001", root + "/hf", filesystem=fs, dtype="bfloat16",
                             max_shard_size="40MB")
print(json.dumps({"summary": summary, "growth": growth.bytes, "read": read[0]}))
"""


def test_streams_only_the_models_tensors_from_a_filesystem_object(tmp_path):
    """A sharded checkpoint with AdamW state, reached through a pyarrow filesystem object (no
    ``://`` in the path): only the model's tensors are read, and the export, converted to
    bfloat16, grows the peak memory of the process by a few of the largest tensors, far less
    than the model."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4000, hidden_size=384, intermediate_size=1024,
                         num_hidden_layers=24, num_attention_heads=6, num_key_value_heads=6,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    state = state_of(model)
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    optim = {"state": {k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
                       for k, v in state.items()}}
    ckpt = tmp_path / "run" / "checkpoint_000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state, "optimizer": optim}, checkpoint_id=str(ckpt), no_dist=True)
    torch.save({"step": 3, "hf_config": config.to_dict()}, ckpt / "extra.pt")
    del optim, model
    tiny = tiny_llama(tie=False)
    save_sharded(tmp_path / "tiny", state_of(tiny), {"hf_config": tiny.config.to_dict()})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", STREAMED_EXPORT, str(tmp_path), TESTS_DIR],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    growth, read = result["growth"], result["read"]
    print(f"model {model_bytes / 2**20:.1f} MiB (largest tensor {largest / 2**20:.1f} MiB); "
          f"peak growth {growth / 2**20:.1f} MiB; read {read / 2**20:.1f} MiB")
    assert result["summary"]["dtype"] == "bfloat16" and result["summary"]["shards"] >= 2
    # Every model byte once, plus the metadata and extra.pt; none of the optimizer state.
    assert model_bytes <= read <= model_bytes + 2 * 2**20
    assert growth <= 3 * largest + 40 * 2**20 < model_bytes / 3
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)) for k, v in state.items())


def test_max_shard_size_is_parsed_as_huggingface_hub_parses_it():
    """``--max-shard-size`` reads a size as save_pretrained does (huggingface_hub's parser, whose
    name is private there): the same bytes for every spelling it takes; what it refuses, and
    zero, are refused here with the fix named."""
    from huggingface_hub.serialization._base import parse_size_to_int

    from ray_train_xla.tools.consolidate import NotConsolidatableError, _shard_size

    for size in ["5GB", "500MB", "1.5GB", "10kb", " 2 TB ", "0.25 mb", "7KB"]:
        assert _shard_size(size) == parse_size_to_int(size), size
    assert _shard_size(12345) == _shard_size("12345") == 12345  # bytes, as an int is there
    for bad in ["5 potatoes", "GB", "5B", "MB5"]:
        with pytest.raises(ValueError):
            parse_size_to_int(bad)
        with pytest.raises(NotConsolidatableError, match="is not a size"):
            _shard_size(bad)
    for empty in ["0MB", "-1MB"]:  # sizes there, but no shard holds a tensor
        assert parse_size_to_int(empty) <= 0
        with pytest.raises(NotConsolidatableError, match="is not a size"):
            _shard_size(empty)
