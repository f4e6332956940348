"""Hugging Face Hub ids where a model directory is expected: ``plan --model``,
``load_pretrained``, ``pretrained_path`` and ``export_pretrained(source=...)``
(``examples/finetune_hf.py --model``: ``test_finetune_hf_args.py``). Offline only
(``HF_HUB_OFFLINE=1``): each test lays out a Hugging Face cache by hand
(``models--org--name/refs/main``, ``snapshots/<commit>/...``) holding a tiny Llama, and points
``HF_HUB_CACHE`` at it. No test reaches the network."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning import hub
from ray_train_xla.planning.memory import load_model_config
from ray_train_xla.tools.cli import main

pytestmark = pytest.mark.native  # `make test-native` runs it again on the native torch

REPO = "org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PLAN = ["plan", "--runtime", "native", "--workers-per-node", "2", "--device-memory", "1GiB", "--json",
        "--model"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama as save_pretrained writes it: sharded safetensors with their index, a
    config naming bf16, and a tokenizer file."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("model") / "tiny")
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        path, max_shard_size="20KB")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    return path


def lay_out_cache(cache, model_dir: str, repo: str = REPO, skip: tuple[str, ...] = ()) -> str:
    """The Hugging Face cache layout of ``repo`` at COMMIT (main), holding ``model_dir``'s files
    but ``skip``; returns the snapshot directory."""
    org, name = repo.split("/")
    folder = os.path.join(cache, f"models--{org}--{name}")
    snapshot = os.path.join(folder, "snapshots", COMMIT)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(folder, "refs"))
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for file in os.listdir(model_dir):
        if file not in skip:
            shutil.copy(os.path.join(model_dir, file), snapshot)
    return snapshot


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=<tmp>/hub, for this process (huggingface_hub reads
    both at its import: its constants are set too) and its children; the working directory is
    an empty one, so that no relative path ``org/...`` exists."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def no_network(host, *args, **kwargs):
        raise AssertionError(f"a test looked up {host}: tests must not reach the network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    return str(cache)


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.hub_id("meta-llama/Llama-3.1-8B") == ("meta-llama/Llama-3.1-8B", None)
    assert hub.hub_id("Qwen/Qwen2.5-0.5B@v1.0") == ("Qwen/Qwen2.5-0.5B", "v1.0")
    assert hub.hub_id(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for not_an_id in ("gpt2", "./org/name", "/org/name", "a/b/c", "org--x/name", "org/na..me",
                      "org/name.git", "org/name@", "s3://bucket/model", "org/-name", "",
                      "org/na me"):
        assert hub.hub_id(not_an_id) is None, not_an_id
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.hub_id("org/name") is None  # a path that exists wins
    from pathlib import Path

    assert hub.hub_id(Path("other/name")) is None  # a Path is a path


def test_plan_model_reads_a_hub_ids_config_from_the_cache_offline(model_dir, offline, capsys):
    snapshot = lay_out_cache(offline, model_dir)
    assert load_model_config(REPO) == load_model_config(snapshot)
    assert load_model_config(f"{REPO}@main") == load_model_config(snapshot)
    # The CLI in a fresh process that can import neither torch, Ray nor transformers, with the
    # variables huggingface_hub reads at its import.
    code = ("import importlib.abc, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('ray', 'torch', 'torch_xla', 'transformers'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from ray_train_xla.tools.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")

    by_id = subprocess.run([sys.executable, "-c", code, *PLAN, REPO], capture_output=True,
                           text=True, timeout=120)
    assert by_id.returncode == 0, by_id.stderr
    assert main([*PLAN, snapshot]) == 0
    assert json.loads(by_id.stdout) == json.loads(capsys.readouterr().out)
    assert json.loads(by_id.stdout)["model"]["parameters"] > 0
    assert main([*PLAN, "org/unknown-model"]) == 2
    err = capsys.readouterr().err
    for says in ("org/unknown-model", offline, "HF_HUB_OFFLINE=1",
                 f"hf download org/unknown-model config.json --cache-dir {offline}"):
        assert says in err, (says, err)


def test_an_unknown_id_offline_and_a_partial_cache_are_refused_naming_the_fix(
        model_dir, offline):
    with pytest.raises(XLAConfigError) as info:
        load_model_config("org/unknown-model@v2")
    message = str(info.value)
    assert "Hugging Face Hub id org/unknown-model@v2" in message and offline in message
    assert "--revision v2" in message and "unset HF_HUB_OFFLINE" in message
    # Neither a path nor an id: today's error, which names the id as a choice too.
    with pytest.raises(XLAConfigError, match=r"does not exist: .*or a Hugging Face Hub id"):
        load_model_config("no-such-dir")
    # The config is cached, the weights are not: the weights are refused, the config read.
    index = json.load(open(os.path.join(model_dir, hub.INDEX_FILE)))
    first = sorted(set(index["weight_map"].values()))[0]
    lay_out_cache(offline, model_dir, skip=(first,))
    assert load_model_config(REPO)["model_type"] == "llama"
    with pytest.raises(FileNotFoundError) as info:
        hub.snapshot(REPO, weights=True)
    message = str(info.value)
    assert f"{first} missing" in message and offline in message
    assert '--include "model*.safetensors"' in message


def test_only_the_files_a_model_directory_needs_are_asked_for_from_the_indexs_commit(
        model_dir, offline, monkeypatch):
    """What ``snapshot_download`` is asked for: the config with the index (and the tokenizer
    files), then exactly the files the index lists, at the commit the index came from, so a
    ``consolidated.safetensors`` or ``.bin`` files beside them are never fetched."""
    import huggingface_hub

    snapshot = lay_out_cache(offline, model_dir)
    real, calls = huggingface_hub.snapshot_download, []

    def spy(repo_id, **kwargs):
        calls.append((kwargs["revision"], list(kwargs["allow_patterns"])))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    assert hub.snapshot(REPO, weights=True, tokenizer=True) == snapshot
    index = json.load(open(os.path.join(model_dir, hub.INDEX_FILE)))
    assert calls == [(None, ["config.json", hub.INDEX_FILE, *hub.TOKENIZER_FILES,
                             "generation_config.json"]),
                     (COMMIT, sorted(set(index["weight_map"].values())))]
    calls.clear()
    assert load_model_config(f"{REPO}@main")["model_type"] == "llama"
    assert calls == [("main", ["config.json"])]  # plan --model: the config alone


def test_a_gated_model_without_a_token_is_refused_naming_the_token(monkeypatch, offline):
    """A gated model, as the Hub answers without a token (huggingface_hub's own error)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def gated(repo_id, **kwargs):
        response = httpx2.Response(401, request=httpx2.Request("GET", "https://huggingface.co"))
        raise GatedRepoError(f"Access to model {repo_id} is restricted.", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(XLAConfigError) as info:
        load_model_config("meta-llama/Llama-3.1-8B")
    message = str(info.value)
    for says in ("meta-llama/Llama-3.1-8B is a gated model", "no Hugging Face token was found",
                 "https://huggingface.co/meta-llama/Llama-3.1-8B", "HF_TOKEN=", offline):
        assert says in message, (says, message)


@pytest.fixture
def one_process():
    """This process as a native CPU worker of a world of one (the planned variables the helpers
    read, and a gloo group), as inside a TorchNeuronConfig(device="cpu") fit of one worker."""
    import tempfile

    import torch.distributed as dist

    from ray_train_xla.planning import contract

    saved = {v: os.environ.get(v) for v in (contract.DEVICE_VAR, contract.RUNTIME_VAR)}
    os.environ[contract.DEVICE_VAR], os.environ[contract.RUNTIME_VAR] = "cpu", contract.NATIVE
    contract.reload()
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            contract.reload()


def test_load_pretrained_from_a_hub_id_loads_what_the_directory_holds(
        model_dir, offline, one_process, tmp_path, monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ray_train_xla.toolkit import pretrained

    snapshot = lay_out_cache(offline, model_dir)

    def loaded(source: str) -> dict:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                     dtype=torch.float32)
        model = pretrained.load_pretrained(model, source)
        return {k: v.full_tensor() for k, v in model.state_dict().items()}

    by_id, by_dir = loaded(REPO), loaded(model_dir)
    assert by_id.keys() == by_dir.keys()
    assert all(torch.equal(by_id[k], by_dir[k]) for k in by_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert all(torch.equal(by_id[k], reference[k]) for k in by_id)
    # The node's other workers take local rank 0's answer.
    assert pretrained.pretrained_path(REPO) == snapshot
    with monkeypatch.context() as patch:
        patch.setattr("ray_train_xla.toolkit.ranks.local_rank", lambda: 1)
        assert pretrained.pretrained_path(REPO) == snapshot
        with pytest.raises(TimeoutError, match="within 0.2 s"):  # rank 0 never resolved this
            pretrained.pretrained_path(f"{REPO}@{COMMIT}", timeout_s=0.2)
    # An export takes the id's config dtype and tokenizer files, as from the directory.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = str(tmp_path / "out")
    assert pretrained.export_pretrained(model, out, source=REPO)["dtype"] == "bfloat16"
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
    with pytest.raises(FileNotFoundError, match="org/unknown-model.*HF_HUB_OFFLINE=1"):
        pretrained.load_pretrained(model, "org/unknown-model")
    with pytest.raises(FileNotFoundError, match="is not a directory .*Hugging Face Hub id"):
        pretrained.load_pretrained(model, "no-such-dir")
