"""``ray-train-xla plan --model``: parameter counts equal what transformers builds, the memory per
device and per host, the published device memory, and the refusal of a layout that does not fit.
No Ray; transformers and torch only to build models on the meta device."""

import json
import math
import subprocess
import sys

import pytest

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning.memory import (
    FAMILIES,
    GIB,
    device_memory,
    load_model_config,
    model_shape,
    parse_size,
    plan_memory,
)
from ray_train_xla.tools.cli import main

LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "tie_word_embeddings": False}
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)
SMALL = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _small_configs():
    transformers = pytest.importorskip("transformers")
    return {
        "llama": transformers.LlamaConfig(**SMALL),
        "llama-biases-head_dim": transformers.LlamaConfig(**SMALL, attention_bias=True,
                                                          mlp_bias=True, head_dim=24),
        "qwen2-tied": transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
        "mistral-head_dim": transformers.MistralConfig(**SMALL, head_dim=24),
        "gemma": transformers.GemmaConfig(**SMALL, head_dim=16),
        "gemma2": transformers.Gemma2Config(**SMALL, head_dim=16),
        "qwen3-bias": transformers.Qwen3Config(**SMALL, head_dim=16, attention_bias=True),
    }


CASES = ["llama", "llama-biases-head_dim", "qwen2-tied", "mistral-head_dim", "gemma", "gemma2",
         "qwen3-bias"]


def _meta_model(config):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("case", CASES)
def test_parameter_count_equals_transformers(case, tmp_path):
    config = _small_configs()[case]
    model = _meta_model(config)
    expected = sum(p.numel() for p in model.parameters())  # a tied weight once
    shape = model_shape(config.to_dict())
    assert shape.parameters == expected
    assert shape.layer_parameters == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.largest_tensor[1] == max(p.numel() for p in model.parameters())
    # The same through config.json, as save_pretrained writes it (a directory, or the file).
    config.save_pretrained(tmp_path)
    assert model_shape(load_model_config(tmp_path)).parameters == expected
    assert model_shape(load_model_config(tmp_path / "config.json")).parameters == expected


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_missing_keys_take_the_defaults_transformers_takes(model_type):
    """An older config.json may lack head_dim, num_key_value_heads, tie_word_embeddings: each
    family's config class fills them in (Gemma: head_dim 256 and tied; Mistral: 8 KV heads)."""
    from transformers import AutoConfig

    sparse = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    model = _meta_model(AutoConfig.for_model(model_type, **sparse))
    assert model_shape({"model_type": model_type, **sparse}).parameters == sum(
        p.numel() for p in model.parameters())


def test_known_sizes():
    assert model_shape(LLAMA3_8B).parameters == 8_030_261_248
    assert model_shape(LLAMA3_70B).parameters == 70_553_706_496
    assert model_shape(LLAMA3_8B).largest_tensor == ("embed_tokens", 128256 * 4096)
    assert model_shape(dict(LLAMA3_8B, tie_word_embeddings=True)).parameters == (
        8_030_261_248 - 128256 * 4096)


def test_unknown_model_type_names_the_supported_ones(tmp_path):
    with pytest.raises(XLAConfigError, match=r"model_type='bert' is not supported: expected one "
                       r"of 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2'"):
        model_shape({"model_type": "bert"})
    with pytest.raises(XLAConfigError, match="hidden_size=0 is not valid"):
        model_shape(dict(LLAMA3_8B, hidden_size=0))
    with pytest.raises(XLAConfigError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(XLAConfigError, match="a directory without config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(XLAConfigError, match="cannot be read as JSON"):
        load_model_config(tmp_path)


def test_memory_per_device_and_per_host():
    shape = model_shape(LLAMA3_8B)
    plan = plan_memory(shape, devices=256, devices_per_host=64, memory=device_memory("trn2"))
    shard = math.ceil(8_030_261_248 / 256)
    d, h = plan.per_device, plan.per_host
    assert (d["parameters"], d["gradients"], d["optimizer"]) == (2 * shard, 2 * shard, 8 * shard)
    assert d["gathered_root"] == 2 * shape.root_parameters  # embedding, norm and head, in bf16
    assert d["gathered_layers"] == 2 * 2 * shape.layer_parameters  # two layers, in bf16
    assert d["total"] == sum(v for k, v in d.items() if k != "total")
    assert h == {"at_load": 64 * 2 * shard, "at_step": 0, "at_checkpoint": 64 * 10 * shard}
    assert plan.fits
    # HSDP shards within a host only: each host's devices hold the whole model between them.
    hsdp = plan_memory(shape, devices=256, devices_per_host=64, sharding="hsdp")
    assert hsdp.shards == 64 and hsdp.per_device["parameters"] == 2 * math.ceil(8_030_261_248 / 64)
    assert hsdp.fits is None  # memory unknown: nothing to refuse
    # fp32 master weights: parameters and gradients at 4 bytes.
    fp32 = plan_memory(shape, devices=256, devices_per_host=64, param_dtype="fp32")
    assert fp32.per_device["gradients"] == 4 * shard and fp32.dtypes["compute"] == "bf16"
    with pytest.raises(XLAConfigError, match="param_dtype='fp16' is not valid"):
        plan_memory(shape, devices=8, devices_per_host=8, param_dtype="fp16")
    with pytest.raises(XLAConfigError, match="every host must hold the same"):
        plan_memory(shape, devices=10, devices_per_host=4, sharding="hsdp")


def test_70b_on_8_trn2_cores_is_refused_with_the_numbers():
    plan = plan_memory(model_shape(LLAMA3_70B), devices=8, devices_per_host=8,
                       memory=device_memory("trn2"))
    assert plan.fits is False
    with pytest.raises(XLAConfigError) as info:
        plan.check()
    message = str(info.value)
    assert "llama (70,553,706,496 parameters) needs 105.66 GiB per device" in message
    assert "FSDP over 8 devices" in message
    assert "Trainium2 logical NeuronCore (LNC=2) has 24.00 GiB" in message
    assert "at least 47 devices" in message and "--device-memory" in message
    # HSDP over hosts of 32 cores does not fit; FSDP over the same 256 does, and the error says so.
    hsdp = plan_memory(model_shape(LLAMA3_70B), devices=256, devices_per_host=32, sharding="hsdp",
                       memory=device_memory("trn2"))
    with pytest.raises(XLAConfigError, match=r"HSDP off \(FSDP over all 256 devices"):
        hsdp.check()


def test_published_device_memory():
    assert device_memory("trn2.48xlarge").bytes == 24 * GIB  # 96 GiB chip, 4 logical cores
    assert device_memory("trn2", logical_cores=1).bytes == 12 * GIB
    assert device_memory("trn1.32xlarge").bytes == 16 * GIB
    assert {t: device_memory(t).bytes // GIB for t in (
        "v4-64", "v5litepod-16", "v5e", "v5p-128", "v6e-256", "tpu7x-32", "v7x-8")} == {
        "v4-64": 32, "v5litepod-16": 16, "v5e": 16, "v5p-128": 95, "v6e-256": 32,
        "tpu7x-32": 96, "v7x-8": 96}
    assert device_memory("v3-8") is None and device_memory("") is None
    assert all(m.source for m in (device_memory("trn2"), device_memory("v6e")))


def test_parse_size():
    assert parse_size("24GiB") == parse_size("24G") == parse_size("24gb") == 24 * GIB
    assert parse_size("1.5T") == 1536 * GIB and parse_size("4096") == 4096
    for bad in ("", "GiB", "-1G", "1X", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def _write(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_cli_prints_the_table_and_json(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_8B)
    args = ["plan", "--device", "neuron", "--accelerator-type", "trn2.48xlarge",
            "--workers-per-node", "64", "--model", model]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters" in out and "Trainium2 logical NeuronCore" in out
    rows = {line.strip().split("  ")[0]: line.split()[-1] for line in out.splitlines()
            if line.startswith("  ")}
    assert rows["total"] == "4.17" and rows["at a step"] == "0.00"
    assert "fits, before activations" in out and "Not counted: activations" in out
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["parameters"] == 8_030_261_248 and plan["fits"] is True
    assert plan["layout"] == {"devices": 64, "devices_per_host": 64, "hosts": 1,
                              "sharding": "fsdp", "shards": 64, "replicas": 1}
    assert plan["device_memory"]["bytes"] == 24 * GIB
    # TPU: the slice's hosts of chips; SPMD workers count every device of their host.
    assert main(["plan", "--device", "tpu", "--accelerator-type", "v5p-128", "--nodes", "16",
                 "--workers-per-node", "4", "--model", model, "--json"]) == 0
    per_chip = json.loads(capsys.readouterr().out)
    assert main(["plan", "--device", "tpu", "--accelerator-type", "v5p-128", "--nodes", "16",
                 "--spmd", "--accelerators-per-worker", "4", "--model", model, "--json"]) == 0
    spmd = json.loads(capsys.readouterr().out)
    assert per_chip["layout"] == spmd["layout"] and spmd["layout"]["devices"] == 64
    assert spmd["device_memory"]["bytes"] == 95 * GIB


def test_cli_refuses_what_does_not_fit_with_exit_status_2(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_70B)
    assert main(["plan", "--device", "neuron", "--accelerator-type", "trn2", "--workers-per-node",
                 "8", "--model", model]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("ray-train-xla plan: error: memory plan: llama")
    assert "105.66 GiB per device" in err and "24.00 GiB" in err
    # --device-memory supplies the figure where none is published (CPU) or overrides it.
    assert main(["plan", "--workers-per-node", "8", "--model", model, "--device-memory",
                 "2TiB"]) == 0
    capsys.readouterr()
    assert main(["plan", "--workers-per-node", "8", "--model", model, "--device-memory",
                 "100GiB"]) == 2
    assert "has 100.00 GiB" in capsys.readouterr().err
    # Memory flags without --model, a Neuron type without it, a bad path: usage errors.
    for args, says in ((["--sharding", "hsdp"], "--sharding plans memory"),
                       (["--accelerator-type", "trn2"], "use it with --device neuron"),
                       (["--model", str(tmp_path / "nope")], "does not exist"),
                       (["--model", model, "--device-memory", "lots"], "is not a size"),
                       (["--model", model, "--workers-per-node", "2,1", "--sharding", "hsdp"],
                        "same number of workers")):
        assert main(["plan", *args]) == 2, args
        assert says in capsys.readouterr().err, args


BLOCKED = r"""
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "torch", "torch_xla", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
from ray_train_xla.tools.cli import main
code = main(sys.argv[1:])
print("loaded", sorted(m for m in sys.modules
                       if m.split(".")[0] in ("ray", "torch", "torch_xla", "transformers")))
sys.exit(code)
"""


def test_plan_model_needs_neither_torch_ray_nor_transformers(tmp_path):
    out = subprocess.run([sys.executable, "-c", BLOCKED, "plan", "--model",
                          _write(tmp_path, LLAMA3_8B), "--workers-per-node", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "8,030,261,248 parameters" in out.stdout and "loaded []" in out.stdout
