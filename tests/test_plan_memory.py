"""``ray-train-xla plan --model``: parameter counts equal what transformers builds, the memory per
device and per host (the staging pool's sets and the memory tier's copies), the published device
and host memory, warnings for a tight fit, the refusal of a plan that does not fit with only
remedies that were planned again, the precision a documented call produces, and the keys taken
from defaults. No Ray; transformers and torch only to build models on the meta device (and one
FSDP2 step in a process group of one)."""

import json
import math
import re
import subprocess
import sys

import pytest

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning.layout import Layout
from ray_train_xla.planning.memory import (
    DEFAULT_MAX_IN_FLIGHT,
    FAMILIES,
    GIB,
    Cluster,
    device_memory,
    host_memory,
    larger_clusters,
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
        "gemma3_text": transformers.Gemma3TextConfig(**SMALL, head_dim=16),
        "gemma3_text-untied-bias": transformers.Gemma3TextConfig(
            **SMALL, head_dim=24, tie_word_embeddings=False, attention_bias=True),
    }


CASES = ["llama", "llama-biases-head_dim", "qwen2-tied", "mistral-head_dim", "gemma", "gemma2",
         "qwen3-bias", "gemma3_text", "gemma3_text-untied-bias"]


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
                       r"of 'llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', "
                       r"'gemma3_text'"):
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
    plan = plan_memory(shape, devices=256, devices_per_host=64, memory=device_memory("trn2"),
                       activation_checkpointing=True)
    shard = math.ceil(8_030_261_248 / 256)
    d, h = plan.per_device, plan.per_host
    # The default: fp32 parameters, gradients and AdamW state, computing in bf16.
    assert (d["parameters"], d["gradients"], d["optimizer"]) == (4 * shard, 4 * shard, 8 * shard)
    assert d["gathered_root"] == 2 * shape.root_parameters  # embedding, norm and head, in bf16
    assert d["gathered_layers"] == 2 * 2 * shape.layer_parameters  # two layers, in bf16
    assert d["total"] == sum(v for k, v in d.items() if k != "total")
    one_set = 64 * 12 * shard  # a host's parameter and optimizer shards
    assert (h["at_load"], h["at_step"], h["checkpoint_set"]) == (64 * 4 * shard, 0, one_set)
    assert plan.fits
    # bf16: parameters, gradients and (as torch.optim.AdamW keeps it) the state alike.
    bf16 = plan_memory(shape, devices=256, devices_per_host=64, param_dtype="bf16")
    assert (bf16.per_device["parameters"], bf16.per_device["optimizer"]) == (2 * shard, 4 * shard)
    # HSDP shards within a host only: each host's devices hold the whole model between them.
    hsdp = plan_memory(shape, devices=256, devices_per_host=64, sharding="hsdp")
    assert hsdp.layout == Layout(dp_replicate=4, dp_shard=64) and hsdp.sharding == "hsdp"
    assert hsdp.per_device["parameters"] == 4 * math.ceil(8_030_261_248 / 64)
    assert hsdp.fits is None  # memory unknown: nothing to refuse
    with pytest.raises(XLAConfigError, match="param_dtype='fp16' is not valid"):
        plan_memory(shape, devices=8, devices_per_host=8, param_dtype="fp16")
    with pytest.raises(XLAConfigError, match="every host must hold the same"):
        plan_memory(shape, devices=10, devices_per_host=4, sharding="hsdp")
    assert Cluster(8, 64).devices_per_host == 8 and Cluster(256, 64).hosts == 4


def test_70b_on_8_trn2_cores_is_refused_with_the_numbers():
    plan = plan_memory(model_shape(LLAMA3_70B), devices=8, devices_per_host=8,
                       memory=device_memory("trn2"))
    assert plan.fits is False
    d = plan.per_device
    # The state and the gathered parameters (what the plan counted before activations), then
    # 80 layers' activations at 1 x 4096 tokens and the fp32 logits.
    assert f"{(d['total'] - d['activations'] - d['logits']) / GIB:.2f}" == "138.52"
    with pytest.raises(XLAConfigError) as info:
        plan.check()
    message = str(info.value)
    assert f"llama (70,553,706,496 parameters) needs {d['total'] / GIB:.2f} GiB per device" \
        in message
    assert "FSDP over 8 devices" in message and "(activations of 1 x 4096 tokens)" in message
    assert "Trainium2 logical NeuronCore (LNC=2) has 24.00 GiB" in message
    assert "--device-memory" in message
    # HSDP over hosts of 32 cores does not fit; FSDP over the same 256 does, and the error says so.
    hsdp = plan_memory(model_shape(LLAMA3_70B), devices=256, devices_per_host=32, sharding="hsdp",
                       memory=device_memory("trn2"), activation_checkpointing=True)
    with pytest.raises(XLAConfigError, match=r"FSDP over all 256 devices \(--sharding fsdp"):
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


def test_parse_size_reads_gib_as_2_30_and_gb_as_10_9():
    assert parse_size("24GiB") == parse_size("24G") == parse_size("24gib") == 24 * GIB
    assert parse_size("16GB") == parse_size("16gb") == 16 * 10**9  # as consolidate reads it
    assert parse_size("1.5T") == parse_size("1.5TiB") == 1536 * GIB
    assert parse_size("2TB") == 2 * 10**12 and parse_size("500MB") == 500 * 10**6
    assert parse_size("4096") == 4096
    for bad in ("", "GiB", "-1G", "1X", "0", "1GIBB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_help_texts_say_what_a_gb_is(capsys):
    assert main(["plan", "--help"]) == 0
    plan_help = "".join(capsys.readouterr().out.split())  # wrapped at spaces and hyphens
    assert "GiB(andG)are2^30bytes,GB10^9" in plan_help
    assert main(["consolidate", "--help"]) == 0
    consolidate_help = "".join(capsys.readouterr().out.split())
    assert "powersof10,theHuggingFaceconvention:5GBis5x10^9bytes" in consolidate_help


def _write(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_cli_prints_the_table_and_json(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_8B)
    args = ["plan", "--device", "neuron", "--runtime", "native", "--accelerator-type",
            "trn2.48xlarge", "--workers-per-node", "64", "--model", model]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248 parameters" in out and "Trainium2 logical NeuronCore" in out
    rows = {line.strip().split("  ")[0]: line.split()[-1] for line in out.splitlines()
            if line.startswith("  ")}
    # 1 x 4096 tokens without activation checkpointing: TP 1 needs 27.17 GiB, TP 2 fits.
    assert rows["activations"] == "12.32" and rows["logits (for the loss)"] == "1.96"
    assert rows["total"] == "17.53" and rows["at a step"] == "0.00"
    assert "FSDP 32 x TP 2 (dp_replicate=1,dp_shard=32,tp=2)" in out
    assert "Picked TP 2, the smallest that fits a device with 10% left: TP 1 needs 27.17 GiB" \
        in out
    assert "Device: 17.53 of 24.00 GiB (73%): fits" in out and "Not counted: the unsharded" in out
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["parameters"] == 8_030_261_248 and plan["fits"] is True
    assert plan["layout"] == {"devices": 64, "devices_per_host": 64, "hosts": 1,
                              "sharding": "fsdp", "shards": 32, "replicas": 1,
                              "dp_replicate": 1, "dp_shard": 32, "tp": 2,
                              "text": "dp_replicate=1,dp_shard=32,tp=2",
                              "describe": "FSDP 32 x TP 2"}
    assert plan["picked"]["tp"] == 2 and [t["tp"] for t in plan["picked"]["tried"]] == [1, 2]
    assert plan["activations"]["seq_len"] == 4096 and plan["activations"]["micro_batch"] == 1
    assert plan["device_memory"]["bytes"] == 24 * GIB
    assert plan["host_memory"]["bytes"] == 2048 * GIB
    # TPU: the slice's hosts of chips; SPMD workers count every device of their host.
    assert main(["plan", "--device", "tpu", "--runtime", "native", "--accelerator-type",
                 "v5p-128", "--nodes", "16", "--workers-per-node", "4", "--model", model,
                 "--json"]) == 0
    per_chip = json.loads(capsys.readouterr().out)
    assert main(["plan", "--device", "tpu", "--accelerator-type", "v5p-128", "--nodes", "16",
                 "--spmd", "--accelerators-per-worker", "4", "--model", model, "--json"]) == 0
    spmd = json.loads(capsys.readouterr().out)
    assert per_chip["layout"] == spmd["layout"] and spmd["layout"]["devices"] == 64
    assert spmd["device_memory"]["bytes"] == 95 * GIB
    # FSDPv2 has no mixed precision: an fp32 model computes (and gathers) in fp32.
    assert (per_chip["dtypes"]["compute"], spmd["dtypes"]["compute"]) == ("bf16", "fp32")


def test_cli_refuses_what_does_not_fit_with_exit_status_2(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_70B)
    assert main(["plan", "--device", "neuron", "--runtime", "native", "--accelerator-type",
                 "trn2", "--workers-per-node", "8", "--model", model]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("ray-train-xla plan: error: memory plan: llama")
    assert "241.93 GiB per device with FSDP over 8 devices" in err and "24.00 GiB" in err
    assert "with TP 2: 197.72 GiB, TP 4: 175.61 GiB, TP 8: 164.57 GiB" in err  # tried, smallest first
    # --device-memory supplies the figure where none is published (CPU) or overrides it.
    native = ["plan", "--runtime", "native", "--workers-per-node", "8", "--model", model]
    assert main(native + ["--device-memory", "2TiB"]) == 0
    capsys.readouterr()
    assert main(native + ["--device-memory", "100GiB"]) == 2
    assert "has 100.00 GiB" in capsys.readouterr().err
    # Memory flags without --model, a Neuron type without it, a bad path: usage errors.
    for args, says in ((["--sharding", "hsdp"], "--sharding plans memory"),
                       (["--max-in-flight", "1"], "--max-in-flight plans memory"),
                       (["--host-memory", "1TiB"], "--host-memory plans memory"),
                       (["--accelerator-type", "trn2"], "use it with --device neuron"),
                       (["--runtime", "native", "--model", str(tmp_path / "nope")],
                        "does not exist"),
                       (native[1:] + ["--device-memory", "lots"], "is not a size"),
                       (["--runtime", "native", "--model", model, "--workers-per-node", "2,1",
                         "--sharding", "hsdp"], "same number of workers")):
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
    out = subprocess.run([sys.executable, "-c", BLOCKED, "plan", "--runtime", "native", "--model",
                          _write(tmp_path, LLAMA3_8B), "--workers-per-node", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "8,030,261,248 parameters" in out.stdout and "loaded []" in out.stdout


# ---- what a host holds at a checkpoint --------------------------------------------------------

TRN2 = ["plan", "--device", "neuron", "--runtime", "native", "--accelerator-type",
        "trn2.48xlarge", "--workers-per-node", "64"]
# Activation checkpointing and sequence parallelism: the layout a 70B model trains with there.
TRN2_AC = TRN2 + ["--activation-checkpointing", "--sequence-parallel"]
V6E_16 = ["plan", "--device", "tpu", "--runtime", "native", "--accelerator-type", "v6e-16",
          "--nodes", "4", "--workers-per-node", "4"]


def test_a_checkpoint_counts_the_staging_pool_and_the_memory_tier():
    """The staging pool lends up to max_in_flight + 1 sets of a host's parameter and optimizer
    shards; the memory tier keeps two generations of its own and two of its peer's, and passes
    one of each through Ray's object store while handing them over."""
    from ray_train_xla.toolkit.runtime import ReportOptions

    assert DEFAULT_MAX_IN_FLIGHT == ReportOptions().max_in_flight == 2
    shape = model_shape(LLAMA3_70B)
    one = plan_memory(shape, devices=64, devices_per_host=64, param_dtype="bf16")
    h = one.per_host
    one_set = 64 * (2 + 4) * math.ceil(shape.parameters / 64)
    assert h["checkpoint_set"] == one_set and h["staging"] == 3 * one_set == h["peak"]
    assert f"{h['staging'] / GIB:.0f}" == "1183"  # 70B on one trn2.48xlarge: not 394 GiB
    assert plan_memory(shape, devices=64, devices_per_host=64, param_dtype="bf16",
                       max_in_flight=1).per_host["staging"] == 2 * one_set
    # The memory tier on one host: its own two generations, no peer.
    tier = plan_memory(shape, devices=64, devices_per_host=64, param_dtype="bf16",
                       memory_every=10).per_host
    assert (tier["memory_tier_own"], tier["memory_tier_peer"], tier["memory_tier_in_flight"]) == \
        (2 * one_set, 0, 0)
    assert tier["peak"] == 5 * one_set == tier["shared_memory"]  # staged sets and slots: /dev/shm
    # Two hosts: the peer's two generations, and one of each in flight.
    two = plan_memory(shape, devices=128, devices_per_host=64, param_dtype="bf16",
                      memory_every=10)
    half = two.per_host["checkpoint_set"]
    assert (two.per_host["memory_tier_peer"], two.per_host["memory_tier_in_flight"]) == \
        (2 * half, 2 * half)
    assert two.per_host["peak"] == (3 + 2 + 2 + 2) * half
    # FSDPv2 (torch_xla SPMD): staged and formatted in the training process too, no /dev/shm.
    xla = plan_memory(shape, devices=128, devices_per_host=64, param_dtype="bf16",
                      memory_every=10, stack="fsdpv2").per_host
    assert xla["memory_tier_in_flight"] == 4 * half and xla["shared_memory"] == 0


def test_the_host_is_compared_with_its_published_memory(tmp_path, capsys):
    assert host_memory("trn2.48xlarge").bytes == 2048 * GIB
    assert host_memory("trn1.32xlarge").bytes == 512 * GIB and host_memory("trn2") is None
    assert host_memory("v6e-16") is None
    model = _write(tmp_path, LLAMA3_70B)
    # fp32 master weights: three staged sets of 789 GiB exceed the 2 TiB of a trn2.48xlarge
    # (TP 8 fits the devices: its replicated norms make the sets a little larger than TP 1's).
    assert main(TRN2_AC + ["--model", model]) == 2
    err = capsys.readouterr().err
    assert "needs up to 2365.81 GiB per host at a checkpoint (3 staged sets), but a " \
           "trn2.48xlarge has 2048.00 GiB" in err and "GiB per device with" not in err
    assert main(TRN2_AC + ["--model", model, "--param-dtype", "bf16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["per_host"]["peak"] == plan["per_host"]["staging"] and plan["fits"] is True
    # The memory tier's slots on top: 96% of the host, a warning that says what is left.
    assert main(TRN2_AC + ["--model", model, "--param-dtype", "bf16", "--memory-every", "10"]) \
        == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "memory tier: own generations (2) 788.51" in out
    assert "Host: 1971.28 of 2048.00 GiB (96%): Warning: fits, but leaves only 76.72 GiB for " \
           "the OS, Ray, data loading and the runtime" in out
    # --host-memory where none is published (a TPU VM), as GB (10^9 bytes).
    v6e_64 = _apply(V6E_16, "--accelerator-type v6e-64 --nodes 16")
    assert main(v6e_64 + ["--model", model, "--param-dtype", "bf16", "--host-memory", "50GB",
                          "--activation-checkpointing"]) == 2
    assert "up to 73.92 GiB per host at a checkpoint (3 staged sets), but a host has 46.57 GiB" \
        in capsys.readouterr().err


def test_a_fit_above_90_percent_is_a_warning_that_says_what_is_left(tmp_path, capsys):
    """--tp 1 plans that TP (no pick): it fits at 99%, a warning."""
    model = _write(tmp_path, LLAMA3_70B)
    args = TRN2_AC + ["--model", model, "--param-dtype", "bf16", "--tp", "1"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Device: 23.66 of 24.00 GiB (99%): Warning: fits, but leaves only 0.34 GiB for " \
           "the runtime, the compiler and what is not counted" in out
    assert "Picked" not in out
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and "picked" not in plan and plan["warnings"] == [
        "23.66 of 24.00 GiB per device (99%) leaves only 0.34 GiB for the runtime, the "
        "compiler and what is not counted"]


# ---- remedies: planned again, and only those that fit ------------------------------------------

def _remedies(err: str) -> list[str]:
    """The flags of each remedy of a refusal, as '(--flag value ...: figures)'."""
    return [flags for flags, _ in _offered(err)]


def _offered(err: str) -> list[tuple[str, str]]:
    """(flags, GiB per device) of each remedy of a refusal."""
    return re.findall(r"\((--[^:()]*|without --memory-every[^:()]*): ([\d.]+) GiB per device",
                      err)


SWITCHES = {"--activation-checkpointing", "--sequence-parallel", "--loss-parallel", "--spmd"}


def _apply(args: list[str], flags: str) -> list[str]:
    """``args`` with each '--flag value' (or '--switch') of ``flags`` set (or 'without --flag'
    removed)."""
    args = list(args)
    if flags.startswith("without "):
        i = args.index(flags.split()[1])
        return args[:i] + args[i + 2:]
    words = flags.split()
    while words:
        flag = words.pop(0)
        if flag in SWITCHES:
            args += [] if flag in args else [flag]
            continue
        value = words.pop(0)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


@pytest.mark.parametrize("case", ["trn2-host", "v6e-16", "v5p-64-hsdp", "trn2-tier",
                                  "trn2-replicas"])
def test_every_remedy_offered_fits_when_planned(case, tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_70B)
    args = {"trn2-host": TRN2_AC,
            "v6e-16": V6E_16,
            "v5p-64-hsdp": ["plan", "--device", "tpu", "--runtime", "native",
                            "--accelerator-type", "v5p-64", "--nodes", "8",
                            "--workers-per-node", "4", "--sharding", "hsdp",
                            "--activation-checkpointing"],
            "trn2-tier": TRN2_AC + ["--param-dtype", "bf16", "--memory-every", "10",
                                    "--max-in-flight", "3"],
            "trn2-replicas": TRN2_AC + ["--nodes", "2", "--dp-replicate", "2"]}[case] + [
                "--model", model]
    assert main(args) == 2
    err = capsys.readouterr().err
    offered = _offered(err)
    assert offered, err
    for flags, figure in offered:
        assert main(_apply(args, flags) + ["--json"]) == 0, (flags, capsys.readouterr().err)
        plan = json.loads(capsys.readouterr().out)
        assert plan["fits"] is not False and not plan["warnings"], flags
        # What it says is what plan then plans (it picks the same TP).
        assert f"{plan['per_device']['total'] / GIB:.2f}" == figure, flags
    fixes = [flags for flags, _ in offered]
    if case == "v6e-16":
        # Nothing fits 16 chips, whatever the TP, nor any slice as it is; the smallest v6e
        # slice size that fits is offered, with the changes and the TP plan picks there (not
        # "6 hosts of 4").
        assert "hosts of 4 devices with" not in err
        assert fixes == ["--accelerator-type v6e-32 --nodes 8 --activation-checkpointing "
                         "--param-dtype bf16"]
        assert "v6e-32 slice (8 hosts of 4 devices) with FSDP 16 x TP 2 (32 devices)" in err
    if case == "v5p-64-hsdp":
        # FSDP over the job's own 32 devices fits: no smaller (9 devices) or larger cluster.
        assert fixes == ["--sharding fsdp"] and "9 devices" not in err
        assert "use FSDP over all 32 devices (--sharding fsdp" in err
    if case == "trn2-replicas":
        # Each replica (a node) holds the whole state: FSDP over both nodes halves a host's.
        assert fixes[0] == "--dp-replicate 1" and "use FSDP 64 x TP 2 (128 devices) (" in err
    if case == "trn2-tier":
        # four staged sets and the tier's two slots: 2365 GiB; either alone fits a 2 TiB host
        assert fixes == ["--max-in-flight 1", "without --memory-every", "--nodes 3"]


def test_larger_clusters_are_real_sizes_of_the_same_hardware():
    v6e = [(s.label, s.flags) for s in larger_clusters(Cluster(16, 4), accelerator_type="v6e-16")]
    assert v6e == [(f"a v6e-{n} slice ({n // 4} hosts of 4 devices)",
                    f"--accelerator-type v6e-{n} --nodes {n // 4}") for n in (32, 64, 128, 256)]
    # A single host of 8 chips grows into hosts of 4; v5p counts TensorCores (2 a chip);
    # TPU7x has two devices a chip; with --spmd the flags name each worker's chips.
    assert next(iter(larger_clusters(Cluster(8, 8), accelerator_type="v6e-8"))).flags == \
        "--accelerator-type v6e-16 --nodes 4 --workers-per-node 4"
    v5p = next(iter(larger_clusters(Cluster(32, 4), accelerator_type="v5p-64")))
    assert (v5p.cluster.devices, v5p.flags) == (64, "--accelerator-type v5p-128 --nodes 16")
    v7x = next(iter(larger_clusters(Cluster(32, 8), accelerator_type="tpu7x-32", spmd=True)))
    assert (v7x.cluster.devices, v7x.cluster.devices_per_host) == (64, 8)
    assert v7x.flags == "--accelerator-type tpu7x-64 --nodes 8"
    # Trainium (or unknown hardware): more hosts like these, from the first that could fit.
    trn = larger_clusters(Cluster(64, 64), 200)
    assert [next(trn).flags, next(trn).flags] == ["--nodes 4", "--nodes 5"]


def test_a_model_no_fsdp_layout_fits_is_told_so():
    wide = dict(LLAMA3_70B, vocab_size=2_000_000, hidden_size=16384)  # 2 x 61 GiB root
    plan = plan_memory(model_shape(wide), devices=64, devices_per_host=4,
                       memory=device_memory("v6e"))
    with pytest.raises(XLAConfigError, match=r"no layout tried fits: TP among \[1, 2, 4\], with "
                       "and without activation checkpointing, sequence parallelism and bf16"):
        plan.check()


# ---- a config that cannot shard -----------------------------------------------------------------

@pytest.mark.parametrize("device", ["tpu", "neuron", "cpu"])
def test_torch_xla_without_spmd_is_told_how_to_shard(device, tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_8B)
    assert main(["plan", "--device", device, "--workers-per-node", "4", "--model", model]) == 2
    err = capsys.readouterr().err
    assert "without spmd=True does not shard: prepare_sharded_model refuses there" in err
    assert "--spmd" in err and "--runtime native" in err
    fixed = ["--runtime", "native"] if device != "cpu" else ["--spmd",
                                                            "--cpu-devices-per-worker", "4"]
    workers = "1" if "--spmd" in fixed else "4"
    assert main(["plan", "--device", device, "--workers-per-node", workers, "--model", model,
                 *fixed]) == 0, capsys.readouterr().err


# ---- the precision a documented call produces ---------------------------------------------------

def test_the_default_precision_is_what_prepare_sharded_model_bf16_and_adamw_make(tmp_path):
    """One FSDP2 step in a process group of one, with the package's mixed_precision="bf16"
    policy: an fp32 model keeps fp32 parameters, gradients and AdamW state; a bf16 model keeps
    bf16 ones. The plan's default and its bf16 choice are those, and name the calls."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_train_xla.toolkit.fsdp2 import mixed_precision_policy

    made = {}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(dtype)
            gathered: list = []
            model[0].register_forward_pre_hook(
                lambda m, a, seen=gathered: seen.append(m.weight.dtype))
            fully_shard(model, mesh=mesh, mp_policy=mixed_precision_policy("bf16"))
            opt = torch.optim.AdamW(model.parameters())
            model(torch.ones(2, 8, dtype=dtype)).float().sum().backward()
            opt.step()
            p = next(model.parameters())
            made[name] = (p.dtype, p.grad.dtype, opt.state[p]["exp_avg"].dtype, gathered[0])
    finally:
        dist.destroy_process_group()
    bf16, fp32 = torch.bfloat16, torch.float32
    assert made == {"fp32": (fp32, fp32, fp32, bf16), "bf16": (bf16, bf16, bf16, bf16)}
    shape = model_shape(LLAMA3_8B)
    default = plan_memory(shape, devices=8, devices_per_host=8).precision
    assert (default.parameters, default.gradients, default.optimizer, default.compute) == \
        ("fp32", "fp32", "fp32", "bf16")
    assert 'mixed_precision="bf16"' in default.call and "torch.optim.AdamW" in default.call
    half = plan_memory(shape, devices=8, devices_per_host=8, param_dtype="bf16").precision
    assert (half.parameters, half.gradients, half.optimizer, half.compute) == ("bf16",) * 4
    assert "dtype=torch.bfloat16" in half.call
    # A state dtype AdamW does not keep is planned, and said to need an optimizer of one's own.
    mixed = plan_memory(shape, devices=8, devices_per_host=8, param_dtype="bf16",
                        optimizer_dtype="fp32").precision
    assert "needs an optimizer of your own" in mixed.call


def test_the_precision_call_is_in_the_table_and_the_help(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_8B)
    assert main(TRN2 + ["--model", model]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Precision: fp32 parameters, fp32 gradients, fp32 AdamW state, bf16 compute: " \
           "load_pretrained(model, path, dtype=torch.float32, mixed_precision=\"bf16\")" in out
    assert main(TRN2 + ["--model", model, "--json"]) == 0
    assert "mixed_precision" in json.loads(capsys.readouterr().out)["precision_call"]
    assert main(["plan", "--help"]) == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps at spaces and hyphens
    for says in ("fp32 (default): load_pretrained(model, path, dtype=torch.float32, "
                 "mixed_precision='bf16')", "bf16: load_pretrained(model, path, "
                 "dtype=torch.bfloat16)", "default: --param-dtype's, as torch.optim.AdamW "
                 "keeps them", "gemma2 or gemma3_text"):
        assert "".join(says.split()) in text, says


# ---- defaults and the families transformers builds otherwise ------------------------------------

def test_keys_taken_from_defaults_are_listed(tmp_path, capsys):
    assert model_shape(LLAMA3_70B).defaults == {"head_dim": 128, "attention_bias": False,
                                                "mlp_bias": False}
    full = dict(LLAMA3_70B, head_dim=128, attention_bias=False, mlp_bias=False)
    assert model_shape(full).defaults == {}
    bare = _write(tmp_path, {"model_type": "llama"})
    assert main(["plan", "--runtime", "native", "--workers-per-node", "8", "--model", bare]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Warning: Defaults: hidden_size=4096, num_attention_heads=32, vocab_size=32000" in out
    assert "(the plan is of the default vocab_size, hidden_size, intermediate_size" in out
    assert main(["plan", "--runtime", "native", "--workers-per-node", "8", "--model", bare,
                 "--json"]) == 0
    defaults = json.loads(capsys.readouterr().out)["model"]["defaults"]
    assert defaults["num_hidden_layers"] == 32 and defaults["num_key_value_heads"] == 32


def test_llama4_and_multimodal_gemma3_are_refused_saying_why():
    """Llama 4's text decoder is a mixture of experts (transformers builds experts), and the
    gemma3 model_type is the multimodal model: neither is the Llama shape."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sparse = dict(SMALL, intermediate_size_mlp=96, num_local_experts=2)
    model = _meta_model(AutoConfig.for_model("llama4_text", **sparse))
    assert any("experts" in name for name, _ in model.named_modules())
    with pytest.raises(XLAConfigError, match=r"'llama4_text' is Llama 4's text decoder, a "
                       r"mixture of experts.*plan_memory\(parameters"):
        model_shape({"model_type": "llama4_text", **sparse})
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["gemma3"] == "Gemma3ForConditionalGeneration"
    with pytest.raises(XLAConfigError, match="model_type 'gemma3_text'"):
        model_shape({"model_type": "gemma3"})
    with pytest.raises(XLAConfigError, match="Llama 4's multimodal model"):
        model_shape({"model_type": "llama4"})


@pytest.mark.parametrize("runtime", ["pjrt", "native"])
def test_memory_every_is_the_configs_option_in_the_environment_plan(runtime, capsys):
    from ray_train_xla.planning.contract import MEMORY_EVERY_VAR

    assert main(["plan", "--runtime", runtime, "--workers-per-node", "2", "--memory-every", "5",
                 "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["env"][MEMORY_EVERY_VAR] for p in plans] == ["5", "5"]


# ---- the layout: tensor parallelism, activations, the TP plan picks ------------------------------

LLAMA3_405B = dict(LLAMA3_8B, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                   num_attention_heads=128)
# transformers 5.25's styles (distributed/tensor_parallel.py): what each splits of a module.
SPLIT_WEIGHT_AND_BIAS = {"colwise", "colwise_gather_output", "embedding_rowwise"}  # Shard(0)
SPLIT_WEIGHT = {"rowwise"}  # weight Shard(-1), bias Replicate


def _per_tp_rank(model, tp: int) -> dict[str, int]:
    """What one rank of a TP group of ``tp`` holds of each parameter when transformers' own
    plan (``model.tp_plan``: the config's base_model_tp_plan, the head's _tp_plan and the
    vocabulary-parallel embedding) is applied: a split tensor's first rank holds ceil(n / tp)
    of its split dimension, anything the plan does not split is whole. Tied weights once."""
    import fnmatch

    plan = model.tp_plan
    out = {}
    for name, p in model.named_parameters():
        module, _, kind = name.rpartition(".")
        style = next((v for k, v in plan.items() if fnmatch.fnmatchcase(module, k)), None)
        dim = 0 if style in SPLIT_WEIGHT_AND_BIAS else \
            p.dim() - 1 if style in SPLIT_WEIGHT and kind == "weight" else None
        if dim is None:
            out[name] = p.numel()
        else:
            out[name] = p.numel() // p.shape[dim] * math.ceil(p.shape[dim] / tp)
    return out


@pytest.mark.parametrize("case", CASES)
def test_tp_shards_are_what_transformers_own_plan_splits(case):
    """Per TP rank: q/k/v, gate/up split with their biases, o/down split but not their biases,
    norms (and Qwen3's and Gemma 3's per-head q/k norms) whole, the embedding and the LM head
    split on the vocabulary, as transformers' plan for the model built on the meta device."""
    config = _small_configs()[case]
    model = _meta_model(config)
    shape = model_shape(config.to_dict())
    for tp in (1, 2):
        held = _per_tp_rank(model, tp)
        assert shape.tp_parameters(tp) == sum(held.values()), (case, tp)
        assert shape.layer_tp_parameters(tp) == sum(
            v for k, v in held.items() if k.startswith("model.layers.0."))
        assert shape.root_tp_parameters(tp) == sum(
            v for k, v in held.items() if not k.startswith("model.layers."))
    assert shape.tp_parameters(1) == shape.parameters
    # The norms are whole on every rank: a TP group holds more than the model.
    assert 2 * shape.tp_parameters(2) > shape.parameters


def test_each_device_holds_its_tp_share_sharded_over_the_data_parallel_devices():
    shape = model_shape(LLAMA3_70B)
    plan = plan_memory(shape, devices=512, devices_per_host=64, tp=8, param_dtype="bf16")
    assert plan.layout == Layout(dp_replicate=1, dp_shard=64, tp=8)
    d = plan.per_device
    assert d["parameters"] == 2 * math.ceil(shape.tp_parameters(8) / 64)
    assert d["gathered_layers"] == 2 * 2 * shape.layer_tp_parameters(8)  # a layer's TP share
    assert d["gathered_root"] == 2 * shape.root_tp_parameters(8)
    assert plan.to_json()["layout"]["describe"] == "FSDP 64 x TP 8"
    # HSDP over hosts with TP inside each: 8 replicas of FSDP 8 x TP 8.
    hsdp = plan_memory(shape, devices=512, devices_per_host=64, tp=8, sharding="hsdp")
    assert hsdp.layout == Layout(dp_replicate=8, dp_shard=8, tp=8)
    for per_host, tp, says in ((8, 16, "tp=16 does not divide the 8 devices of a host"),
                               (64, 32, "tp=32 does not divide the model's 8 key/value heads"),
                               (64, 3, "needs a multiple of 3 devices")):
        with pytest.raises(XLAConfigError, match=re.escape(says)):
            plan_memory(shape, devices=512, devices_per_host=per_host, tp=tp)
    with pytest.raises(XLAConfigError, match="tp=2 needs the model's shape"):
        plan_memory(10**9, devices=8, devices_per_host=8, tp=2)


# A small Llama: h=64, q=4 heads x 16, k=2 KV heads x 16 = 32, f=176, 3 layers, vocab 1000.
SMALL_LLAMA = {"model_type": "llama", **SMALL}


def test_activations_are_the_documented_formula():
    """Hand-counted for the small Llama at s=8 tokens, b=2, bf16 (c=2), tensor by tensor:
    norms' inputs 2*h*s, the q/k/v and gate/up inputs 2*h*s, Q+K+V+O (2q+2k)*s, the gated
    MLP 4*f*s, times c*b; the log-sum-exp 4*b*s*a."""
    shape = model_shape(SMALL_LLAMA)
    base = shape.activation_bytes(8, 2)
    per_layer = 2 * 2 * (2 * 64 * 8 + 2 * 64 * 8 + (2 * 64 + 2 * 32 + 4 * 176) * 8) + 4 * 2 * 8 * 4
    assert per_layer == 37120
    assert base == {"per_layer": 37120, "layers": 3 * 37120,
                    "root": 2 * 2 * 64 * (8 + 8),  # the final norm's and the head's inputs
                    "logits": 4 * 2 * 8 * 1000}  # fp32
    # TP 2 with SP: the norms on half the sequence, the projections' inputs whole (gathered),
    # heads and MLP width halved.
    sp = shape.activation_bytes(8, 2, tp=2, sequence_parallel=True, loss_parallel=True)
    assert sp["per_layer"] == 2 * 2 * (2 * 64 * 4 + 2 * 64 * 8 + (2 * 32 + 2 * 16 + 4 * 88) * 8) \
        + 4 * 2 * 8 * 2 == 20608
    assert sp["root"] == 2 * 2 * 64 * (4 + 8) and sp["logits"] == 4 * 2 * 8 * 500
    # Checkpointing: each layer keeps its input (c*b*s*h, /t with SP), one layer recomputed.
    ac = shape.activation_bytes(8, 2, checkpointing=True)
    assert ac["layers"] == 3 * 2 * 2 * 8 * 64 + 37120 == 43264
    ac_sp = shape.activation_bytes(8, 2, tp=2, sequence_parallel=True, checkpointing=True)
    assert ac_sp["layers"] == 3 * 2 * 2 * 4 * 64 + 20608
    # fp32 compute (FSDPv2 over fp32 parameters) doubles all but the fp32 log-sum-exp.
    assert shape.activation_bytes(8, 2, compute_bytes=4)["per_layer"] == 2 * (37120 - 256) + 256


def test_activations_match_korthikanti_without_dropout_and_scores():
    """Korthikanti et al. 2022, sec. 4.1-4.2, at 16 bits: per layer s*b*h*(34 + 5*a*s/h), and
    with TP t s*b*h*(10 + 24/t + 5*a*s/(h*t)). For an attention whose K and V have all the
    heads and an MLP whose four gated tensors of width 2h hold what GeLU's two of 4h hold,
    ours is that without the two dropout masks (2*s*b*h) and the scores (5*a*s*s*b), plus
    FlashAttention's fp32 log-sum-exp (4*s*b*a/t)."""
    h, a, s, b = 256, 8, 32, 2
    shape = model_shape({"model_type": "llama", "vocab_size": 1000, "hidden_size": h,
                         "intermediate_size": 2 * h, "num_hidden_layers": 1,
                         "num_attention_heads": a, "num_key_value_heads": a})
    for t in (1, 2, 4):
        paper = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        ours = shape.activation_bytes(s, b, tp=t)["per_layer"]
        assert ours == paper - 2 * s * b * h - 5 * a * s * s * b / t + 4 * s * b * a / t
    assert shape.activation_bytes(s, b)["per_layer"] == \
        s * b * h * (34 + 5 * a * s / h) - 2 * s * b * h - 5 * a * s * s * b + 4 * s * b * a


def test_the_table_counts_activations_at_seq_len_and_micro_batch(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_8B)
    args = TRN2 + ["--model", model, "--tp", "2", "--seq-len", "2048", "--micro-batch", "2",
                   "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    counted = model_shape(LLAMA3_8B).activation_bytes(2048, 2, tp=2)
    assert plan["per_device"]["activations"] == counted["layers"] + counted["root"]
    assert plan["per_device"]["logits"] == counted["logits"] == 4 * 2 * 2048 * 128256
    assert plan["activations"]["seq_len"] == 2048 and plan["activations"]["micro_batch"] == 2
    assert main(args + ["--activation-checkpointing", "--sequence-parallel",
                        "--loss-parallel"]) == 0
    less = json.loads(capsys.readouterr().out)
    assert less["per_device"]["activations"] < plan["per_device"]["activations"] / 5
    assert less["per_device"]["logits"] == plan["per_device"]["logits"] // 2
    # Activation flags plan memory: without --model they are refused.
    for flag in (["--seq-len", "8"], ["--micro-batch", "2"], ["--activation-checkpointing"],
                 ["--sequence-parallel"], ["--loss-parallel"]):
        assert main(["plan", "--runtime", "native", *flag]) == 2
        assert f"{flag[0]} plans memory: use it with --model" in capsys.readouterr().err


@pytest.mark.parametrize("config,nodes,flags,tp,total", [
    # 70B on one trn2.48xlarge, bf16 state (fp32's three staged sets exceed the host): TP 1
    # needs 23.66 of 24 GiB, TP 2 leaves room.
    (LLAMA3_70B, 1, ["--param-dtype", "bf16"], 2, "17.01"),
    # 405B on 8: TP 1 needs 51.86 GiB, TP 2 33.00, TP 4 23.57 (98%); TP 8 fits.
    (LLAMA3_405B, 8, [], 8, "18.86"),
])
def test_plan_picks_the_smallest_tp_that_fits_within_a_node(config, nodes, flags, tp, total,
                                                            tmp_path, capsys):
    model = _write(tmp_path, config)
    args = TRN2_AC + ["--nodes", str(nodes), "--model", model, *flags]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    layout = f"FSDP {64 * nodes // tp} x TP {tp}"
    assert f"{layout} (dp_replicate=1,dp_shard={64 * nodes // tp},tp={tp})" in out
    assert f"Picked TP {tp}, the smallest that fits a device with 10% left: TP 1 needs" in out
    assert main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["describe"] == layout and f"{plan['per_device']['total'] / GIB:.2f}" == \
        total
    tried = plan["picked"]["tried"]
    assert [t["tp"] for t in tried] == [t for t in (1, 2, 4, 8) if t <= tp]
    assert all(not t["roomy"] for t in tried[:-1]) and tried[-1]["roomy"]
    # --tp plans the TP asked for, with no pick.
    assert main(args + ["--tp", "8", "--json"]) == 0
    asked = json.loads(capsys.readouterr().out)
    assert asked["layout"]["tp"] == 8 and "picked" not in asked


def test_405b_on_8_trn2_nodes_is_offered_the_layout_that_fits(tmp_path, capsys):
    """Without activation checkpointing no TP fits; the refusal offers it with sequence
    parallelism, at the TP plan picks, and that is what plan then plans."""
    model = _write(tmp_path, LLAMA3_405B)
    args = TRN2 + ["--nodes", "8", "--model", model]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "needs 335.19 GiB per device with FSDP over 512 devices" in err
    assert "with TP 2: 206.10 GiB, TP 4: 141.56 GiB, TP 8: 109.29 GiB" in err
    assert "FSDP 64 x TP 8 (512 devices) with activation checkpointing and sequence " \
           "parallelism (--activation-checkpointing --sequence-parallel: 18.86 GiB" in err
    assert "does not model" not in err
    for flags, figure in _offered(err):
        assert main(_apply(args, flags) + ["--json"]) == 0, flags
        plan = json.loads(capsys.readouterr().out)
        assert f"{plan['per_device']['total'] / GIB:.2f}" == figure and not plan["warnings"]
    # With --tp 2 given, the offers name the TP to use instead.
    assert main(args + ["--tp", "2"]) == 2
    assert "(--tp 8 --activation-checkpointing --sequence-parallel: 18.86 GiB" in \
        capsys.readouterr().err


def test_a_tp_that_does_not_divide_the_model_is_refused_in_plans_flags(tmp_path, capsys):
    model = _write(tmp_path, LLAMA3_8B)  # 32 heads, 8 KV heads
    assert main(TRN2 + ["--model", model, "--tp", "16"]) == 2
    err = capsys.readouterr().err
    assert "the layout: --tp 16 does not divide the model's 8 key/value heads" in err
    assert "Use --tp among [1, 2, 4, 8]" in err and "parallelism=" not in err
    assert main(TRN2 + ["--model", model, "--nodes", "2", "--workers-per-node", "6,6",
                        "--tp", "4"]) == 2
    assert "--tp 4 puts ranks 4 to 7 in one tensor-parallel group across 2 nodes" in \
        capsys.readouterr().err


def test_the_layouts_benchmark_writes_what_plan_picks(tmp_path):
    """benchmarks/bench_plan_layouts.py (docs/benchmarks.md): every case either fits with the
    layout plan picked, or is refused with a remedy; 405B on 8 trn2.48xlarge with activation
    checkpointing and SP is FSDP 64 x TP 8."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks",
                        "bench_plan_layouts.py")
    spec = importlib.util.spec_from_file_location("bench_plan_layouts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plan_layouts.json").read_text())["rows"]
    assert len(rows) == 2 * 5 * 3
    assert all(r["layout"] if r["fits"] else r["first_remedy"] for r in rows)
    row = next(r for r in rows if r["model"] == "Llama-3.1-405B" and
               r["cluster"] == "trn2.48xlarge x 8" and r["setting"] == "AC + SP")
    assert (row["layout"], row["per_device_gib"]) == ("FSDP 64 x TP 8", 18.86)
    assert "| Llama-3.1-405B | trn2.48xlarge x 8 | AC + SP | FSDP 64 x TP 8 (512 devices) | " \
        "18.86 of 24.00 |" in (tmp_path / "plan_layouts.md").read_text()
