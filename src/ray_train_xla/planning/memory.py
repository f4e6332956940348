"""Memory a sharded training run needs, per device and per host, from a model's ``config.json``.

Pure: reads JSON only (neither torch, Ray nor transformers), so ``ray-train-xla plan --model``
answers "does this model fit this cluster?" before anything is started or bought.

- ``load_model_config``: a Hugging Face ``config.json`` (a model directory or the file itself);
- ``model_shape``: the decoder's sizes (``ModelShape``), with the exact parameter count that
  ``transformers`` builds for the Llama-like families in ``FAMILIES``;
- ``plan_memory``: parameters, gradients and AdamW state sharded over the devices (FSDP2 over
  every device, or HSDP: sharded within a host, replicated across hosts), the layers FSDP2
  gathers, and what each host holds at load and at a checkpoint (``MemoryPlan``);
- ``device_memory``: the published memory of one device of each Trainium and TPU generation
  (``DEVICE_MEMORY``); ``MemoryPlan.check`` refuses a layout that does not fit it.

Activations are not counted: they depend on batch, sequence length and activation
checkpointing, which a config does not say. The figures are a floor to size a job against.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_train_xla.errors import XLAConfigError
from ray_train_xla.planning.hardware import TPU_GENERATIONS, TRAINIUM_GENERATIONS, tpu_generation

GIB = 1 << 30
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
SHARDINGS = ("fsdp", "hsdp")
ADAMW_STATES = 2  # exp_avg and exp_avg_sq
# FSDP2 gathers one block for its forward (or backward) and prefetches the next one.
PREFETCH_LAYERS = 2


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
# Gemma2 adds two norms around the MLP; Qwen3 normalises q and k over head_dim.
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
}


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
                "tie_word_embeddings": self.tie_word_embeddings}


def load_model_config(source: str | os.PathLike) -> dict[str, Any]:
    """The JSON of a Hugging Face config: ``source`` is a model directory holding
    ``config.json``, or a JSON file. Raises XLAConfigError naming the path and what to give."""
    path = os.fspath(source)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = (f"{path!r} is a directory without config.json" if os.path.isdir(path)
                 else f"{path!r} does not exist")
        raise XLAConfigError(f"model config: {where}: give a Hugging Face model directory holding "
                             "config.json, or the path of a config.json")
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
    lacks. Raises XLAConfigError for a model_type outside ``FAMILIES`` or a size that is not a
    positive integer."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise XLAConfigError(
            f"model config: model_type={model_type!r} is not supported: expected one of "
            f"{', '.join(repr(t) for t in FAMILIES)} (decoders of the Llama shape; plan others "
            "with their parameter count through ray_train_xla.planning.memory.plan_memory)")

    def value(key: str) -> Any:
        got = config.get(key)
        return family.defaults.get(key) if got is None else got

    def size(key: str, default: int | None = None) -> int:
        got = value(key)
        got = default if got is None else got
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
        qk_norm=family.qk_norm)


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


def parse_size(text: str) -> int:
    """Bytes from ``24GiB``, ``16GB``, ``1.5T``, ``512M`` or a plain count. K, M, G and T are
    powers of 2 with or without ``iB``/``B`` (as ``--max-bytes`` reads them): device memory is
    published in GiB even where it is written "GB". Raises ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"{text!r} is not a size: expected bytes or a number with K, M, G or T "
                         "(powers of 2, e.g. 24GiB, 16GB, 95G)")
    number, unit = match.groups()
    value = int(float(number) * (1 << (10 * "_KMGT".index(unit or "_"))))
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


@dataclass(frozen=True)
class MemoryPlan:
    """What each device and each host holds for a sharded run (bytes). Per device: its shard of
    the parameters, gradients and AdamW state, and the gathered parameters FSDP2 holds at its
    peak (the root unit and ``PREFETCH_LAYERS`` decoder layers, in the compute dtype). Per host:
    its devices' shards at a sharded load and when a checkpoint is staged in host memory."""

    parameters: int
    devices: int
    devices_per_host: int
    sharding: str
    shards: int
    dtypes: Mapping[str, str]
    per_device: Mapping[str, int]
    per_host: Mapping[str, int]
    device_memory: DeviceMemory | None
    model: ModelShape | None = None

    @property
    def total(self) -> int:
        return self.per_device["total"]

    @property
    def fits(self) -> bool | None:
        """Whether the per-device total fits the device's memory; None when that is unknown."""
        return None if self.device_memory is None else self.total <= self.device_memory.bytes

    def min_devices(self) -> int | None:
        """Fewest devices FSDP over every device needs for this plan to fit (None: unknown
        memory, or the gathered parameters alone do not fit one device)."""
        if self.device_memory is None:
            return None
        room = self.device_memory.bytes - self.per_device["gathered_root"] \
            - self.per_device["gathered_layers"]
        state = self.parameters * sum(DTYPE_BYTES[self.dtypes[k]] * n for k, n in
                                      (("parameters", 1), ("gradients", 1),
                                       ("optimizer", ADAMW_STATES)))
        return math.ceil(state / room) if room > 0 else None

    def check(self) -> None:
        """Refuse a layout whose per-device total exceeds the device's memory (XLAConfigError
        naming both figures and what would make it fit). Nothing to check when the memory is
        unknown."""
        if self.fits is not False:
            return
        memory = self.device_memory
        what = (f"{self.model.model_type} ({self.parameters:,} parameters)" if self.model
                else f"{self.parameters:,} parameters")
        layout = (f"FSDP over {self.devices} devices" if self.sharding == "fsdp" else
                  f"HSDP (sharded over the {self.shards} devices of a host, replicated over "
                  f"{self.devices // self.shards} hosts)")
        fixes = []
        need = self.min_devices()
        if need is None:
            gathered = self.per_device["gathered_root"] + self.per_device["gathered_layers"]
            fixes.append(f"the gathered parameters alone need {gib(gathered)} GiB per device, so "
                         "no number of FSDP devices fits: the model needs tensor parallelism, "
                         "which this plan does not model")
        else:
            hosts = math.ceil(need / self.devices_per_host)
            fixes.append(f"at least {need} devices with FSDP over every one ({hosts} hosts of "
                         f"{self.devices_per_host} devices)")
            if self.sharding == "hsdp" and self.devices >= need:
                fixes.append(f"HSDP off (FSDP over all {self.devices} devices, --sharding fsdp)")
        if self.dtypes["parameters"] == "fp32":
            fixes.append("bf16 parameters and gradients (--param-dtype bf16)")
        if self.dtypes["optimizer"] == "fp32":
            fixes.append("bf16 AdamW state (--optimizer-dtype bf16)")
        fixes.append("--device-memory SIZE if this device has more")
        raise XLAConfigError(
            f"memory plan: {what} needs {gib(self.total)} GiB per device with {layout}, but a "
            f"{memory.device} has {gib(memory.bytes)} GiB (activations not counted): use "
            + "; or ".join(fixes) + ".")

    def to_json(self) -> dict[str, Any]:
        memory = self.device_memory
        out: dict[str, Any] = {
            "parameters": self.parameters,
            "layout": {"devices": self.devices, "devices_per_host": self.devices_per_host,
                       "hosts": math.ceil(self.devices / self.devices_per_host),
                       "sharding": self.sharding, "shards": self.shards,
                       "replicas": self.devices // self.shards},
            "dtypes": dict(self.dtypes),
            "per_device": dict(self.per_device),
            "per_host": dict(self.per_host),
            "device_memory": None if memory is None else {
                "name": memory.name, "device": memory.device, "bytes": memory.bytes,
                "source": memory.source},
            "fits": self.fits,
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
                sharding: str = "fsdp", param_dtype: str = "bf16", grad_dtype: str | None = None,
                optimizer_dtype: str = "fp32", compute_dtype: str = "bf16",
                layer_parameters: int = 0, root_parameters: int = 0,
                memory: DeviceMemory | None = None) -> MemoryPlan:
    """The memory of a sharded run of ``parameters`` (a count, or a ``ModelShape``, which also
    gives the layer and root sizes) over ``devices`` (``devices_per_host`` on each host).

    ``sharding``: "fsdp" shards over every device; "hsdp" over the devices of one host,
    replicated across hosts (``get_sharded_mesh("hsdp")``). ``param_dtype``: the sharded
    parameters as the optimizer updates them ("bf16", or "fp32" master weights with
    ``mixed_precision="bf16"`` computing in bf16); gradients follow it unless ``grad_dtype``
    says otherwise. ``optimizer_dtype``: AdamW's two states ("fp32": 8 bytes a parameter).
    ``memory`` (see ``device_memory``) is what ``MemoryPlan.check`` compares with."""
    model = parameters if isinstance(parameters, ModelShape) else None
    if model is not None:
        parameters, layer_parameters, root_parameters = (
            model.parameters, model.layer_parameters, model.root_parameters)
    for name, value in (("parameters", parameters), ("devices", devices),
                        ("devices_per_host", devices_per_host)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise XLAConfigError(f"memory plan: {name}={value!r} is not valid: expected a "
                                 "positive integer")
    if sharding not in SHARDINGS:
        raise XLAConfigError(f"memory plan: sharding={sharding!r} is not valid: expected one of "
                             f"{', '.join(repr(s) for s in SHARDINGS)}")
    grad_dtype = grad_dtype or param_dtype
    sizes = {what: _dtype(name, what) for what, name in (
        ("param_dtype", param_dtype), ("grad_dtype", grad_dtype),
        ("optimizer_dtype", optimizer_dtype), ("compute_dtype", compute_dtype))}
    if sharding == "hsdp":
        if devices % devices_per_host:
            raise XLAConfigError(
                f"memory plan: HSDP shards within a host, so every host must hold the same "
                f"number of devices: {devices} devices are not hosts of {devices_per_host}; "
                "give equal hosts, or shard over every device (fsdp)")
        shards = devices_per_host
    else:
        shards = devices
    devices_per_host = min(devices_per_host, devices)
    shard = math.ceil(parameters / shards)
    per_device = {
        "parameters": shard * sizes["param_dtype"],
        "gradients": shard * sizes["grad_dtype"],
        "optimizer": shard * ADAMW_STATES * sizes["optimizer_dtype"],
        "gathered_root": root_parameters * sizes["compute_dtype"],
        "gathered_layers": PREFETCH_LAYERS * layer_parameters * sizes["compute_dtype"],
    }
    per_device["total"] = sum(per_device.values())
    per_host = {
        # A sharded load reads each device's own shards, in the training dtype, through host
        # memory; a checkpoint stages every device's parameter and optimizer shards there.
        "at_load": devices_per_host * per_device["parameters"],
        "at_step": 0,
        "at_checkpoint": devices_per_host * (per_device["parameters"] + per_device["optimizer"]),
    }
    dtypes = {"parameters": param_dtype, "gradients": grad_dtype, "optimizer": optimizer_dtype,
              "compute": compute_dtype}
    return MemoryPlan(parameters=parameters, devices=devices, devices_per_host=devices_per_host,
                      sharding=sharding, shards=shards, dtypes=dtypes, per_device=per_device,
                      per_host=per_host, device_memory=memory, model=model)


def format_memory_table(plan: MemoryPlan) -> str:
    """The plan as a readable table, in GiB with 2 decimals."""
    d, h, t = plan.per_device, plan.per_host, plan.dtypes
    lines = []
    if plan.model is not None:
        name, size = plan.model.largest_tensor
        lines.append(f"Model: {plan.model.model_type}, {plan.parameters:,} parameters "
                     f"({plan.model.num_hidden_layers} layers of {plan.model.layer_parameters:,}; "
                     f"largest tensor {name}, {size:,})")
    else:
        lines.append(f"Model: {plan.parameters:,} parameters")
    hosts = math.ceil(plan.devices / plan.devices_per_host)
    layout = (f"FSDP, each tensor sharded over all {plan.devices} devices" if plan.sharding == "fsdp"
              else f"HSDP, sharded over the {plan.shards} devices of a host, replicated over "
              f"{plan.devices // plan.shards} hosts")
    lines.append(f"Layout: {plan.devices} devices on {hosts} host{'s' if hosts > 1 else ''} "
                 f"(up to {plan.devices_per_host} a host); {layout}")
    memory = plan.device_memory
    lines.append(f"Device memory: {gib(memory.bytes)} GiB per {memory.device}" if memory else
                 "Device memory: unknown (give --accelerator-type or --device-memory to check "
                 "the fit)")
    rows = [
        ("Per device", "", ""),
        ("  parameters (shard)", t["parameters"], gib(d["parameters"])),
        ("  gradients (shard)", t["gradients"], gib(d["gradients"])),
        ("  AdamW state (shard, 2 states)", t["optimizer"], gib(d["optimizer"])),
        ("  gathered root (embedding, head)", t["compute"], gib(d["gathered_root"])),
        (f"  gathered layers ({PREFETCH_LAYERS}, prefetch)", t["compute"],
         gib(d["gathered_layers"])),
        ("  total", "", gib(d["total"])),
        (f"Per host ({plan.devices_per_host} devices)", "", ""),
        ("  at load (own shards)", t["parameters"], gib(h["at_load"])),
        ("  at a step", "", gib(h["at_step"])),
        ("  at a checkpoint (staged shards)", "", gib(h["at_checkpoint"])),
    ]
    width = max(len(r[0]) for r in rows)
    lines.append(f"{'':<{width}}  {'dtype':<5}  {'GiB':>8}")
    lines += [f"{label:<{width}}  {dtype:<5}  {value:>8}".rstrip() for label, dtype, value in rows]
    if memory is not None:
        share = d["total"] / memory.bytes
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(f"Fit: {gib(d['total'])} of {gib(memory.bytes)} GiB per device "
                     f"({share:.0%}): {verdict}, before activations")
    lines += textwrap.wrap(f"At a step the host holds {HOST_AT_STEP}.", 100)
    lines += textwrap.wrap("Not counted: " + "; ".join(NOT_COUNTED) + ".", 100)
    return "\n".join(lines)
