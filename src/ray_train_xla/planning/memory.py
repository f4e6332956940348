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
- ``plan_memory``: parameters, gradients and AdamW state of a run laid out as a ``Layout``
  (``planning/layout.py``: tensor parallelism inside a host, FSDP2 over the data-parallel
  devices, HSDP's replicas) over a ``Cluster``, the layers FSDP2 gathers, the activations at a
  sequence length and micro-batch (``ModelShape.activation_bytes``, with or without activation
  checkpointing and sequence parallelism) and the logits, and what each host holds at load and
  at a checkpoint: the staging pool's sets and the memory tier's copies (``MemoryPlan``);
- ``pick_tp``: the smallest TP degree within a host whose plan fits a device with room;
- ``device_memory`` / ``host_memory``: the published memory of one device of each Trainium and
  TPU generation (``DEVICE_MEMORY``) and of each Trainium instance (``HOST_MEMORY``);
  ``MemoryPlan.check`` refuses a plan that does not fit them, offering only changes that were
  planned again and fit (a larger TP, sequence parallelism, activation checkpointing, bf16
  state, ...; ``larger_clusters``: the real sizes of the same hardware).

What is left out is listed (``NOT_COUNTED``): the figures are a floor to size a job against.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning.hardware import (
    TPU_GENERATIONS,
    TRAINIUM_GENERATIONS,
    TRAINIUM_INSTANCES,
    tpu_generation,
)
from ray_train_xla.planning.layout import DIMS, REST, Layout, Parallelism, divisors
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


def _part(n: int, parts: int) -> int:
    """The largest of ``parts`` near-equal parts of ``n`` (torch's ``Shard`` gives the first
    ranks the larger chunks)."""
    return -(-n // parts)


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

    # ---- tensor parallelism: what one device of a TP group holds ------------------------------
    # The plan of transformers 5.25 for these families: the config's ``base_model_tp_plan``
    # (q_proj, k_proj, v_proj, gate_proj, up_proj "colwise": weight and bias split on the
    # output; o_proj, down_proj "rowwise": weight split on the input, bias whole; Qwen3's and
    # Gemma 3's q_norm/k_norm "replicated_with_grad_allreduce": whole), the causal LM's
    # ``_tp_plan`` (lm_head "colwise_gather_output": split on the vocabulary) and
    # ``embed_tokens`` "embedding_rowwise" (split on the vocabulary), which
    # ``distributed/mixin.py`` adds unless the plan names it. Norms are not in the plan: whole.
    # A split dimension that ``tp`` does not divide gives its first device the larger part.

    def layer_tp_parameters(self, tp: int) -> int:
        """One decoder layer's parameters on one device of a tensor-parallel group of ``tp``."""
        h, q, kv, f = self.hidden_size, self.num_attention_heads * self.head_dim, \
            self.num_key_value_heads * self.head_dim, self.intermediate_size
        qt, kvt, ft = _part(q, tp), _part(kv, tp), _part(f, tp)
        attention = h * qt + 2 * h * kvt + qt * h
        if self.qkv_bias:
            attention += qt + 2 * kvt
        if self.o_bias:
            attention += h  # rowwise: replicated
        mlp = 3 * h * ft
        if self.mlp_bias:
            mlp += 2 * ft + h  # gate and up split, down's bias replicated
        norms = self.norms_per_layer * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    def root_tp_parameters(self, tp: int) -> int:
        """The embedding, final norm and LM head on one device of a tensor-parallel group."""
        embedding = _part(self.vocab_size, tp) * self.hidden_size
        return embedding + self.hidden_size + (0 if self.tie_word_embeddings else embedding)

    def tp_parameters(self, tp: int) -> int:
        """Every parameter one device of a tensor-parallel group of ``tp`` holds (before FSDP
        shards it over the data-parallel devices)."""
        return self.num_hidden_layers * self.layer_tp_parameters(tp) + self.root_tp_parameters(tp)

    def activation_bytes(self, seq_len: int, micro_batch: int = 1, *, tp: int = 1,
                         sequence_parallel: bool = False, checkpointing: bool = False,
                         loss_parallel: bool = False, compute_bytes: int = 2) -> dict[str, int]:
        """The activations one device keeps for backward at the end of the forward pass, in
        bytes: ``layers`` (the decoder layers), ``root`` (the final norm and the LM head's
        input), ``logits`` (fp32, for the loss) and ``per_layer`` (one layer's, recomputed in
        backward under activation checkpointing).

        Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
        Models", section 4.1) count ``s*b*h*(34 + 5*a*s/h)`` bytes per layer at 16 bits, with
        ``s`` the sequence length, ``b`` the micro-batch, ``h`` the hidden size and ``a`` the
        heads. For these decoders (``c`` bytes of the compute dtype; ``q = a*head_dim``,
        ``k = kv_heads*head_dim``, ``f`` the MLP width; ``t`` the TP degree; ``n`` norms a
        layer) the same count, tensor by tensor, is::

            per layer = c*b*( n*h*s/t_sp            the norms' inputs
                            + 2*h*s                 the inputs of q/k/v and of gate/up
                            + (2*q + 2*k)*s/t       Q, K, V kept by the attention, O (o_proj's input)
                            + (q + k)*s/t           (Qwen3, Gemma 3: q_norm's and k_norm's inputs)
                            + 4*f*s/t )             gate's and up's outputs, the activation,
                                                    down_proj's input
                      + 4*b*s*a/t                   the attention's log-sum-exp, fp32

        where ``t_sp`` is ``t`` with sequence parallelism and 1 without. Where it differs
        from the paper: no dropout (these models have none: the paper's two masks, ``2*s*b*h``
        and ``a*s*s*b``, are gone); FlashAttention-style attention, which keeps no ``s*s``
        scores (the paper's ``5*a*s*s*b``); K and V at their own (grouped-query) heads; the
        gated MLP's four tensors of width ``f`` in place of GeLU's two of ``4h``; and with
        sequence parallelism the projections' inputs stay whole (``2*h*s``): torch's
        ``SequenceParallel`` all-gathers them and autograd keeps the gathered tensor, where
        Megatron gathers again in backward (the paper's ``/t``). Without TP and SP the Llama
        shape (``q = h``, ``k = h/8``, ``f = 3.5h``) is ``s*b*h*(34.5 + 4*a/h)`` at 16 bits.

        With activation checkpointing (each decoder layer recomputed in backward, as
        ``prepare_sharded_model(..., activation_checkpointing=True)`` wraps them), a layer keeps
        its input, ``c*b*s*h/t_sp`` (the paper's ``2*s*b*h`` per layer), and the one layer being
        recomputed holds its whole count on top. Outside the layers: the final norm's input
        ``c*b*s*h/t_sp`` and the LM head's input ``c*b*s*h``; the logits ``4*b*s*vocab``
        (fp32, as the loss takes them), ``/t`` when they stay split on the vocabulary
        (``loss_parallel``)."""
        s, b, c = seq_len, micro_batch, compute_bytes
        h, a = self.hidden_size, self.num_attention_heads
        qt = _part(a * self.head_dim, tp)
        kt = _part(self.num_key_value_heads * self.head_dim, tp)
        s_sp = _part(s, tp) if sequence_parallel else s
        per_layer = c * b * (self.norms_per_layer * h * s_sp + 2 * h * s
                             + (2 * qt + 2 * kt + (qt + kt if self.qk_norm else 0)
                                + 4 * _part(self.intermediate_size, tp)) * s) \
            + 4 * b * s * _part(a, tp)
        layers = (self.num_hidden_layers * c * b * s_sp * h + per_layer if checkpointing
                  else self.num_hidden_layers * per_layer)
        return {"layers": layers, "root": c * b * h * (s_sp + s), "per_layer": per_layer,
                "logits": 4 * b * s * _part(self.vocab_size, tp if loss_parallel else 1)}

    def tp_sizes(self) -> dict[str, int]:
        """What a TP degree must divide: heads, KV heads, MLP width and the vocabulary (the
        embedding and the LM head are split on it)."""
        return {"heads": self.num_attention_heads, "kv_heads": self.num_key_value_heads,
                "mlp": self.intermediate_size, "vocab": self.vocab_size}

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
class Cluster:
    """The devices a run has: how many, and how many on each host (the largest host's
    count). How the run splits them is its ``Layout`` (``planning/layout.py``)."""

    devices: int
    devices_per_host: int

    def __post_init__(self) -> None:
        _positive("devices", self.devices)
        _positive("devices_per_host", self.devices_per_host)
        object.__setattr__(self, "devices_per_host", min(self.devices_per_host, self.devices))

    @property
    def hosts(self) -> int:
        return math.ceil(self.devices / self.devices_per_host)

    def tp_choices(self, model: ModelShape | None) -> list[int]:
        """The TP degrees this cluster and model allow, smallest first: divisors of the
        devices of a host (a group stays inside one) and of the whole job that divide the
        model's heads, KV heads, MLP width and vocabulary. [1] without a model's shape."""
        if model is None:
            return [1]
        sizes = [math.gcd(self.devices, self.devices_per_host), *model.tp_sizes().values()]
        return divisors(math.gcd(*sizes))


def spread(layout: Layout, devices: int) -> str:
    """How a plan splits its devices, for messages: 'FSDP over 64 devices', 'FSDP 8 x TP 8
    (64 devices)', '2 replicas x FSDP 32 (64 devices)'."""
    return f"FSDP over {devices} devices" if layout.trivial else \
        f"{layout.describe()} ({devices} devices)"


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
    the parameters, gradients and AdamW state (the tensor-parallel share of each, sharded over
    the data-parallel devices), the gathered parameters FSDP2 holds at its peak (the root unit
    and ``PREFETCH_LAYERS`` decoder layers, each device's tensor-parallel share, in the compute
    dtype), the activations kept for backward and the logits. Per host: its devices' shards at
    a sharded load; at a checkpoint, the staging pool's sets and the memory tier's copies.
    ``layout``: how the ``cluster``'s devices split (``planning/layout.py``). ``request``: the
    arguments of ``plan_memory`` that made it (a remedy is planned again from them)."""

    parameters: int
    layout: Layout
    cluster: Cluster
    precision: Precision
    per_device: Mapping[str, int]
    per_host: Mapping[str, int]
    checkpoints: Mapping[str, Any]
    activations: Mapping[str, Any] | None
    device_memory: DeviceMemory | None
    host_memory: HostMemory | None
    model: ModelShape | None
    request: Mapping[str, Any]

    @property
    def total(self) -> int:
        return self.per_device["total"]

    @property
    def devices(self) -> int:
        return self.cluster.devices

    @property
    def sharding(self) -> str:
        """"hsdp" when the layout replicates (``dp_replicate`` > 1), else "fsdp"."""
        return "hsdp" if self.layout.dp_replicate > 1 else "fsdp"

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

    def tp_choices(self) -> list[int]:
        """The TP degrees this plan's cluster and model allow (``Cluster.tp_choices``)."""
        return self.cluster.tp_choices(self.model)

    def warnings(self) -> list[str]:
        """A line for each memory that fits with ``1 - TIGHT`` of it or less left."""
        out = []
        for what, share, have, used, left_for in (
                ("device", self.device_share, self.device_memory, self.total,
                 "the runtime, the compiler and what is not counted"),
                ("host", self.host_share, self.host_memory, self.per_host["peak"],
                 "the OS, Ray, data loading and the runtime")):
            if share is not None and TIGHT < share <= 1:
                out.append(f"{gib(used)} of {gib(have.bytes)} GiB per {what} ({share:.0%}) leaves "
                           f"only {gib(have.bytes - used)} GiB for {left_for}")
        return out

    def activations_said(self) -> str:
        """'activations of 1 x 4096 tokens' and the like; 'activations not counted' without a
        model's shape."""
        a = self.activations
        if a is None:
            return "activations not counted"
        return (f"activations of {a['micro_batch']} x {a['seq_len']} tokens"
                + (", checkpointed" if a["activation_checkpointing"] else "")
                + (", sequence-parallel" if a["sequence_parallel"] and self.layout.tp > 1 else ""))

    def check(self, larger: Callable[..., Iterable[Scale]] | None = None,
              tried: Sequence[MemoryPlan] = ()) -> None:
        """Refuse a plan that exceeds a known memory (the device's or the host's):
        XLAConfigError naming the figures and the changes that fit, each planned again before
        it is offered (``remedies``). Nothing to check when neither memory is known.
        ``tried``: the plans ``pick_tp`` tried, said in the message; with them, the remedies
        leave the TP degree to the pick too (``remedies(pick=True)``)."""
        if self.fits is not False:
            return
        what = (f"{self.model.model_type} ({self.parameters:,} parameters)" if self.model
                else f"{self.parameters:,} parameters")
        over = []
        if self.device_share is not None and self.device_share > 1:
            others = [p for p in tried if p is not self]
            over.append(f"needs {gib(self.total)} GiB per device with "
                        f"{spread(self.layout, self.devices)}, but a {self.device_memory.device} "
                        f"has {gib(self.device_memory.bytes)} GiB ({self.activations_said()})"
                        + ("; with " + ", ".join(f"TP {p.layout.tp}: {gib(p.total)} GiB"
                                                 for p in others) if others else ""))
        if self.host_share is not None and self.host_share > 1:
            over.append(f"needs up to {gib(self.per_host['peak'])} GiB per host at a checkpoint "
                        f"({self.checkpoints['staged_sets']} staged sets"
                        + (", the memory tier's copies" if self.checkpoints["memory_every"] else "")
                        + f"), but a {self.host_memory.name} has {gib(self.host_memory.bytes)} GiB")
        over += [f"also, {w}" for w in self.warnings()]
        fixes = remedies(self, larger, pick=bool(tried))
        raise XLAConfigError(f"memory plan: {what} " + "; ".join(over) + ": use "
                             + "; or ".join(fixes) + ".")

    def to_json(self) -> dict[str, Any]:
        memory, host, layout, cluster = (self.device_memory, self.host_memory, self.layout,
                                         self.cluster)
        out: dict[str, Any] = {
            "parameters": self.parameters,
            "layout": {"devices": cluster.devices, "devices_per_host": cluster.devices_per_host,
                       "hosts": cluster.hosts, "sharding": self.sharding,
                       "shards": layout.dp_shard, "replicas": layout.dp_replicate,
                       **{d: getattr(layout, d) for d in DIMS}, "text": layout.to_text(),
                       "describe": layout.describe()},
            "dtypes": {k: v for k, v in self.precision.to_json().items() if k != "call"},
            "precision_call": self.precision.call,
            "per_device": dict(self.per_device),
            "per_host": dict(self.per_host),
            "checkpoints": dict(self.checkpoints),
            "activations": None if self.activations is None else dict(self.activations),
            "device_memory": None if memory is None else {
                "name": memory.name, "device": memory.device, "bytes": memory.bytes,
                "source": memory.source},
            "host_memory": None if host is None else {
                "name": host.name, "bytes": host.bytes, "source": host.source},
            "fits": self.fits,
            "warnings": self.warnings(),
            "not_counted": list(not_counted(self)),
        }
        if self.model is not None:
            out["model"] = self.model.to_json()
        return out


NOT_COUNTED = (
    "the unsharded gradients of the layer being reduce-scattered in backward, and the "
    "activations' gradients",
    "the logits in the compute dtype the model returns, and the loss's temporaries beyond one "
    "fp32 copy of them",
    "attention that keeps its scores (eager attention, Gemma 2's soft-capping: s x s per head)",
    "collective and compiler buffers, and the runtime's own reserve",
    "FSDP2's padding of each parameter's first dimension to a multiple of the shards",
)


def not_counted(plan: MemoryPlan) -> tuple[str, ...]:
    """What ``plan``'s figures leave out."""
    if plan.activations is None:
        return ("activations (a plain parameter count gives no model shape to count them "
                "from)", *NOT_COUNTED)
    return NOT_COUNTED


HOST_AT_STEP = ("nothing model-sized: parameters, gradients and optimizer state stay on the "
                "devices; the host holds batches, the runtime and compiled graphs")
DEFAULT_SEQ_LEN = 4096
DEFAULT_MICRO_BATCH = 1


def plan_memory(parameters: int | ModelShape, *, devices: int, devices_per_host: int,
                sharding: str = "fsdp", tp: int = 1, dp_replicate: int = 1,
                dp_shard: int = REST, seq_len: int = DEFAULT_SEQ_LEN,
                micro_batch: int = DEFAULT_MICRO_BATCH, activation_checkpointing: bool = False,
                sequence_parallel: bool = False, loss_parallel: bool = False,
                param_dtype: str = "fp32", optimizer_dtype: str | None = None,
                grad_dtype: str | None = None, compute_dtype: str | None = None,
                stack: str = "fsdp2", layer_parameters: int = 0, root_parameters: int = 0,
                memory: DeviceMemory | None = None, host: HostMemory | None = None,
                max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                memory_every: int | None = None) -> MemoryPlan:
    """The memory of a sharded run of ``parameters`` (a count, or a ``ModelShape``, which also
    gives the layer and root sizes, what TP splits and the activations) over ``devices``
    (``devices_per_host`` on each host).

    The layout: ``tp``, ``dp_replicate`` and ``dp_shard`` as ``Parallelism`` takes them
    (``dp_shard=-1``: what the others leave). ``sharding="hsdp"`` is HSDP over hosts,
    ``get_sharded_mesh("hsdp")``: a replica per host (``dp_replicate`` = the hosts). A
    tensor-parallel group stays inside a host; ``tp`` > 1 needs a ``ModelShape``.
    Activations: ``seq_len`` tokens a sequence, ``micro_batch`` sequences a device and step,
    with ``activation_checkpointing`` (each decoder layer recomputed in backward),
    ``sequence_parallel`` (norms and the residual stream split over the TP group) and
    ``loss_parallel`` (the logits split on the vocabulary): ``ModelShape.activation_bytes``.
    ``stack``, ``param_dtype``, ``optimizer_dtype``, ``grad_dtype``, ``compute_dtype``: see
    ``precision`` (the default, fp32 parameters and AdamW state computing in bf16, is FSDP2's
    ``mixed_precision="bf16"`` over a model in fp32). ``max_in_flight``
    (``rtx.configure_reports``) and ``memory_every`` (the config's memory tier, None: off) set
    what a host holds at a checkpoint. ``memory`` (see ``device_memory``) and ``host``
    (``host_memory``) are what ``MemoryPlan.check`` compares with."""
    request = dict(locals())  # the arguments, to plan a remedy again
    model = parameters if isinstance(parameters, ModelShape) else None
    if model is not None:
        parameters, layer_parameters, root_parameters = (
            model.parameters, model.layer_parameters, model.root_parameters)
    _positive("parameters", parameters)
    _positive("max_in_flight", max_in_flight)
    _positive("seq_len", seq_len)
    _positive("micro_batch", micro_batch)
    if memory_every is not None:
        _positive("memory_every", memory_every)
    cluster = Cluster(devices, devices_per_host)
    if sharding not in SHARDINGS:
        raise XLAConfigError(f"memory plan: sharding={sharding!r} is not valid: expected one of "
                             f"{', '.join(repr(s) for s in SHARDINGS)}")
    if sharding == "hsdp":
        if devices % cluster.devices_per_host:
            raise XLAConfigError(
                f"memory plan: HSDP shards within a host, so every host must hold the same "
                f"number of devices: {devices} devices are not hosts of "
                f"{cluster.devices_per_host}; give equal hosts, or shard over every device (fsdp)")
        if dp_replicate != 1:
            raise XLAConfigError(f"memory plan: sharding='hsdp' makes a replica of each host: "
                                 f"give it or dp_replicate={dp_replicate}, not both")
        dp_replicate = cluster.hosts
    layout = Parallelism(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp).resolve(
        devices, "memory plan")
    if tp > 1:
        if model is None:
            raise XLAConfigError(f"memory plan: tp={tp} needs the model's shape (a ModelShape): "
                                 "what tensor parallelism splits depends on its layers")
        if cluster.devices_per_host % tp:
            raise XLAConfigError(
                f"memory plan: tp={tp} does not divide the {cluster.devices_per_host} devices of "
                f"a host: a tensor-parallel group stays inside one. Use tp among "
                f"{divisors(math.gcd(devices, cluster.devices_per_host))}")
        layout.check_model(**model.tp_sizes(), owner="memory plan")
    dtypes = precision(param_dtype, optimizer_dtype, stack=stack, grad_dtype=grad_dtype,
                       compute_dtype=compute_dtype)
    size = {what: DTYPE_BYTES[getattr(dtypes, what)]
            for what in ("parameters", "gradients", "optimizer", "compute")}
    if model is not None:
        held, layer_parameters, root_parameters = (
            model.tp_parameters(tp), model.layer_tp_parameters(tp), model.root_tp_parameters(tp))
    else:
        held = parameters
    shard = math.ceil(held / layout.dp_shard)
    per_device = {
        "parameters": shard * size["parameters"],
        "gradients": shard * size["gradients"],
        "optimizer": shard * ADAMW_STATES * size["optimizer"],
        "gathered_root": root_parameters * size["compute"],
        "gathered_layers": PREFETCH_LAYERS * layer_parameters * size["compute"],
        "activations": 0,
        "logits": 0,
    }
    activations = None
    if model is not None:
        counted = model.activation_bytes(
            seq_len, micro_batch, tp=tp, sequence_parallel=sequence_parallel,
            checkpointing=activation_checkpointing, loss_parallel=loss_parallel,
            compute_bytes=size["compute"])
        per_device["activations"] = counted["layers"] + counted["root"]
        per_device["logits"] = counted["logits"]
        activations = {"seq_len": seq_len, "micro_batch": micro_batch,
                       "activation_checkpointing": activation_checkpointing,
                       "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
                       **counted}
    per_device["total"] = sum(per_device.values())
    # A checkpoint's host copy of one host's devices: their parameter and optimizer shards.
    one_set = cluster.devices_per_host * (per_device["parameters"] + per_device["optimizer"])
    sets = max_in_flight + 1
    peers = cluster.hosts > 1
    tier = {"own": TIER_OWN_GENERATIONS if memory_every else 0,
            "peer": TIER_PEER_GENERATIONS if memory_every and peers else 0,
            # handed over: out through Ray's object store and the peer's in; under FSDPv2 also
            # staged and formatted in the training process
            "in_flight": (2 * peers + 2 * (stack == "fsdpv2")) if memory_every else 0}
    per_host = {
        # A sharded load reads each device's own shards, in the training dtype, through host
        # memory; a checkpoint stages every device's parameter and optimizer shards there.
        "at_load": cluster.devices_per_host * per_device["parameters"],
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
    return MemoryPlan(parameters=parameters, layout=layout, cluster=cluster, precision=dtypes,
                      per_device=per_device, per_host=per_host, checkpoints=checkpoints,
                      activations=activations, device_memory=memory, host_memory=host,
                      model=model, request=request)


# ---- remedies: only changes that were planned again and fit -------------------------------------

@dataclass(frozen=True)
class Scale:
    """A larger cluster of the same hardware: its devices, what it is (``label``) and the plan
    flags that describe it."""

    cluster: Cluster
    label: str
    flags: str


# The largest slice of a TPU generation (chips), where it is smaller than the tables of
# standard topologies: Google Cloud TPU docs, "TPU Pod size" (v5e and v6e: 256 chips; v4: 4096).
POD_CHIPS = {"v5e": 256, "v5litepod": 256, "v6e": 256, "v4": 4096}
# At most this many hosts are tried for hardware of any host count.
MAX_HOSTS = 100_000


def larger_clusters(cluster: Cluster, at_least: int = 0, *, accelerator_type: str = "",
                    spmd: bool = False) -> Iterator[Scale]:
    """The clusters of the same hardware with more devices than ``cluster`` (and at least
    ``at_least``), smallest first: for a TPU accelerator type, its standard slice sizes
    (``tpu_slice``, up to the generation's pod); otherwise any count of hosts like these.
    ``spmd``: one worker per host owns its devices (the flags name its accelerators)."""
    try:
        current = tpu_slice(accelerator_type) if tpu_generation(accelerator_type) else None
    except ValueError:
        current = None
    if current is None:
        per_host = cluster.devices_per_host
        start = max(cluster.hosts + 1, math.ceil(at_least / per_host))
        for hosts in range(start, max(start, MAX_HOSTS // per_host) + 1):
            yield Scale(Cluster(hosts * per_host, per_host), f"{hosts} hosts of {per_host} "
                        "devices", f"--nodes {hosts}")
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
        if per_host != cluster.devices_per_host:
            flags += (f" --accelerators-per-worker {bigger.chips_per_host}" if spmd
                      else f" --workers-per-node {per_host}")
        yield Scale(Cluster(bigger.hosts * per_host, per_host), f"a {name} slice "
                    f"({bigger.hosts} host{'s' if bigger.hosts > 1 else ''} of {per_host} "
                    "devices)", flags)


def pick_tp(parameters: int | ModelShape, *, devices: int, devices_per_host: int,
            choices: Sequence[int] | None = None, **options: Any
            ) -> tuple[MemoryPlan, list[MemoryPlan]]:
    """The smallest TP degree whose plan fits a device with room (``TIGHT``), trying
    ``choices`` (default ``Cluster.tp_choices``: within a host, dividing the model) smallest
    first: (the plan picked, every plan tried up to it). Where none has room, the smallest
    that fits at all; where none fits, TP 1's plan (its refusal offers what fits). With the
    device's memory unknown, TP 1. ``options``: the rest of ``plan_memory``'s arguments."""
    if choices is None:
        choices = Cluster(devices, devices_per_host).tp_choices(
            parameters if isinstance(parameters, ModelShape) else None)
    tried = []
    for tp in choices:
        plan = plan_memory(parameters, devices=devices, devices_per_host=devices_per_host, tp=tp,
                           **options)
        tried.append(plan)
        if plan.device_share is None or plan.device_share <= TIGHT:
            return plan, tried
    fitting = [p for p in tried if p.device_share <= 1]
    return (fitting[0] if fitting else tried[0]), tried


def _figures(plan: MemoryPlan) -> str:
    out = [f"{gib(plan.total)} GiB per device"]
    if plan.host_memory is not None:
        out.append(f"up to {gib(plan.per_host['peak'])} GiB per host")
    return ", ".join(out)


def _fewest_devices(plan: MemoryPlan) -> int | None:
    """Fewest devices that could hold ``plan``'s state with room, at its TP degree with FSDP
    over the rest (the gathered parameters and the activations do not shrink with more FSDP
    devices); None when those alone leave no room. 0 when the device's memory is unknown."""
    if plan.device_memory is None:
        return 0
    d = plan.per_device
    fixed = d["gathered_root"] + d["gathered_layers"] + d["activations"] + d["logits"]
    room = TIGHT * plan.device_memory.bytes - fixed
    held = plan.model.tp_parameters(plan.layout.tp) if plan.model else plan.parameters
    state = held * sum(DTYPE_BYTES[getattr(plan.precision, k)] * n for k, n in (
        ("parameters", 1), ("gradients", 1), ("optimizer", ADAMW_STATES)))
    return math.ceil(state / room) * plan.layout.tp if room > 0 else None


BF16 = {"param_dtype": "bf16", "optimizer_dtype": "bf16", "grad_dtype": None,
        "compute_dtype": None}


def _and(parts: Sequence[str]) -> str:
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def _replan(plan: MemoryPlan, **changes: Any) -> MemoryPlan | None:
    """``plan.replan(**changes)``; None for a layout these devices or this model refuse."""
    try:
        return plan.replan(**changes)
    except XLAConfigError:
        return None


def remedies(plan: MemoryPlan, larger: Callable[..., Iterable[Scale]] | None = None,
             pick: bool = False) -> list[str]:
    """What makes ``plan`` fit, each planned again and offered only if it fits with room
    (``MemoryPlan.roomy``), each with plan's flags and its figures: on the same devices, the
    smallest larger TP degree (``MemoryPlan.tp_choices``), FSDP instead of HSDP, activation
    checkpointing, sequence parallelism (with TP), bf16 parameters and AdamW state, one
    checkpoint in flight, the memory tier off (the fewest of these, at the smallest TP, that fit
    together); the smallest larger cluster that fits as it is, and where nothing fits these
    devices the smallest that fits with activation checkpointing, sequence parallelism or bf16
    (``larger(cluster, at_least)``, default ``larger_clusters``: more hosts like these);
    last, the flags for hardware with more memory. ``pick``: the plan's TP was picked
    (``pick_tp``), so is each remedy's, from TP 1 up, and its flags leave ``--tp`` out."""
    changes = []  # (flags, what, plan_memory arguments)
    if plan.sharding == "hsdp":
        changes.append(("--sharding fsdp" if plan.request["sharding"] == "hsdp" else
                        "--dp-replicate 1", f"FSDP over all {plan.devices} devices",
                        {"sharding": "fsdp", "dp_replicate": 1, "dp_shard": REST}))
    tps = [t for t in plan.tp_choices() if pick or t >= plan.layout.tp]

    def tp_flags(tp: int) -> list[str]:
        return [] if pick or tp == plan.layout.tp else [f"--tp {tp}"]

    request = plan.request
    if plan.activations is not None and not request["activation_checkpointing"]:
        changes.append(("--activation-checkpointing", "activation checkpointing",
                        {"activation_checkpointing": True}))
    if plan.activations is not None and not request["sequence_parallel"] and max(tps) > 1:
        changes.append(("--sequence-parallel", "sequence parallelism",
                        {"sequence_parallel": True}))
    bf16 = (plan.precision.parameters, plan.precision.optimizer) != ("bf16", "bf16")
    bf16_flags = "--param-dtype bf16" + (" --optimizer-dtype bf16"
                                         if request["optimizer_dtype"] else "")
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
    fitting: list[tuple[set[int], int]] = []  # (changes, TP degree) that fit
    for n in range(len(changes) + 1):
        for chosen in itertools.combinations(range(len(changes)), n):
            picked = set(chosen)
            with_sp = any("sequence_parallel" in changes[i][2] for i in chosen)
            for tp in tps:
                if any(f <= picked and (pick or t <= tp) for f, t in fitting):
                    break  # as much fits with fewer changes (given, with a smaller TP)
                if (not chosen and (pick or tp == plan.layout.tp)) or (with_sp and tp == 1):
                    continue  # the plan itself (or, picked, every TP alone: all tried)
                again = _replan(plan, tp=tp, **{k: v for i in chosen
                                                for k, v in changes[i][2].items()})
                if again is not None and again.fits and again.roomy:
                    fitting.append((picked, tp))
                    flags = tp_flags(tp) + [changes[i][0] for i in chosen]
                    if tp > 1 if pick else tp != plan.layout.tp:  # the layout says it all
                        what = _and([changes[i][1] for i in chosen
                                     if "dp_replicate" not in changes[i][2]])
                        what = spread(again.layout, again.devices) + (f" with {what}" if what
                                                                      else "")
                    else:
                        what = _and([changes[i][1] for i in chosen])
                    fixes.append(f"{what} ({' '.join(flags)}: {_figures(again)})")
                    break
    # A larger cluster, laid out with FSDP over its hosts and the smallest TP that fits: as
    # the plan is; where nothing fits these devices, also the smallest cluster that fits with
    # the other changes. When FSDP on these devices fits, that is the fix.
    larger = larger or larger_clusters
    found = None
    clusters: list[tuple[tuple[int, ...], str]] = []  # each smaller than the one before
    same = [f for f, _ in fitting]
    others = [i for i, c in enumerate(changes) if c[2].keys() & {
        "activation_checkpointing", "sequence_parallel", "param_dtype"}] if not fixes else []
    passes = [] if plan.sharding == "hsdp" and {0} in same else [
        chosen for n in range(len(others) + 1) for chosen in itertools.combinations(others, n)]
    for chosen in passes:
        extra = {k: v for i in chosen for k, v in changes[i][2].items()}
        needs = [n for n in (_fewest_devices(p) for p in (
            _replan(plan, tp=tp, **extra) for tp in plan.tp_choices()) if p is not None)
            if n is not None]
        if not needs:
            continue
        for scale in larger(plan.cluster, min(needs)):
            if found is not None and scale.cluster.devices >= found:
                break
            for tp in scale.cluster.tp_choices(plan.model):
                again = _replan(plan, devices=scale.cluster.devices,
                                devices_per_host=scale.cluster.devices_per_host, tp=tp,
                                sharding="fsdp", dp_replicate=1, dp_shard=REST, **extra)
                if again is not None and again.fits and again.roomy:
                    break
            else:
                continue
            found = scale.cluster.devices
            flags = [scale.flags] + (["--sharding fsdp"] if request["sharding"] == "hsdp" else
                                     ["--dp-replicate 1"] if plan.sharding == "hsdp" else []) \
                + tp_flags(tp) + [changes[i][0] for i in chosen]
            what = _and([spread(again.layout, again.devices)]
                        + [changes[i][1] for i in chosen])
            clusters.append((chosen, f"{scale.label} with {what} ({' '.join(flags)}: "
                                     f"{_figures(again)})"))
            break
    # The cluster that fits as the plan is, and the smallest (with more changes).
    fixes += [text for i, (chosen, text) in enumerate(clusters)
              if (i == 0 and not chosen) or i == len(clusters) - 1]
    if not fixes:
        fixes.append(f"a shorter --seq-len or a smaller --micro-batch if that is enough (no "
                     f"layout tried fits: TP among {tps}, with and without activation "
                     "checkpointing, sequence parallelism and bf16 state, nor a larger cluster)")
    more = [flag for flag, share in (("--device-memory SIZE", plan.device_share),
                                     ("--host-memory SIZE", plan.host_share))
            if share is not None and share > 1]
    fixes.append(" and ".join(more) + " if the hardware has more")
    return fixes


def format_memory_table(plan: MemoryPlan, tried: Sequence[MemoryPlan] = ()) -> str:
    """The plan as a readable table, in GiB with 2 decimals; ``tried``: the plans ``pick_tp``
    tried, said on the line after the layout."""
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
    layout, cluster = plan.layout, plan.cluster
    how = (f"FSDP, each tensor sharded over all {cluster.devices} devices" if layout.trivial else
           f"{layout.describe()} ({layout.to_text()})")
    lines.append(f"Layout: {cluster.devices} devices on {cluster.hosts} "
                 f"host{'s' if cluster.hosts > 1 else ''} (up to {cluster.devices_per_host} a "
                 f"host); {how}")
    if len(tried) > 1 or (tried and plan.device_memory is not None):
        others = [p for p in tried if p is not plan]
        lines += textwrap.wrap(
            f"Picked TP {layout.tp}, the smallest that fits a device with "
            f"{1 - TIGHT:.0%} left" + (": " + ", ".join(
                f"TP {p.layout.tp} needs {gib(p.total)} GiB" for p in others)
                + f" of {gib(plan.device_memory.bytes)}" if others else "")
            + f" (TP among {plan.tp_choices()}; --tp N plans another)", 100)
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
    a = plan.activations
    if a is not None:
        tp = layout.tp
        lines += textwrap.wrap(
            f"Activations: {a['micro_batch']} x {a['seq_len']} tokens a device (--micro-batch, "
            f"--seq-len); "
            + (f"each layer recomputed in backward, keeping its input, plus one layer's "
               f"{gib(a['per_layer'])} GiB" if a["activation_checkpointing"] else
               f"{plan.model.num_hidden_layers} layers of {gib(a['per_layer'])} GiB, no "
               "activation checkpointing (--activation-checkpointing)")
            + ("" if tp == 1 else "; sequence-parallel norms and residual stream"
               if a["sequence_parallel"] else "; no sequence parallelism (--sequence-parallel)")
            + "; logits " + ("split on the vocabulary (--loss-parallel)" if a["loss_parallel"]
                             and tp > 1 else "whole")
            + " (ModelShape.activation_bytes: Korthikanti et al. 2022, adapted)", 100)
    tier = c["memory_tier_sets"]
    rows = [
        ("Per device", "", ""),
        ("  parameters (shard)", t.parameters, gib(d["parameters"])),
        ("  gradients (shard)", t.gradients, gib(d["gradients"])),
        ("  AdamW state (shard, 2 states)", t.optimizer, gib(d["optimizer"])),
        ("  gathered root (embedding, head)", t.compute, gib(d["gathered_root"])),
        (f"  gathered layers ({PREFETCH_LAYERS}, prefetch)", t.compute,
         gib(d["gathered_layers"])),
        *([] if a is None else [
            ("  activations" + (" (checkpointed)" if a["activation_checkpointing"] else ""),
             t.compute, gib(d["activations"])),
            ("  logits (for the loss)", "fp32", gib(d["logits"]))]),
        ("  total", "", gib(d["total"])),
        (f"Per host ({cluster.devices_per_host} devices)", "", ""),
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
                            "the store's size)" if cluster.hosts > 1 else
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
            + ("" if share > 1 else " for the runtime, the compiler and what is not counted"
               if what == "Device" else " for the OS, Ray, data loading and the runtime"), 100)
    lines += textwrap.wrap(f"At a step the host holds {HOST_AT_STEP}.", 100)
    lines += textwrap.wrap("Not counted: " + "; ".join(not_counted(plan)) + ".", 100)
    return "\n".join(lines)
