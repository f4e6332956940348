"""Pretrained Hugging Face models loaded sharded and exported by slices, on real Ray Train (the
shared one-node cluster), 4 CPU workers a fit:

- ``TorchNeuronConfig(device="cpu")``: a Llama of 160M parameters (320 MB in bf16, 3
  safetensors files) with untied embeddings;
- ``TorchTPUConfig(device="cpu", parallelism={"tp": 2})``: a Qwen2 of 175M parameters (349 MB
  in bf16) with tied embeddings, laid out TP 2 x FSDP 2 (each worker reads its slices of both).

Each worker first tries a checkpoint that does not fit (a renamed key, a wrong shape): refused
before anything is allocated. Then it builds the model on the meta device, loads it sharded in
bf16 (``rtx.load_pretrained``), measures its own peak memory growth during the load, computes
the logits of a fixed batch (in fp32, from the bf16 weights), takes two SGD steps on its top
block, norm and head with the rest frozen (a plain ``optimizer.step()``; the rows of its
data-parallel rank, which tensor-parallel peers share) and exports the trained model from all
four workers in the stored dtype (``rtx.export_pretrained``), measuring
again. The Llama is read as a Hugging Face Hub id from a cache laid out by hand (offline:
``HF_HUB_OFFLINE=1`` on the workers), the Qwen2 from a ``file://`` URI: each fetched once per
node, the node's other workers waiting for it. The driver compares the logits with
``from_pretrained``'s in one process, and the export's, loaded with ``from_pretrained``, with
the trained model's; ``goodput`` counts the plain steps and their time as the loop timed it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest
import torch

from conftest import connected, fit, write_record

# Two 4-worker fits on 160M and 175M models: on the torch the native stacks ship only
# (`make test-native`).
pytestmark = [pytest.mark.ray, pytest.mark.native, pytest.mark.native_only,
              pytest.mark.timeout(900)]

WORKERS = 4
STEPS = 2
PROBE = (torch.arange(64).reshape(4, 16) * 7 + 3) % 32000
SHARD = "120MB"  # the source's largest file: 3 files of the 336 MB Llama
EXPORT_SHARD = 100 * 10**6
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # of the laid-out Hub cache
# FSDP 4 (the neuron run) and TP 2 x FSDP 2 (the tpu run), under the same memory bounds.
LAYOUTS = {"neuron": None, "tpu": {"tp": 2}}


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                       max_position_embeddings=128, tie_word_embeddings=False,
                       attn_implementation="eager")


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                       max_position_embeddings=128, tie_word_embeddings=True,
                       attn_implementation="eager")


def save_source(config, path: str) -> int:
    """A random model of ``config`` saved in bf16 by ``save_pretrained`` (with tokenizer files
    to copy); its bytes."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size=SHARD)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 128}, f)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def save_mismatched(path: str) -> None:
    """A tiny Llama's files with one key renamed and one tensor of another shape."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    LlamaForCausalLM(config).save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    state["model.layers.0.mlp.gate.weight"] = state.pop("model.layers.0.mlp.gate_proj.weight")
    state["model.norm.weight"] = torch.ones(48)
    save_file(state, file, metadata={"format": "pt"})


def load_train_export(config):
    """On every worker: the refusal, the sharded load, logits, one step, the export."""
    import torch.distributed.checkpoint  # noqa: F401 - imported before the memory is measured
    from host_memory import PeakGrowth
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    import ray_train_xla as rtx

    record = {"rank": rtx.rank(), "layout": rtx.get_layout().to_text()}
    with torch.device("meta"):
        bad = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config["bad"]))
    try:
        rtx.load_pretrained(bad, config["bad"])
        record["refused"] = None
    except rtx.CheckpointMismatchError as e:
        record["refused"] = str(e)
    record["bad_still_meta"] = all(p.device.type == "meta" for p in bad.parameters())

    path = rtx.pretrained_path(config["uri"], cache_dir=config["cache"])  # once per node
    record["path"] = path
    from huggingface_hub import constants

    record["hf_offline"] = constants.HF_HUB_OFFLINE
    hf_config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    blocks = {type(model.model.layers[0])}
    with PeakGrowth() as load:
        model = rtx.load_pretrained(model, path, auto_wrap_policy=blocks,
                                    mixed_precision=MixedPrecisionPolicy(param_dtype=torch.float32))
    record["load_growth"] = load.bytes
    record["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    record["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    record["placements"] = {n: str(p.placements) for n, p in model.named_parameters()
                            if n.startswith("model.layers.0.") and n.endswith(
                                ("q_proj.weight", "o_proj.weight"))}
    probe = torch.tensor(config["probe"])
    with torch.no_grad():
        logits = model(input_ids=probe, use_cache=False).logits
    # The top is fine-tuned: the last block, the final norm and the head (tied to the embeddings
    # in Qwen2). The frozen blocks take no gradient, so backward gathers only what it trains.
    model.requires_grad_(False)
    for part in (model.model.layers[-1], model.model.norm, model.lm_head):
        part.requires_grad_(True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    dp_rank, _ = rtx.data_parallel()  # tensor-parallel peers feed the same rows
    rows = probe[dp_rank % len(probe):][:1]
    record["step_ends"] = []
    for _ in range(STEPS):  # a plain optimizer.step(), as the documented FSDP2 loop
        optimizer.zero_grad()
        model(input_ids=rows, labels=rows, use_cache=False).loss.backward()
        optimizer.step()
        record["step_ends"].append(time.time())
    record["tied_after_step"] = model.lm_head.weight is model.model.embed_tokens.weight
    # The model load_pretrained sharded is the one whose FLOPs the timeline counts, by its
    # config: a step of the rows' tokens, as a loader of the toolkit would have handed them.
    from ray_train_xla.toolkit.runtime import runtime

    record["flops"] = runtime().model_flops.per_step(rows.numel(), rows.numel() * rows.shape[1],
                                                     len(rows), 1)
    with torch.no_grad():
        trained = model(input_ids=probe, use_cache=False).logits
    with PeakGrowth() as export:
        # source: the local copy of a URI; a Hub id as is (its tokenizer files from the cache)
        summary = rtx.export_pretrained(model, config["export"],
                                        source=path if "://" in config["uri"] else config["uri"],
                                        max_shard_bytes=config["export_shard"])
    record["export_growth"] = export.bytes
    record["export"] = summary
    if rtx.rank() == 0:
        torch.save({"loaded": logits, "trained": trained}, os.path.join(config["root"], "logits.pt"))
    write_record(config, f"rank{rtx.rank()}", record)


@pytest.fixture(scope="module")
def cluster(one_node):
    with connected(one_node):
        yield one_node


@pytest.fixture(scope="module")
def mismatched():
    path = tempfile.mkdtemp(prefix="rtx-mismatched-")
    save_mismatched(path)
    return path


def run(kind: str, mismatched: str):
    from ray.train import ScalingConfig

    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig

    root = tempfile.mkdtemp(prefix=f"rtx-pretrained-{kind}-")
    source = os.path.join(root, "source")
    config = llama_config() if kind == "neuron" else qwen2_config()
    model_bytes = save_source(config, source)
    # The neuron run reads a Hub id from a Hugging Face cache laid out by hand (the snapshot's
    # files link to the source's, as the cache's link to its blobs), offline.
    hub, repo = os.path.join(root, "hub"), os.path.join(root, "hub", "models--org--llama")
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), os.path.join(snapshot, name))
    torch_config = (TorchNeuronConfig if kind == "neuron" else TorchTPUConfig)(
        device="cpu", timeout_s=300, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": hub},
        parallelism=LAYOUTS[kind])
    from ray.train import RunConfig

    _, records = fit(load_train_export, torch_config=torch_config,
                     scaling_config=ScalingConfig(num_workers=WORKERS,
                                                  resources_per_worker={"CPU": 1}),
                     run_config=RunConfig(storage_path=root, name="run"),
                     # The tpu run reads a URI, fetched once per node into "cache"; the
                     # neuron run a Hub id.
                     loop_config={"uri": f"file://{source}" if kind == "tpu" else "org/llama",
                                  "cache": os.path.join(root, "cache") if kind == "tpu" else hub,
                                  "bad": mismatched, "probe": PROBE.tolist(), "root": root,
                                  "export": os.path.join(root, "export"),
                                  "export_shard": EXPORT_SHARD})
    return root, source, model_bytes, records


def check(kind: str, mismatched: str, tied: bool) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    root, source, model_bytes, records = run(kind, mismatched)
    records = sorted((r for r in records if "rank" in r), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == list(range(WORKERS))
    assert all(r["hf_offline"] for r in records)  # env=... reached huggingface_hub's import
    tp = (LAYOUTS[kind] or {}).get("tp", 1)
    assert {r["layout"] for r in records} == {f"dp_replicate=1,dp_shard={WORKERS // tp},tp={tp}"}
    for r in records:  # over tp, q_proj split by its output rows, o_proj by its input columns
        placements = r["placements"]
        assert len(placements) == 2, placements
        for name, value in placements.items():  # (dp_shard's, tp's); FSDP's may be strided
            if tp == 1:
                assert value == "(Shard(dim=0),)", (name, value)
            else:
                assert value.count("Shard(") == 2 and value.endswith(
                    f" Shard(dim={1 if 'o_proj' in name else 0}))"), (name, value)
    if kind == "tpu":  # one copy for the node's four workers, nothing else left in the cache
        copies = os.listdir(os.path.join(root, "cache"))
        assert len(copies) == 1 and {r["path"] for r in records} == {
            os.path.join(root, "cache", copies[0])}, copies
    else:  # the Hub id's snapshot, read in place by the node's four workers
        assert {r["path"] for r in records} == {
            os.path.join(root, "hub", "models--org--llama", "snapshots", COMMIT)}
    assert len([n for n in os.listdir(source) if n.endswith(".safetensors")]) >= 3
    budget = 1.3 * model_bytes / WORKERS + 150 * 10**6  # the shards in bf16, and 150 MB
    largest = max(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16).parameters())
    for r in records:
        # Refused before anything was allocated, every key and shape named.
        assert r["refused"] and r["bad_still_meta"], r["refused"]
        assert "model.layers.0.mlp.gate_proj.weight" in r["refused"]  # missing
        assert "model.layers.0.mlp.gate.weight" in r["refused"]  # unexpected
        assert "model.norm.weight: saved [48]" in r["refused"]
        assert r["load_growth"] <= budget, (r["rank"], r["load_growth"] / 2**20, budget / 2**20)
        assert r["tied"] is tied and r["tied_after_step"] is tied
        assert r["param_dtypes"] == ["torch.bfloat16"]
        # The export holds a few tensors at a time, never the model.
        assert r["export_growth"] <= 3 * largest + 100 * 2**20, (r["rank"], r["export_growth"] / 2**20)
    print(f"{kind} ({layout_name(tp)}): model {model_bytes / 2**20:.0f} MiB; load growth per worker "
          f"{[round(r['load_growth'] / 2**20) for r in records]} MiB (bound {budget / 2**20:.0f}); "
          f"export growth {[round(r['export_growth'] / 2**20) for r in records]} MiB "
          f"(largest tensor {largest / 2**20:.0f} MiB)")
    logits = torch.load(os.path.join(root, "logits.pt"))
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).float().eval()
    with torch.no_grad():
        expected = reference(input_ids=PROBE, use_cache=False).logits
    torch.testing.assert_close(logits["loaded"], expected, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(logits["trained"], expected, atol=1e-2)  # the step changed it

    # The plain optimizer.step() calls are the steps goodput counts, timed as the loop timed
    # them: productive time is from the first step's end to the last one's (mean of the ranks).
    from ray_train_xla.toolkit.observability.goodput import goodput_of

    result = goodput_of(os.path.join(root, "run"))
    assert [max(w.steps for w in a.workers) for a in result.attempts] == [STEPS]
    # No batch came from the toolkit's loaders: no MFU, and goodput says why. The model's FLOPs
    # were known: the config's, counted on the sharded model (every weight whole).
    assert result.mfu is None and result.mfu_missing.startswith(
        "no model FLOPs a step: no batch of these steps came from prepare_data_loader"), \
        result.mfu_missing
    from transformers import AutoConfig

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.observability.flops import HF_DECODER

    seq = PROBE.shape[1]
    per_token = rtx.model_flops_per_token(AutoConfig.from_pretrained(source), seq)
    # Each device's share: under TP a group's devices split every layer's matmuls.
    assert {tuple(r["flops"]) for r in records} == {(per_token * seq / tp, HF_DECODER)}
    looped = sum(r["step_ends"][-1] - r["step_ends"][0] for r in records) / len(records)
    assert result.buckets["productive"] == pytest.approx(looped, abs=0.01 * result.wall), (
        result.buckets, looped)

    export = os.path.join(root, "export")
    files = sorted(os.listdir(export))
    weights = [n for n in files if n.endswith(".safetensors")]
    assert len(weights) >= 3 and all(n.startswith("model-0000") for n in weights), files
    assert {"config.json", "generation_config.json", "model.safetensors.index.json",
            "tokenizer_config.json"} <= set(files)
    names = []
    for n in weights:
        with safe_open(os.path.join(export, n), framework="pt") as f:
            names += list(f.keys())
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert ("lm_head.weight" in names) is not tied and len(names) == len(set(names))
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    assert exported.dtype == torch.bfloat16
    assert (exported.lm_head.weight is exported.model.embed_tokens.weight) is tied
    # The frozen blocks are exported as loaded, the trained one as trained.
    top = len(exported.model.layers) - 1
    weights = {n: p for n, p in exported.named_parameters()}
    loaded = {n: p for n, p in reference.named_parameters()}
    for name in ("model.layers.0.mlp.down_proj.weight", f"model.layers.{top}.mlp.down_proj.weight"):
        same = torch.equal(weights[name].float(), loaded[name])
        assert same is name.startswith("model.layers.0."), name
    with torch.no_grad():
        got = exported.float()(input_ids=PROBE, use_cache=False).logits
    torch.testing.assert_close(got, logits["trained"], atol=2e-4, rtol=1e-4)


def layout_name(tp: int) -> str:
    return f"TP {tp} x FSDP {WORKERS // tp}" if tp > 1 else f"FSDP {WORKERS}"


def test_llama_loads_sharded_and_exports_on_the_neuron_twin(cluster, mismatched):
    check("neuron", mismatched, tied=False)


def test_tied_qwen2_loads_tp2_fsdp2_and_exports_on_the_tpu_twin(cluster, mismatched):
    check("tpu", mismatched, tied=True)
