"""Memory a sharded training run needs, per device and per host, from a model's ``config.json``.

Pure: reads JSON only (neither torch, Ray nor transformers), so ``ray-train-xla plan --model``
answers "does this model fit this cluster?" before anything is started or bought.

- ``load_model_config``: a Hugging Face ``config.json`` (a model directory, the file itself, or
  a Hub id, whose ``config.json`` alone is fetched);
- ``model_shape``: the decoder's sizes (``ModelShape``), with the exact parameter count that
  ``transformers`` builds for the Llama-like families in ``FAMILIES``, and the keys taken from
  the family's defaults because the config lacks them;
- ``precision``: the dtypes of parameters, gradients, AdamW state and compute, and the call
  that produces them (``Precision``);
- ``plan_memory``: parameters, gradients and AdamW state sharded over the devices of a
  ``Layout`` (FSDP2 over every device, or HSDP: sharded within a host, replicated across
  hosts), the layers FSDP2 gathers, and what each host holds at load and at a checkpoint: the
  staging pool's sets and the memory tier's copies (``MemoryPlan``);
- ``device_memory`` / ``host_memory``: the published memory of one device of each Trainium and
  TPU generation (``DEVICE_MEMORY``) and of each Trainium instance (``HOST_MEMORY``);
  ``MemoryPlan.check`` refuses a plan that does not fit them, offering only changes that were
  planned again and fit (``larger_clusters``: the real sizes of the same hardware).

Activations are not counted: they depend on batch, sequence length and activation
checkpointing, which a config does not say. The figures are a floor to size a job against.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning.hardware import (
    TPU_GENERATIONS,
    TRAINIUM_GENERATIONS,
    TRAINIUM_INSTANCES,
    tpu_generation,
)
from ray_train_xla.planning.runtimes.tpu import tpu_slice

GIB = 1 << 30
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
SHARDINGS = ("fsdp", "hsdp")
# What shards the model: FSDP2 (``fully_shard``, the native configs) or torch_xla's FSDPv2
# (``TorchXLAConfig(spmd=True)``), which has no mixed precision: it computes in the parameters'
# dtype.
STACKS = ("fsdp2", "fsdpv2")
ADAMW_STATES = 2  # exp_avg and exp_avg_sq
# FSDP2 gathers one block for its forward (or backward) and prefetches the next one.
PREFETCH_LAYERS = 2
# A fit above this share of a device's (or a host's) memory is a warning: what is left is too
# little for activations, the runtime and the compiler (on a host: the OS, Ray, data loading).
TIGHT = 0.9
# ``rtx.configure_reports(max_in_flight=...)``'s default (``toolkit/runtime.py``,
# ``ReportOptions``): checkpoints that may wait for Ray at once. The staging pool
# (``toolkit/checkpoint/staging.py``) lends each a set of host buffers of this rank's parameter
# and optimizer shards, plus one for the snapshot waiting for a slot: up to max_in_flight + 1.
DEFAULT_MAX_IN_FLIGHT = 2
# The memory tier (``memory_every=N``, ``toolkit/checkpoint/memory/``), per host: its ranks'
# two generations (the newest complete one and the one being written: FSDP2 state in two slot
# files per rank in /dev/shm, ``rank_files.RankSlots``; torch_xla SPMD state in the node's
# store), and its peer node's two generations (``MemoryStore.put`` keeps a generation and the
# newest before it). While a generation is handed over (two or more hosts), its files pass
# through Ray's object store once on the way out and the peer's once on the way in; under
# torch_xla SPMD a generation is also staged and formatted in the training process first.
TIER_OWN_GENERATIONS = 2
TIER_PEER_GENERATIONS = 2


@dataclass(frozen=True)
class Family:
    """How one ``model_type`` of ``transformers`` builds its decoder. ``defaults``: the values
    its config class gives a key missing from ``config.json`` (transformers 5.24; a
    ``head_dim`` of None means hidden_size // num_attention_heads, a ``num_key_value_heads``
    of None the attention heads). ``qkv_bias``: True (always), False (never) or the config key
    that switches the q/k/v biases on; ``o_bias``: whether o_proj follows that key too."""

    defaults: Mapping[str, Any]
    qkv_bias: bool | str = False
    o_bias: bool = False
    mlp_bias: bool | str = False
    norms_per_layer: int = 2
    qk_norm: bool = False


def _defaults(vocab, hidden, inter, layers, heads, kv, head_dim, tie, **more) -> dict[str, Any]:
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "tie_word_embeddings": tie, **more}


# The families of the standard Llama shape: token embedding, decoder layers of attention
# (q, k, v, o projections) and a gated MLP (gate, up, down) with RMSNorms, a final norm, and an
# LM head that may share the embedding's weight. Read from transformers' modeling_<type>.py:
# Mistral builds no bias whatever its config says; Qwen2 always has q/k/v biases (not o);
# Gemma2 adds two norms around the MLP; Qwen3 normalises q and k over head_dim; Gemma 3's text
# decoder (``gemma3_text``, Gemma3ForCausalLM) does both.
FAMILIES: dict[str, Family] = {
    "llama": Family(_defaults(32000, 4096, 11008, 32, 32, None, None, False,
                              attention_bias=False, mlp_bias=False),
                    qkv_bias="attention_bias", o_bias=True, mlp_bias="mlp_bias"),
    "mistral": Family(_defaults(32000, 4096, 14336, 32, 32, 8, None, False)),
    "qwen2": Family(_defaults(151936, 4096, 22016, 32, 32, 32, None, False), qkv_bias=True),
    "qwen3": Family(_defaults(151936, 4096, 22016, 32, 32, 32, 128, False, attention_bias=False),
                    qkv_bias="attention_bias", o_bias=True, qk_norm=True),
    "gemma": Family(_defaults(256000, 3072, 24576, 28, 16, 16, 256, True, attention_bias=False),
                    qkv_bias="attention_bias", o_bias=True),
    "gemma2": Family(_defaults(256000, 2304, 9216, 26, 8, 4, 256, True, attention_bias=False),
                     qkv_bias="attention_bias", o_bias=True, norms_per_layer=4),
    "gemma3_text": Family(_defaults(262208, 2304, 9216, 26, 8, 4, 256, True,
                                    attention_bias=False),
                          qkv_bias="attention_bias", o_bias=True, norms_per_layer=4,
                          qk_norm=True),
}
# model_types of transformers that are not of that shape, and what to do instead.
NOT_LLAMA_SHAPE = {
    "gemma3": "Gemma 3's multimodal model (Gemma3ForConditionalGeneration: a SigLIP vision "
              "tower and a projector beside the decoder), which this planner does not count; "
              "to plan its text decoder alone (Gemma3ForCausalLM), give its text_config as a "
              "config.json with model_type 'gemma3_text'",
    "llama4": "Llama 4's multimodal model (Llama4ForConditionalGeneration: a vision tower "
              "beside a mixture-of-experts decoder), which this planner does not count",
    "llama4_text": "Llama 4's text decoder, a mixture of experts (Llama4TextMoe: "
                   "num_local_experts routed experts and a shared expert in the layers "
                   "moe_layers names, dense MLPs of intermediate_size_mlp elsewhere), not the "
                   "dense Llama shape this planner counts",
}
# The keys of a config whose default makes the plan another model's (rather than a detail).
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes, and from them its parameter counts. ``parameters`` counts a tied
    weight once, as ``sum(p.numel() for p in model.parameters())`` does."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    norms_per_layer: int = 2
    qk_norm: bool = False
    # Keys the config lacks (or gives as null), with the value its family's config class gives
    # them in transformers: the plan is of these values, not of the user's model.
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def layer_parameters(self) -> int:
        """One decoder layer: FSDP2's unit of gathering when each layer is sharded on its own."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, \
            self.num_key_value_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.o_bias:
            attention += h
        mlp = 3 * h * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + h
        norms = self.norms_per_layer * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def root_parameters(self) -> int:
        """Everything outside the decoder layers: embedding, final norm and LM head (FSDP2's
        root unit when the layers are its blocks)."""
        embedding = self.vocab_size * self.hidden_size
        return embedding + self.hidden_size + (0 if self.tie_word_embeddings else embedding)

    @property
    def parameters(self) -> int:
        return self.num_hidden_layers * self.layer_parameters + self.root_parameters

    @property
    def largest_tensor(self) -> tuple[str, int]:
        """(name, elements) of the largest single tensor: what one device must hold whole when
        a tensor is gathered or loaded unsharded."""
        h = self.hidden_size
        candidates = [("embed_tokens", self.vocab_size * h),
                      ("mlp projection", self.intermediate_size * h),
                      ("q_proj", self.num_attention_heads * self.head_dim * h)]
        return max(candidates, key=lambda c: c[1])

    def to_json(self) -> dict[str, Any]:
        name, size = self.largest_tensor
        return {"model_type": self.model_type, "parameters": self.parameters,
                "layers": self.num_hidden_layers, "layer_parameters": self.layer_parameters,
                "root_parameters": self.root_parameters,
                "largest_tensor": {"name": name, "elements": size},
                "tie_word_embeddings": self.tie_word_embeddings,
                "defaults": dict(self.defaults)}


def load_model_config(source: str | os.PathLike) -> dict[str, Any]:
    """The JSON of a Hugging Face config: ``source`` is a model directory holding
    ``config.json``, a JSON file, or a Hub id (``planning/hub.py``: only its ``config.json`` is
    fetched, into the Hugging Face cache). Raises XLAConfigError naming the source and what to
    give."""
    from ray_train_xla.planning import hub

    ident = hub.hub_id(source)
    if ident is not None:
        try:
            source = hub.snapshot(*ident)
        except (OSError, ImportError) as exc:
            raise XLAConfigError(f"model config: {exc}") from None
    path = os.fspath(source)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = (f"{path!r} is a directory without config.json" if os.path.isdir(path)
                 else f"{path!r} does not exist")
        raise XLAConfigError(f"model config: {where}: give a Hugging Face model directory holding "
                             f"config.json, the path of a config.json, or {hub.SOURCES}")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise XLAConfigError(f"model config {file!r} cannot be read as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise XLAConfigError(f"model config {file!r} holds a JSON {type(config).__name__}, not "
                             "an object: give a Hugging Face config.json")
    return config


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """The decoder sizes of a Hugging Face config (``config.json`` as a dict, or
    ``PretrainedConfig.to_dict()``), with the defaults of the family's config class for keys it
    lacks (listed in ``ModelShape.defaults``). Raises XLAConfigError for a model_type outside
    ``FAMILIES`` (saying why for those of ``NOT_LLAMA_SHAPE``) or a size that is not a positive
    integer."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    others = ("plan it with its parameter count through "
              "ray_train_xla.planning.memory.plan_memory(parameters, ...)")
    if model_type in NOT_LLAMA_SHAPE:
        raise XLAConfigError(f"model config: model_type={model_type!r} is "
                             f"{NOT_LLAMA_SHAPE[model_type]}: {others}")
    if family is None:
        raise XLAConfigError(
            f"model config: model_type={model_type!r} is not supported: expected one of "
            f"{', '.join(repr(t) for t in FAMILIES)} (decoders of the Llama shape); {others}")
    defaults: dict[str, Any] = {}

    def value(key: str) -> Any:
        got = config.get(key)
        if got is None:
            got = defaults[key] = family.defaults.get(key)
        return got

    def size(key: str, default: int | None = None) -> int:
        got = value(key)
        if got is None:
            got = defaults[key] = default
        if not isinstance(got, int) or isinstance(got, bool) or got < 1:
            raise XLAConfigError(f"model config ({model_type}): {key}={got!r} is not valid: "
                                 "expected a positive integer")
        return got

    def flag(key: bool | str) -> bool:
        return key if isinstance(key, bool) else bool(value(key))

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    return ModelShape(
        model_type=model_type, vocab_size=size("vocab_size"), hidden_size=hidden,
        intermediate_size=size("intermediate_size"), num_hidden_layers=size("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=size("num_key_value_heads", heads),
        head_dim=size("head_dim", hidden // heads),
        tie_word_embeddings=bool(value("tie_word_embeddings")),
        qkv_bias=flag(family.qkv_bias), o_bias=family.o_bias and flag(family.qkv_bias),
        mlp_bias=flag(family.mlp_bias), norms_per_layer=family.norms_per_layer,
        qk_norm=family.qk_norm, defaults=defaults)


@dataclass(frozen=True)
class DeviceMemory:
    """The memory of one device (the unit a worker or an SPMD device shards onto)."""

    name: str
    bytes: int
    device: str
    source: str


def _published_memory() -> dict[str, DeviceMemory]:
    """Published device memory, per device a worker (or an SPMD device) owns, from the hardware
    tables (``planning/hardware.py``, which say where each figure comes from). Where a chip has
    several devices (Trainium's NeuronCores at each LNC, TPU v7x's two), the chip's memory split
    evenly between them. Keys: ``trn1``, ``trn2`` (LNC=2) and ``trn2-lnc1``, ``trn3``,
    ``trn3-lnc1``; ``v4``, ``v5e``, ``v5p``, ``v6e``, ``v7x``."""
    table = {}
    for trn in TRAINIUM_GENERATIONS.values():
        for lnc in trn.lnc:
            per_chip = trn.cores_per_chip // lnc
            kind = ("logical" if lnc > 1 else "physical") + f" NeuronCore (LNC={lnc})"
            table[trn.name if lnc == trn.default_lnc else f"{trn.name}-lnc{lnc}"] = DeviceMemory(
                trn.name, trn.memory_gib_per_chip * GIB // per_chip,
                f"{trn.chip} {trn.core}" if trn.lnc == (1,) else f"{trn.chip} {kind}",
                f"{trn.source}: {trn.memory_gib_per_chip} GiB per chip over {per_chip} devices")
    for tpu in TPU_GENERATIONS.values():
        if tpu.memory_gib_per_chip:
            name = _TPU_ALIASES.get(tpu.name, tpu.name)
            device = (f"TPU {name} chip" if tpu.devices_per_chip == 1 else
                      f"TPU {name} device (1/{tpu.devices_per_chip} of a chip)")
            table[name] = DeviceMemory(name, tpu.memory_gib_per_chip * GIB // tpu.devices_per_chip,
                                       device, tpu.source)
    return table


_TPU_ALIASES = {"v5litepod": "v5e"}
DEVICE_MEMORY: dict[str, DeviceMemory] = _published_memory()


def device_memory(accelerator: str, logical_cores: int | None = None) -> DeviceMemory | None:
    """Published memory per device of an accelerator: a Trainium instance type or generation
    (``trn2.48xlarge``, ``trn2``, ``trn1``; ``logical_cores`` is Trainium2's LNC, 2 unless
    ``NEURON_LOGICAL_NC_CONFIG`` says 1) or a TPU accelerator type (``v5p-128``, ``v6e``,
    ``v5litepod-16``, ``tpu7x-32``). None when unknown."""
    return DEVICE_MEMORY.get(device_key(accelerator, logical_cores))


def device_key(accelerator: str, logical_cores: int | None = None) -> str:
    """The key of an accelerator's device in this module's and ``peaks.py``'s tables: ``trn1``,
    ``trn2`` / ``trn3`` (``-lnc1`` with ``logical_cores=1``), a TPU generation (``v5e``, ``v7x``);
    "" when unknown."""
    name = (accelerator or "").strip().lower()
    for trn in ("trn3", "trn2"):
        if name.startswith(trn):
            return f"{trn}-lnc1" if logical_cores == 1 else trn
    if name.startswith("trn1"):
        return "trn1"
    generation = tpu_generation(name)
    return _TPU_ALIASES.get(generation, generation)


@dataclass(frozen=True)
class HostMemory:
    """The memory of one host (a Ray node), for what a host holds at a checkpoint."""

    name: str
    bytes: int
    source: str


# Trainium instances' host memory (Ray's node), from the instance table (``planning/hardware.py``:
# AWS Neuron docs, Trn1/Trn1n and Trn2 architecture, "Host Memory (GiB)"). A TPU VM's memory
# depends on its machine type (``--host-memory``).
HOST_MEMORY: dict[str, HostMemory] = {
    i.name: HostMemory(i.name, i.host_memory_gib * GIB, f"{i.source}: {i.host_memory_gib:,} GiB "
                       "of host memory")
    for i in TRAINIUM_INSTANCES.values() if i.host_memory_gib}


def host_memory(accelerator: str) -> HostMemory | None:
    """Published host memory of an instance type (``trn2.48xlarge``); None when unknown (a
    generation such as ``trn2`` names no instance; TPU VMs vary by machine type)."""
    return HOST_MEMORY.get((accelerator or "").strip().lower())


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``24GiB``, ``24G``, ``16GB``, ``1.5TiB``, ``512M`` or a plain count. KiB, MiB,
    GiB and TiB (and the bare K, M, G, T) are powers of 2; KB, MB, GB and TB powers of 10, as
    Hugging Face (``consolidate --max-shard-size``) reads them: 16GB is 16 x 10^9 bytes, 14.90
    GiB. Raises ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?B)?)?\s*", text.upper())
    if not match:
        raise ValueError(f"{text!r} is not a size: expected bytes or a number with KiB, MiB, "
                         "GiB, TiB (powers of 2, as the bare K, M, G, T) or KB, MB, GB, TB "
                         "(powers of 10), e.g. 24GiB, 95G, 16GB")
    number, unit, suffix = match.groups()
    scale = 1000 ** "_KMGT".index(unit) if suffix == "B" else _UNITS[unit or ""]
    value = int(float(number) * scale)
    if value < 1:
        raise ValueError(f"{text!r} is not a size of at least 1 byte")
    return value


def _dtype(name: str, what: str) -> int:
    if name not in DTYPE_BYTES:
        raise XLAConfigError(f"memory plan: {what}={name!r} is not valid: expected one of "
                             f"{', '.join(repr(d) for d in DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def gib(size: int) -> str:
    return f"{size / GIB:.2f}"


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise XLAConfigError(f"memory plan: {name}={value!r} is not valid: expected a positive "
                             "integer")


@dataclass(frozen=True)
class Layout:
    """The devices a run shards over: how many, how many on each host, and how the state is
    sharded over them ("fsdp": over every device; "hsdp": over the devices of one host,
    replicated across hosts, as ``get_sharded_mesh("hsdp")``). A plan of another layout is
    this value replaced."""

    devices: int
    devices_per_host: int
    sharding: str = "fsdp"

    def __post_init__(self) -> None:
        _positive("devices", self.devices)
        _positive("devices_per_host", self.devices_per_host)
        if self.sharding not in SHARDINGS:
            raise XLAConfigError(f"memory plan: sharding={self.sharding!r} is not valid: "
                                 f"expected one of {', '.join(repr(s) for s in SHARDINGS)}")
        if self.sharding == "hsdp" and self.devices % self.devices_per_host:
            raise XLAConfigError(
                f"memory plan: HSDP shards within a host, so every host must hold the same "
                f"number of devices: {self.devices} devices are not hosts of "
                f"{self.devices_per_host}; give equal hosts, or shard over every device (fsdp)")
        object.__setattr__(self, "devices_per_host", min(self.devices_per_host, self.devices))

    @property
    def hosts(self) -> int:
        return math.ceil(self.devices / self.devices_per_host)

    @property
    def shards(self) -> int:
        """The devices each tensor is split over."""
        return self.devices_per_host if self.sharding == "hsdp" else self.devices

    @property
    def replicas(self) -> int:
        return self.devices // self.shards

    def describe(self) -> str:
        if self.sharding == "fsdp":
            return f"FSDP over {self.devices} devices"
        return (f"HSDP (sharded over the {self.shards} devices of a host, replicated over "
                f"{self.replicas} hosts)")

    def to_json(self) -> dict[str, Any]:
        return {"devices": self.devices, "devices_per_host": self.devices_per_host,
                "hosts": self.hosts, "sharding": self.sharding, "shards": self.shards,
                "replicas": self.replicas}


# The call that produces each (stack, parameter dtype), with torch.optim.AdamW over the model's
# parameters (its state is kept in the parameters' dtype). FSDP2's mixed_precision="bf16"
# (``fsdp2.mixed_precision_policy``) gathers parameters in bf16 to compute and reduce-scatters
# gradients in fp32 into shards of the parameters' own dtype; FSDPv2 has no mixed precision.
# ``load_pretrained``'s dtype is the parameters' (default: the model's as built; transformers'
# ``from_config`` builds in the config's dtype, bf16 for most checkpoints).
_ADAMW = "then torch.optim.AdamW(model.parameters())"
CALLS = {
    ("fsdp2", "fp32"): 'load_pretrained(model, path, dtype=torch.float32, mixed_precision="bf16") '
                       '(or prepare_sharded_model(model, mixed_precision="bf16") over a model in '
                       f"fp32), {_ADAMW}",
    ("fsdp2", "bf16"): "load_pretrained(model, path, dtype=torch.bfloat16) (or "
                       f"prepare_sharded_model(model) over a model in bf16), {_ADAMW}",
    ("fsdpv2", "fp32"): "load_pretrained(model, path, dtype=torch.float32) (or "
                        "prepare_sharded_model(model) over a model in fp32; FSDPv2 has no mixed "
                        f"precision, so it computes in fp32), {_ADAMW}",
    ("fsdpv2", "bf16"): "load_pretrained(model, path, dtype=torch.bfloat16) (or "
                        f"prepare_sharded_model(model.to(torch.bfloat16))), {_ADAMW}",
}


@dataclass(frozen=True)
class Precision:
    """The dtypes of the sharded parameters, their gradients, AdamW's two states and the
    gathered parameters a forward computes with, and ``call``: what produces them."""

    parameters: str
    gradients: str
    optimizer: str
    compute: str
    call: str

    def to_json(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer, "compute": self.compute, "call": self.call}


def precision(param_dtype: str = "fp32", optimizer_dtype: str | None = None, *,
              stack: str = "fsdp2", grad_dtype: str | None = None,
              compute_dtype: str | None = None) -> Precision:
    """The precision a run of ``stack`` ("fsdp2": the native configs; "fsdpv2":
    ``TorchXLAConfig(spmd=True)``) gets with parameters in ``param_dtype``: gradients alike;
    AdamW state in the parameters' dtype, as ``torch.optim.AdamW`` keeps it, unless
    ``optimizer_dtype`` says otherwise (an optimizer of your own); computing in bf16 under
    FSDP2's ``mixed_precision="bf16"``, in the parameters' dtype under FSDPv2."""
    if stack not in STACKS:
        raise XLAConfigError(f"memory plan: stack={stack!r} is not valid: expected one of "
                             f"{', '.join(repr(s) for s in STACKS)}")
    _dtype(param_dtype, "param_dtype")
    optimizer_dtype = optimizer_dtype or param_dtype
    grad_dtype = grad_dtype or param_dtype
    compute_dtype = compute_dtype or ("bf16" if stack == "fsdp2" else param_dtype)
    for name, value in (("optimizer_dtype", optimizer_dtype), ("grad_dtype", grad_dtype),
                        ("compute_dtype", compute_dtype)):
        _dtype(value, name)
    call = CALLS[stack, param_dtype]
    if (grad_dtype, compute_dtype) != (param_dtype, "bf16" if stack == "fsdp2" else param_dtype):
        call = (f"{grad_dtype} gradients and {compute_dtype} compute over {param_dtype} "
                "parameters: a setup of your own (prepare_sharded_model's mixed_precision takes "
                "a MixedPrecisionPolicy)")
    if optimizer_dtype != param_dtype:
        call += (f"; {optimizer_dtype} AdamW state over {param_dtype} parameters needs an "
                 "optimizer of your own: torch.optim.AdamW keeps its state in the parameters' "
                 "dtype")
    return Precision(param_dtype, grad_dtype, optimizer_dtype, compute_dtype, call)


@dataclass(frozen=True)
class MemoryPlan:
    """What each device and each host holds for a sharded run (bytes). Per device: its shard of
    the parameters, gradients and AdamW state, and the gathered parameters FSDP2 holds at its
    peak (the root unit and ``PREFETCH_LAYERS`` decoder layers, in the compute dtype). Per host:
    its devices' shards at a sharded load; at a checkpoint, the staging pool's sets and the
    memory tier's copies. ``request``: the arguments of ``plan_memory`` that made it (a remedy
    is planned again from them)."""

    parameters: int
    layout: Layout
    precision: Precision
    per_device: Mapping[str, int]
    per_host: Mapping[str, int]
    checkpoints: Mapping[str, Any]
    device_memory: DeviceMemory | None
    host_memory: HostMemory | None
    model: ModelShape | None
    request: Mapping[str, Any]

    @property
    def total(self) -> int:
        return self.per_device["total"]

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def sharding(self) -> str:
        return self.layout.sharding

    @property
    def device_share(self) -> float | None:
        """The per-device total as a share of the device's memory; None when that is unknown."""
        return None if self.device_memory is None else self.total / self.device_memory.bytes

    @property
    def host_share(self) -> float | None:
        """A host's peak as a share of its memory; None when that is unknown."""
        return None if self.host_memory is None else \
            self.per_host["peak"] / self.host_memory.bytes

    @property
    def fits(self) -> bool | None:
        """Whether the plan fits every memory that is known (the device's, the host's); None
        when neither is."""
        shares = [s for s in (self.device_share, self.host_share) if s is not None]
        return None if not shares else all(s <= 1 for s in shares)

    @property
    def roomy(self) -> bool:
        """Fits with more than ``1 - TIGHT`` of each known memory left."""
        return all(s is None or s <= TIGHT for s in (self.device_share, self.host_share))

    def replan(self, **changes: Any) -> MemoryPlan:
        """This plan's arguments with ``changes``, planned again."""
        return plan_memory(**{**self.request, **changes})

    def warnings(self) -> list[str]:
        """A line for each memory that fits with ``1 - TIGHT`` of it or less left."""
        out = []
        for what, share, have, used, left_for in (
                ("device", self.device_share, self.device_memory, self.total,
                 "activations, the runtime and the compiler"),
                ("host", self.host_share, self.host_memory, self.per_host["peak"],
                 "the OS, Ray, data loading and the runtime")):
            if share is not None and TIGHT < share <= 1:
                out.append(f"{gib(used)} of {gib(have.bytes)} GiB per {what} ({share:.0%}) leaves "
                           f"only {gib(have.bytes - used)} GiB for {left_for}")
        return out

    def check(self, larger: Callable[..., Iterable[Scale]] | None = None) -> None:
        """Refuse a plan that exceeds a known memory (the device's or the host's):
        XLAConfigError naming the figures and the changes that fit, each planned again before
        it is offered (``remedies``). Nothing to check when neither memory is known."""
        if self.fits is not False:
            return
        what = (f"{self.model.model_type} ({self.parameters:,} parameters)" if self.model
                else f"{self.parameters:,} parameters")
        over = []
        if self.device_share is not None and self.device_share > 1:
            over.append(f"needs {gib(self.total)} GiB per device with {self.layout.describe()}, "
                        f"but a {self.device_memory.device} has {gib(self.device_memory.bytes)} "
                        "GiB (activations not counted)")
        if self.host_share is not None and self.host_share > 1:
            over.append(f"needs up to {gib(self.per_host['peak'])} GiB per host at a checkpoint "
                        f"({self.checkpoints['staged_sets']} staged sets"
                        + (", the memory tier's copies" if self.checkpoints["memory_every"] else "")
                        + f"), but a {self.host_memory.name} has {gib(self.host_memory.bytes)} GiB")
        over += [f"also, {w}" for w in self.warnings()]
        fixes = remedies(self, larger)
        raise XLAConfigError(f"memory plan: {what} " + "; ".join(over) + ": use "
                             + "; or ".join(fixes) + ".")

    def to_json(self) -> dict[str, Any]:
        memory, host = self.device_memory, self.host_memory
        out: dict[str, Any] = {
            "parameters": self.parameters,
            "layout": self.layout.to_json(),
            "dtypes": {k: v for k, v in self.precision.to_json().items() if k != "call"},
            "precision_call": self.precision.call,
            "per_device": dict(self.per_device),
            "per_host": dict(self.per_host),
            "checkpoints": dict(self.checkpoints),
            "device_memory": None if memory is None else {
                "name": memory.name, "device": memory.device, "bytes": memory.bytes,
                "source": memory.source},
            "host_memory": None if host is None else {
                "name": host.name, "bytes": host.bytes, "source": host.source},
            "fits": self.fits,
            "warnings": self.warnings(),
            "not_counted": list(NOT_COUNTED),
        }
        if self.model is not None:
            out["model"] = self.model.to_json()
        return out


NOT_COUNTED = (
    "activations (they depend on batch, sequence length and activation checkpointing)",
    "the unsharded gradients of the layer being reduce-scattered in backward",
    "collective and compiler buffers, and the runtime's own reserve",
    "FSDP2's padding of each parameter's first dimension to a multiple of the shards",
)
HOST_AT_STEP = ("nothing model-sized: parameters, gradients and optimizer state stay on the "
                "devices; the host holds batches, the runtime and compiled graphs")


def plan_memory(parameters: int | ModelShape, *, devices: int, devices_per_host: int,
                sharding: str = "fsdp", param_dtype: str = "fp32",
                optimizer_dtype: str | None = None, grad_dtype: str | None = None,
                compute_dtype: str | None = None, stack: str = "fsdp2",
                layer_parameters: int = 0, root_parameters: int = 0,
                memory: DeviceMemory | None = None, host: HostMemory | None = None,
                max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                memory_every: int | None = None) -> MemoryPlan:
    """The memory of a sharded run of ``parameters`` (a count, or a ``ModelShape``, which also
    gives the layer and root sizes) over ``devices`` (``devices_per_host`` on each host).

    ``sharding``: "fsdp" shards over every device; "hsdp" over the devices of one host,
    replicated across hosts (``get_sharded_mesh("hsdp")``). ``stack``, ``param_dtype``,
    ``optimizer_dtype``, ``grad_dtype``, ``compute_dtype``: see ``precision`` (the default, fp32
    parameters and AdamW state computing in bf16, is FSDP2's ``mixed_precision="bf16"`` over a
    model in fp32). ``max_in_flight`` (``rtx.configure_reports``) and ``memory_every`` (the
    config's memory tier, None: off) set what a host holds at a checkpoint. ``memory`` (see
    ``device_memory``) and ``host`` (``host_memory``) are what ``MemoryPlan.check`` compares
    with."""
    request = dict(locals())  # the arguments, to plan a remedy again
    model = parameters if isinstance(parameters, ModelShape) else None
    if model is not None:
        parameters, layer_parameters, root_parameters = (
            model.parameters, model.layer_parameters, model.root_parameters)
    _positive("parameters", parameters)
    _positive("max_in_flight", max_in_flight)
    if memory_every is not None:
        _positive("memory_every", memory_every)
    layout = Layout(devices, devices_per_host, sharding)
    dtypes = precision(param_dtype, optimizer_dtype, stack=stack, grad_dtype=grad_dtype,
                       compute_dtype=compute_dtype)
    size = {what: DTYPE_BYTES[getattr(dtypes, what)]
            for what in ("parameters", "gradients", "optimizer", "compute")}
    shard = math.ceil(parameters / layout.shards)
    per_device = {
        "parameters": shard * size["parameters"],
        "gradients": shard * size["gradients"],
        "optimizer": shard * ADAMW_STATES * size["optimizer"],
        "gathered_root": root_parameters * size["compute"],
        "gathered_layers": PREFETCH_LAYERS * layer_parameters * size["compute"],
    }
    per_device["total"] = sum(per_device.values())
    # A checkpoint's host copy of one host's devices: their parameter and optimizer shards.
    one_set = layout.devices_per_host * (per_device["parameters"] + per_device["optimizer"])
    sets = max_in_flight + 1
    peers = layout.hosts > 1
    tier = {"own": TIER_OWN_GENERATIONS if memory_every else 0,
            "peer": TIER_PEER_GENERATIONS if memory_every and peers else 0,
            # handed over: out through Ray's object store and the peer's in; under FSDPv2 also
            # staged and formatted in the training process
            "in_flight": (2 * peers + 2 * (stack == "fsdpv2")) if memory_every else 0}
    per_host = {
        # A sharded load reads each device's own shards, in the training dtype, through host
        # memory; a checkpoint stages every device's parameter and optimizer shards there.
        "at_load": layout.devices_per_host * per_device["parameters"],
        "at_step": 0,
        "checkpoint_set": one_set,
        "staging": sets * one_set,
        "memory_tier_own": tier["own"] * one_set,
        "memory_tier_peer": tier["peer"] * one_set,
        "memory_tier_in_flight": tier["in_flight"] * one_set,
    }
    at_checkpoint = sum(v for k, v in per_host.items() if k == "staging" or
                        k.startswith("memory_tier"))
    per_host["peak"] = max(per_host["at_load"], at_checkpoint)
    # FSDP2's staged sets are shared memory (the writer processes map them), and so are the
    # tier's own slots: all in /dev/shm. FSDPv2's stay in the training process.
    per_host["shared_memory"] = 0 if stack == "fsdpv2" else \
        per_host["staging"] + per_host["memory_tier_own"]
    checkpoints = {"max_in_flight": max_in_flight, "staged_sets": sets,
                   "memory_every": memory_every, "memory_tier_sets": tier}
    return MemoryPlan(parameters=parameters, layout=layout, precision=dtypes,
                      per_device=per_device, per_host=per_host, checkpoints=checkpoints,
                      device_memory=memory, host_memory=host, model=model, request=request)


# ---- remedies: only changes that were planned again and fit -------------------------------------

@dataclass(frozen=True)
class Scale:
    """A larger cluster of the same hardware: its layout, what it is (``label``) and the plan
    flags that describe it."""

    layout: Layout
    label: str
    flags: str


# The largest slice of a TPU generation (chips), where it is smaller than the tables of
# standard topologies: Google Cloud TPU docs, "TPU Pod size" (v5e and v6e: 256 chips; v4: 4096).
POD_CHIPS = {"v5e": 256, "v5litepod": 256, "v6e": 256, "v4": 4096}
# At most this many hosts are tried for hardware of any host count.
MAX_HOSTS = 100_000


def larger_clusters(layout: Layout, at_least: int = 0, *, accelerator_type: str = "",
                    spmd: bool = False) -> Iterator[Scale]:
    """The clusters of the same hardware with more devices than ``layout`` (and at least
    ``at_least``), smallest first, each sharded with FSDP over every device: for a TPU
    accelerator type, its standard slice sizes (``tpu_slice``, up to the generation's pod);
    otherwise any count of hosts like these. ``spmd``: one worker per host owns its devices
    (the flags name its accelerators)."""
    try:
        current = tpu_slice(accelerator_type) if tpu_generation(accelerator_type) else None
    except ValueError:
        current = None
    if current is None:
        per_host = layout.devices_per_host
        start = max(layout.hosts + 1, math.ceil(at_least / per_host))
        for hosts in range(start, max(start, MAX_HOSTS // per_host) + 1):
            yield Scale(Layout(hosts * per_host, per_host), f"{hosts} hosts of {per_host} devices",
                        f"--nodes {hosts}")
        return
    generation = TPU_GENERATIONS[current.generation]
    prefix = re.match(r"[a-z0-9]+", accelerator_type.strip().lower()).group(0)
    chips_now = math.prod(current.topology)
    for chips in sorted(generation.topologies):  # its published sizes (planning/hardware.py)
        if chips <= chips_now or chips > POD_CHIPS.get(generation.name, math.inf):
            continue
        name = f"{prefix}-{chips * generation.cores_per_chip}"
        bigger = tpu_slice(name)
        per_host = bigger.chips_per_host * bigger.devices_per_chip
        if bigger.hosts * per_host < at_least:
            continue
        flags = f"--accelerator-type {name} --nodes {bigger.hosts}"
        if per_host != layout.devices_per_host:
            flags += (f" --accelerators-per-worker {bigger.chips_per_host}" if spmd
                      else f" --workers-per-node {per_host}")
        yield Scale(Layout(bigger.hosts * per_host, per_host), f"a {name} slice "
                    f"({bigger.hosts} host{'s' if bigger.hosts > 1 else ''} of {per_host} "
                    "devices)", flags)


def _figures(plan: MemoryPlan) -> str:
    out = [f"{gib(plan.total)} GiB per device"]
    if plan.host_memory is not None:
        out.append(f"up to {gib(plan.per_host['peak'])} GiB per host")
    return ", ".join(out)


def _fewest_devices(plan: MemoryPlan) -> int | None:
    """Fewest devices that could hold ``plan``'s state with room (FSDP over every one: the
    gathered parameters do not shrink); None when the gathered parameters alone leave no room.
    0 when the device's memory is unknown."""
    if plan.device_memory is None:
        return 0
    gathered = plan.per_device["gathered_root"] + plan.per_device["gathered_layers"]
    room = TIGHT * plan.device_memory.bytes - gathered
    state = plan.parameters * sum(DTYPE_BYTES[getattr(plan.precision, k)] * n for k, n in (
        ("parameters", 1), ("gradients", 1), ("optimizer", ADAMW_STATES)))
    return math.ceil(state / room) if room > 0 else None


BF16 = {"param_dtype": "bf16", "optimizer_dtype": "bf16", "grad_dtype": None,
        "compute_dtype": None}


def remedies(plan: MemoryPlan, larger: Callable[..., Iterable[Scale]] | None = None,
             ) -> list[str]:
    """What makes ``plan`` fit, each planned again and offered only if it fits with room
    (``MemoryPlan.roomy``), each with plan's flags and its figures: on the same devices, FSDP
    instead of HSDP, bf16 parameters and AdamW state, one checkpoint in flight, the memory
    tier off (the fewest of these that fit together); the smallest larger cluster that fits as
    it is, and with bf16 where that is smaller (``larger(layout, at_least)``, default
    ``larger_clusters``: more hosts like these); last, the flags for hardware with more
    memory."""
    changes = []  # (flags, what, plan_memory arguments)
    if plan.sharding == "hsdp":
        changes.append(("--sharding fsdp", f"FSDP over all {plan.devices} devices",
                        {"sharding": "fsdp"}))
    bf16 = (plan.precision.parameters, plan.precision.optimizer) != ("bf16", "bf16")
    bf16_flags = "--param-dtype bf16" + (" --optimizer-dtype bf16"
                                         if plan.request["optimizer_dtype"] else "")
    if bf16:
        changes.append((bf16_flags, "bf16 parameters and AdamW state", BF16))
    if plan.host_share is not None and plan.host_share > TIGHT:
        if plan.checkpoints["max_in_flight"] > 1:
            changes.append(("--max-in-flight 1", "one checkpoint in flight "
                            "(rtx.configure_reports(max_in_flight=1))", {"max_in_flight": 1}))
        if plan.checkpoints["memory_every"]:
            changes.append(("without --memory-every", "the memory tier off",
                            {"memory_every": None}))
    fixes: list[str] = []
    fitting: list[set[int]] = []
    for n in range(1, len(changes) + 1):
        for chosen in itertools.combinations(range(len(changes)), n):
            if any(f <= set(chosen) for f in fitting):
                continue  # some of them fit already without the rest
            again = plan.replan(**{k: v for i in chosen for k, v in changes[i][2].items()})
            if again.fits and again.roomy:
                fitting.append(set(chosen))
                fixes.append(" with ".join(changes[i][1] for i in chosen) + " ("
                             + " ".join(changes[i][0] for i in chosen) + f": {_figures(again)})")
    larger = larger or larger_clusters
    found = None
    # A larger cluster is sharded with FSDP: when FSDP on these devices fits, it is the fix.
    passes = [] if plan.sharding == "hsdp" and {0} in fitting else [{}, BF16] if bf16 else [{}]
    for extra in passes:
        need = _fewest_devices(plan.replan(**extra))
        if need is None:
            continue
        for scale in larger(plan.layout, need):
            if found is not None and scale.layout.devices >= found:
                break
            again = plan.replan(devices=scale.layout.devices,
                                devices_per_host=scale.layout.devices_per_host,
                                sharding="fsdp", **extra)
            if again.fits and again.roomy:
                found = scale.layout.devices
                flags = scale.flags + (" --sharding fsdp" if plan.sharding == "hsdp" else "") \
                    + (f" {bf16_flags}" if extra else "")
                fixes.append(f"{scale.label} with FSDP over every device"
                             + (" and bf16 parameters and AdamW state" if extra else "")
                             + f" ({flags}: {_figures(again)})")
                break
    if found is None and _fewest_devices(plan.replan(**BF16)) is None:
        gathered = plan.per_device["gathered_root"] + plan.per_device["gathered_layers"]
        fixes.append(f"tensor parallelism, which this plan does not model (the gathered "
                     f"parameters alone need {gib(gathered)} GiB per device, so no number of "
                     "FSDP devices fits)")
    more = [flag for flag, share in (("--device-memory SIZE", plan.device_share),
                                     ("--host-memory SIZE", plan.host_share))
            if share is not None and share > 1]
    fixes.append(" and ".join(more) + " if the hardware has more")
    return fixes


def format_memory_table(plan: MemoryPlan) -> str:
    """The plan as a readable table, in GiB with 2 decimals."""
    d, h, t, c = plan.per_device, plan.per_host, plan.precision, plan.checkpoints
    lines = []
    model = plan.model
    if model is not None:
        name, size = model.largest_tensor
        lines.append(f"Model: {model.model_type}, {plan.parameters:,} parameters "
                     f"({model.num_hidden_layers} layers of {model.layer_parameters:,}; "
                     f"largest tensor {name}, {size:,})")
        if model.defaults:
            sizes = [k for k in SIZE_KEYS if k in model.defaults]
            lines += textwrap.wrap(
                ("Warning: " if sizes else "") + "Defaults: "
                + ", ".join(f"{k}={v}" for k, v in model.defaults.items())
                + f" are not in the config: taken from transformers' defaults for "
                f"{model.model_type}" + (f" (the plan is of the default {', '.join(sizes)}, "
                                         "not necessarily your model's)" if sizes else ""), 100)
    else:
        lines.append(f"Model: {plan.parameters:,} parameters")
    layout = plan.layout
    spread = (f"FSDP, each tensor sharded over all {layout.devices} devices"
              if layout.sharding == "fsdp" else
              f"HSDP, sharded over the {layout.shards} devices of a host, replicated over "
              f"{layout.replicas} hosts")
    lines.append(f"Layout: {layout.devices} devices on {layout.hosts} "
                 f"host{'s' if layout.hosts > 1 else ''} (up to {layout.devices_per_host} a "
                 f"host); {spread}")
    lines += textwrap.wrap(f"Precision: {t.parameters} parameters, {t.gradients} gradients, "
                           f"{t.optimizer} AdamW state, {t.compute} compute: {t.call}", 100)
    memory = plan.device_memory
    lines.append(f"Device memory: {gib(memory.bytes)} GiB per {memory.device}" if memory else
                 "Device memory: unknown (give --accelerator-type or --device-memory to check "
                 "the fit)")
    host = plan.host_memory
    lines.append(f"Host memory: {gib(host.bytes)} GiB per {host.name}" if host else
                 "Host memory: unknown (give --accelerator-type with a Trainium instance type, "
                 "or --host-memory, to check the fit)")
    tier = c["memory_tier_sets"]
    rows = [
        ("Per device", "", ""),
        ("  parameters (shard)", t.parameters, gib(d["parameters"])),
        ("  gradients (shard)", t.gradients, gib(d["gradients"])),
        ("  AdamW state (shard, 2 states)", t.optimizer, gib(d["optimizer"])),
        ("  gathered root (embedding, head)", t.compute, gib(d["gathered_root"])),
        (f"  gathered layers ({PREFETCH_LAYERS}, prefetch)", t.compute,
         gib(d["gathered_layers"])),
        ("  total", "", gib(d["total"])),
        (f"Per host ({layout.devices_per_host} devices)", "", ""),
        ("  at load (own shards)", t.parameters, gib(h["at_load"])),
        ("  at a step", "", gib(h["at_step"])),
        ("  a checkpoint's host copy (one set)", "", gib(h["checkpoint_set"])),
        (f"  staging pool (up to {c['staged_sets']} sets)", "", gib(h["staging"])),
    ]
    if c["memory_every"]:
        rows += [
            (f"  memory tier: own generations ({tier['own']})", "", gib(h["memory_tier_own"])),
            (f"  memory tier: the peer's generations ({tier['peer']})", "",
             gib(h["memory_tier_peer"])),
            (f"  memory tier: in flight (up to {tier['in_flight']})", "",
             gib(h["memory_tier_in_flight"])),
        ]
    else:
        rows.append(("  memory tier (off)", "", gib(0)))
    rows += [("  peak, at a checkpoint", "", gib(h["peak"])),
             ("  of it in shared memory (/dev/shm)", "", gib(h["shared_memory"]))]
    width = max(len(r[0]) for r in rows)
    lines.append(f"{'':<{width}}  {'dtype':<5}  {'GiB':>8}")
    lines += [f"{label:<{width}}  {dtype:<5}  {value:>8}".rstrip() for label, dtype, value in rows]
    lines += textwrap.wrap(
        f"At a checkpoint: the staging pool keeps up to max_in_flight + 1 = {c['staged_sets']} "
        f"sets (--max-in-flight {c['max_in_flight']}, rtx.configure_reports(max_in_flight=...)); "
        + ("the memory tier (--memory-every, the config's memory_every) keeps its ranks' two "
           "generations" + (" and its peer node's two, and passes one of each through Ray's "
                            "object store while it hands them over (which spills to disk past "
                            "the store's size)" if layout.hosts > 1 else
                            " (on one host there is no peer to copy to)")
           + ("; under FSDPv2 a generation is staged and formatted in the training process "
              "first" if plan.request["stack"] == "fsdpv2" else "")
           if c["memory_every"] else "the memory tier is off (--memory-every N counts it)")
        + ". /dev/shm is a tmpfs, by default half the RAM (in a container, docker run "
        "--shm-size).", 100)
    for what, share, have, used in (("Device", plan.device_share, memory, d["total"]),
                                    ("Host", plan.host_share, host, h["peak"])):
        if share is None:
            continue
        if share > 1:
            verdict = "does NOT fit"
        elif share > TIGHT:
            verdict = f"Warning: fits, but leaves only {gib(have.bytes - used)} GiB"
        else:
            verdict = f"fits, {gib(have.bytes - used)} GiB left"
        lines += textwrap.wrap(
            f"{what}: {gib(used)} of {gib(have.bytes)} GiB ({share:.0%}): {verdict}"
            + ("" if share > 1 else " for activations, the runtime and the compiler"
               if what == "Device" else " for the OS, Ray, data loading and the runtime"), 100)
    lines += textwrap.wrap(f"At a step the host holds {HOST_AT_STEP}.", 100)
    lines += textwrap.wrap("Not counted: " + "; ".join(NOT_COUNTED) + ".", 100)
    return "\n".join(lines)
