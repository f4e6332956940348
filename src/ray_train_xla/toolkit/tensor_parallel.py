"""Tensor parallelism (TP) and sequence parallelism (SP) with FSDP2 on one DeviceMesh, on the
native stacks and their CPU twins (torch's ``torch.distributed.tensor.parallel``).

The mesh has the dims ``("dp_replicate", "dp_shard", "tp")`` (sizes may be 1). :func:`parallelize`
shards the model over ``tp`` with :func:`~torch.distributed.tensor.parallel.parallelize_module`,
then with FSDP2 over the data-parallel dims (``dp_shard``, or ``dp_replicate`` x ``dp_shard`` for
HSDP), as ``fsdp2.prepare_fsdp2`` does: per block, then the root. With ``tp`` of 1 and
``dp_replicate`` of 1 that is today's FSDP2 over a 1-D mesh, placements and checkpoints alike.

The plan: a Hugging Face decoder brings its own (``config.base_model_tp_plan`` under the base
model's attribute, plus the head's ``_tp_plan``), which :func:`tp_plan` maps to torch's styles;
any other model takes a plan in ``parallelize_module``'s form (module path -> ParallelStyle,
``*`` matching one path atom). TP peers (the ranks of one ``tp`` group) must be fed the same
rows; the ranks of the data-parallel dims each their own.

Under torch_xla SPMD the same plan becomes partition specs (:func:`partition_specs`): the split
each style makes, on the SPMD mesh's axes, which ``sharding.prepare_sharded_model`` marks before
torch_xla's FSDPv2 shards the rest. This module never imports torch_xla.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from typing import Any

import torch

# The Hugging Face TP styles with a torch equivalent (transformers/distributed/tensor_parallel.py
# registers them; the older names too). Others (packed, per-head unit, expert, MLA, local-tensor
# styles) have none here: refused, naming the modules.
COLWISE = {"colwise", "local_colwise"}
ROWWISE = {"rowwise", "local_rowwise"}
COLWISE_GATHER = {"colwise_rep", "colwise_gather_output"}
ROWWISE_SPLIT = {"rowwise_rep", "rowwise_split_input"}
EMBEDDING_ROWWISE = "embedding_rowwise"
EMBEDDING_COLWISE = "embedding_colwise"
SEQUENCE = "sequence_parallel"
# A norm between a colwise and a rowwise layer (Qwen3's, Gemma 3's per-head q_norm/k_norm): it
# sees this rank's heads only, so its replicated weight's gradient is summed over the TP group.
REPLICATED_GRAD_SUM = "replicated_with_grad_allreduce"
KEEP = {"replicate"}  # every rank keeps the whole parameter: nothing to do
HF_STYLES = sorted({*COLWISE, *ROWWISE, *COLWISE_GATHER, *ROWWISE_SPLIT, EMBEDDING_ROWWISE,
                    EMBEDDING_COLWISE, SEQUENCE, REPLICATED_GRAD_SUM, *KEEP})

TP_DIM = "tp"
DP_DIMS = ("dp_replicate", "dp_shard")


def _wildcard(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def is_hf_model(model: torch.nn.Module) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (it has a config and a base model)."""
    return hasattr(model, "config") and hasattr(model, "base_model") and hasattr(model, "base_model_prefix")


def hf_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's own Hugging Face TP plan, keys from the root (``*`` for layer numbers): the
    head's ``_tp_plan`` (``lm_head``), the base model's ``config.base_model_tp_plan`` under the
    base model's attribute (``model.layers.*.self_attn.q_proj``), and the input embeddings on
    the vocabulary (``embedding_rowwise``) unless the plan names them, as transformers 5 does.
    Empty when the base model has none."""
    base = model.base_model
    config = getattr(base, "config", model.config)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base_plan:
        return {}
    prefix = "" if base is model else f"{model.base_model_prefix}."
    plan = {} if base is model else dict(getattr(type(model), "_tp_plan", None) or {})
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    name = next((n for n, m in base.named_children() if m is embeddings), None)
    if isinstance(embeddings, torch.nn.Embedding) and name and name not in base_plan:
        plan[prefix + name] = EMBEDDING_ROWWISE
    plan.update({prefix + k: v for k, v in base_plan.items()})
    return plan


def expand(plan: dict[str, Any], model: torch.nn.Module, *, what: str = "plan") -> dict[str, Any]:
    """``plan`` with each key's ``*`` (one path atom, as ``parallelize_module`` matches) replaced
    by the model's module names, in the model's order. Raises ValueError for a key that names
    no module (a parameter, or nothing)."""
    modules = [n for n, _ in model.named_modules() if n]
    params = {n for n, _ in model.named_parameters()}
    out: dict[str, Any] = {}
    for key, style in plan.items():
        atoms = key.split(".")
        found = [n for n in modules if len(n.split(".")) == len(atoms)
                 and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), atoms))]
        if not found:
            kind = "a parameter" if any(fnmatch.fnmatchcase(p, key) for p in params) else "nothing"
            raise ValueError(f"{what}: the key {key!r} names {kind} in {type(model).__name__}; a "
                             "plan maps module paths (like 'layers.*.attn.wq') to ParallelStyles")
        for name in found:
            out[name] = style
    return out


def tp_plan(model: torch.nn.Module, sequence_parallel: bool = False, *,
            loss_parallel: bool = False) -> dict:
    """The Hugging Face decoder ``model``'s own TP plan as torch styles, one entry per module
    (``*`` expanded): colwise -> ``ColwiseParallel``, rowwise -> ``RowwiseParallel``,
    ``colwise_gather_output`` (``colwise_rep``) gathers the output, ``rowwise_split_input``
    (``rowwise_rep``) splits a replicated input, ``embedding_rowwise`` is a vocabulary-parallel
    embedding (``RowwiseParallel`` on ``nn.Embedding``), ``embedding_colwise`` splits the
    hidden dim, ``sequence_parallel`` -> ``SequenceParallel``, and
    ``replicated_with_grad_allreduce`` (per-head norms) a weight replicated over the TP group
    whose gradient is summed over it.

    ``sequence_parallel``: the residual stream between the layers is split on the sequence
    (dim 1) over the TP group: the embedding's output is reduce-scattered, each decoder layer's
    norms run on their slice (``SequenceParallel``), the attention's ``hidden_states`` and the
    MLP's input are all-gathered (``PrepareModuleInput``), and its row-wise outputs
    reduce-scattered. The model's outputs (``last_hidden_state``, ``hidden_states``) are then
    each rank's slices of the sequence; the logits are whole. For training: the sequence
    length is a multiple of the TP degree (:func:`parallelize` refuses others) and
    ``logits_to_keep`` is left at 0.

    ``loss_parallel``: the output projection's logits stay split on the vocabulary (a DTensor,
    ``Shard(-1)``); compute the loss and run backward inside
    ``torch.distributed.tensor.parallel.loss_parallel()``, which never gathers them.

    Raises ValueError for a model without a plan, or a style torch has no equivalent for."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    name = type(model).__name__
    if not is_hf_model(model):
        raise ValueError(f"tp_plan: {name} is not a Hugging Face model; pass plan= in "
                         "parallelize_module's form ({module path: ParallelStyle})")
    strings = hf_plan(model)
    if not strings:
        raise ValueError(f"tp_plan: {name} has no tensor-parallel plan (its config's "
                         "base_model_tp_plan is empty); pass plan= in parallelize_module's form")
    unknown = {k: v for k, v in strings.items() if v not in HF_STYLES}
    if unknown:
        raise ValueError(f"tp_plan: {name}'s plan has styles with no torch equivalent here: "
                         f"{unknown}; known: {HF_STYLES}. Pass plan= in parallelize_module's form")
    strings = expand({k: v for k, v in strings.items() if v not in KEEP}, model,
                     what=f"tp_plan ({name}'s own plan)")
    modules = dict(model.named_modules())
    head = _name_of(model, model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)
    seq = Shard(1) if sequence_parallel else Replicate()
    out = {}
    for key, style in strings.items():
        if key == head and style in COLWISE_GATHER:
            out[key] = ColwiseParallel(input_layouts=seq,
                                       output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)
        elif style in COLWISE:
            out[key] = ColwiseParallel()
        elif style in COLWISE_GATHER:
            out[key] = ColwiseParallel(output_layouts=Replicate())
        elif style in ROWWISE | ROWWISE_SPLIT:
            out[key] = RowwiseParallel(
                input_layouts=Replicate() if style in ROWWISE_SPLIT else Shard(-1),
                output_layouts=seq, use_local_output=not sequence_parallel)
        elif style == EMBEDDING_ROWWISE:
            out[key] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                       use_local_output=not sequence_parallel)
        elif style == EMBEDDING_COLWISE:
            if sequence_parallel:
                raise ValueError(f"tp_plan: sequence_parallel with {key} split on the hidden "
                                 "dim (embedding_colwise) is not supported; leave it off")
            out[key] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == SEQUENCE:
            out[key] = SequenceParallel()
        elif style == REPLICATED_GRAD_SUM:
            # Its input is this rank's heads: any dimension but the normalised (last) one may
            # stand for them, so dim 0. Forward is local; the replicated weight's gradient is
            # the sum over the TP group, as Hugging Face's all-reduce hook makes it.
            out[key] = SequenceParallel(sequence_dim=0, use_local_output=True)
        if not isinstance(modules[key], (torch.nn.Linear, torch.nn.Embedding)) and \
                style not in (SEQUENCE, REPLICATED_GRAD_SUM):
            raise ValueError(f"tp_plan: {key} is a {type(modules[key]).__name__}, but torch's "
                             f"{type(out[key]).__name__} ({style}) takes nn.Linear or nn.Embedding; "
                             "pass plan= in parallelize_module's form")
    if sequence_parallel:
        out.update(_sequence_parallel_extras(model, out, head))
        if head is not None and head not in out:
            raise ValueError(f"tp_plan: sequence_parallel needs the output projection {head} in "
                             f"{name}'s plan (colwise_gather_output), to gather the sequence")
    elif loss_parallel and (head is None or head not in out):
        raise ValueError(f"tp_plan: loss_parallel needs an output projection in {name}'s plan "
                         "(its lm_head, colwise_gather_output)")
    return out


def _name_of(model: torch.nn.Module, module) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or "Norm" in type(module).__name__


def _sequence_parallel_extras(model: torch.nn.Module, styles: dict, head: str | None) -> dict:
    """The styles sequence parallelism adds to a decoder's plan: each decoder layer's norms on
    the sequence slice, its attention's ``hidden_states`` and its MLP's input gathered; the
    base model's final norm. Refuses a layer holding anything else with parameters."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    modules = dict(model.named_modules())
    blocks = {n.rpartition(".")[0] for n in styles if n != head and "." in n}  # attention, MLP
    layers = {b.rpartition(".")[0] for b in blocks} - {""}
    base = _name_of(model, model.base_model)
    extras: dict = {}
    for layer in sorted(layers, key=list(modules).index):
        if any(True for _ in modules[layer].parameters(recurse=False)):
            raise ValueError(f"tp_plan: sequence_parallel: {_wildcard(layer)} holds parameters "
                             "of its own; it knows decoder layers built of norms, attention and MLP")
        for child_name, child in modules[layer].named_children():
            full = f"{layer}.{child_name}"
            if full in blocks:
                if any(k.startswith(full + ".") and "Attention" in type(child).__name__ for k in styles):
                    extras[full] = PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                        use_local_output=True)
                else:
                    extras[full] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),),
                                                      use_local_output=True)
            elif _is_norm(child):
                extras[full] = SequenceParallel()
            elif any(True for _ in child.parameters()):
                raise ValueError(
                    f"tp_plan: sequence_parallel: {_wildcard(full)} ({type(child).__name__}) is "
                    "neither a norm nor a module the plan shards; leave sequence_parallel off")
    base_module = modules.get(base or "", model)
    prefix = f"{base}." if base else ""
    for child_name, child in base_module.named_children():
        if _is_norm(child):  # the final norm: its output goes to the head as a local slice
            extras[prefix + child_name] = SequenceParallel(use_local_output=True)
    return extras


def check_divisible(model: torch.nn.Module, styles: dict, tp: int) -> None:
    """Raise ValueError, naming the modules and the valid TP degrees, when ``tp`` does not
    divide what ``styles`` splits: the attention heads and key/value heads of a Hugging Face
    model, and the split width of each sharded nn.Linear / nn.Embedding."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    sizes: dict[str, int] = {}  # what must divide -> its size
    for key, style in styles.items():
        module = modules.get(key)
        if isinstance(style, ColwiseParallel):
            dim = {torch.nn.Linear: "out_features", torch.nn.Embedding: "embedding_dim"}
        elif isinstance(style, RowwiseParallel):
            dim = {torch.nn.Linear: "in_features", torch.nn.Embedding: "num_embeddings"}
        else:
            continue
        attr = next((a for c, a in dim.items() if isinstance(module, c)), None)
        if attr:
            sizes.setdefault(f"{_wildcard(key)}.{attr}", getattr(module, attr))
    if is_hf_model(model):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        attention = sorted({_wildcard(k.rpartition(".")[0]) for k in styles
                            if "Attention" in type(modules.get(k.rpartition(".")[0])).__name__})
        if heads and attention:
            where = ", ".join(attention)
            sizes = {f"num_attention_heads ({where})": heads,
                     f"num_key_value_heads ({where})": kv, **sizes}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        g = math.gcd(*sizes.values())
        valid = [d for d in range(1, g + 1) if g % d == 0]
        raise ValueError(
            f"parallelize: tp={tp} does not divide "
            + "; ".join(f"{k}={v}" for k, v in bad.items())
            + f" of {type(model).__name__}: each device must hold whole heads and equal slices. "
            f"Valid tp: {', '.join(map(str, valid))}")


# The dimension of a weight each style splits over the TP group: nn.Linear's weight is
# [out_features, in_features], nn.Embedding's [num_embeddings, embedding_dim]. Column-wise
# splits the output (Linear: out_features; Embedding: embedding_dim), row-wise the input
# (Linear: in_features; Embedding: the vocabulary).
_SPLIT_DIM = {("ColwiseParallel", torch.nn.Linear): 0, ("ColwiseParallel", torch.nn.Embedding): 1,
              ("RowwiseParallel", torch.nn.Linear): 1, ("RowwiseParallel", torch.nn.Embedding): 0}


def partition_specs(model: torch.nn.Module, styles: dict, tp_axis: str = "model",
                    dp_axis: str = "fsdp") -> dict[str, tuple]:
    """A plan (``styles``: module path -> torch ``ParallelStyle``, ``*`` expanded, as
    :func:`tp_plan` and :func:`expand` give it) as torch_xla SPMD partition specs: for each
    parameter the plan splits, by its name in ``model``, the dimension the style splits over
    ``tp_axis`` and the other over ``dp_axis`` (FSDP). nn.Linear's weight ``[out, in]`` is
    ``(tp, dp)`` column-wise and ``(dp, tp)`` row-wise; nn.Embedding's ``[vocab, dim]`` is
    ``(tp, dp)`` row-wise (a vocabulary-parallel embedding) and ``(dp, tp)`` column-wise; a
    column-wise bias is ``(tp,)``. A row-wise bias, norms and what ``SequenceParallel`` names
    are whole on each TP peer: left out, for FSDPv2 to shard over ``dp_axis`` alone. Styles
    place only parameters here (XLA's sharding propagation places the activations: a style's
    input and output layouts change nothing). Raises ValueError for other styles, a module
    that is not nn.Linear or nn.Embedding, or a tied parameter split two ways."""
    modules = dict(model.named_modules())
    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter's first name
    by_param: dict[int, tuple[str, tuple]] = {}
    specs: dict[str, tuple] = {}
    for key, style in styles.items():
        kind = type(style).__name__
        if kind == "SequenceParallel":
            continue
        if kind not in ("ColwiseParallel", "RowwiseParallel"):
            raise ValueError(f"tp_plan: {key} has {kind}; under torch_xla SPMD a plan places "
                             "parameters only: ColwiseParallel, RowwiseParallel, or "
                             "SequenceParallel (left whole over tp)")
        module = modules[key]
        dim = next((d for (k, c), d in _SPLIT_DIM.items() if k == kind and isinstance(module, c)),
                   None)
        if dim is None:
            raise ValueError(f"tp_plan: {key} is a {type(module).__name__}, but {kind} splits "
                             "nn.Linear or nn.Embedding")
        wanted = {"weight": (tp_axis, dp_axis) if dim == 0 else (dp_axis, tp_axis)}
        if kind == "ColwiseParallel" and isinstance(module, torch.nn.Linear):
            wanted["bias"] = (tp_axis,)
        for attr, spec in wanted.items():
            param = getattr(module, attr, None)
            if param is None:
                continue
            name = f"{key}.{attr}"
            first, before = by_param.setdefault(id(param), (name, spec))
            if before != spec:
                raise ValueError(f"tp_plan: {first} and {name} are one tied parameter, but the "
                                 f"plan splits them differently ({before} and {spec}); give them "
                                 "the same split or untie them")
            specs[names[id(param)]] = spec
    return specs


def _ties(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter shared by several modules (tied embeddings), first first."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: torch.nn.Module, ties: list[list[str]]) -> None:
    """Share each tied parameter again after TP gave each module its own DTensor; refuses ties
    whose modules TP splits differently."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            spec = lambda p: (tuple(getattr(p, "placements", ())), tuple(p.shape))  # noqa: E731
            if spec(other) != spec(first):
                raise ValueError(f"parallelize: {names[0]} and {name} are one tied parameter, but "
                                 f"the plan splits them differently ({spec(first)[0]} and "
                                 f"{spec(other)[0]}); give them the same split or untie them")
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = first


def data_parallel_mesh(mesh):
    """The sub-mesh FSDP2 shards over: ``mesh["dp_shard"]`` (a 1-D mesh: FSDP, placements
    ``(Shard(0),)`` as today) when ``dp_replicate`` is 1 or absent, else
    ``mesh["dp_replicate", "dp_shard"]`` (HSDP)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "dp_replicate" in names and mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def parallelize(
    model: torch.nn.Module,
    mesh,
    plan: dict | None = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    auto_wrap_policy=None,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` over ``mesh`` (dims ``("dp_replicate", "dp_shard", "tp")``, sizes may be
    1): tensor parallelism over ``tp``, then FSDP2 over the data-parallel dims, per block
    ``auto_wrap_policy`` names, then the root, with ``mixed_precision`` and
    ``activation_checkpointing`` as ``prepare_sharded_model`` takes them. Every worker starts
    from rank 0's values. Returns the model (an FSDPModule).

    ``plan``: ``{module path: ParallelStyle}`` (``*`` matches one path atom), used as given;
    default the Hugging Face model's own (:func:`tp_plan`, with ``sequence_parallel`` and
    ``loss_parallel``). With ``tp`` of 1 no plan is applied. Raises ValueError for a mesh
    without these dims, a model without a plan, ``tp`` not dividing the heads or a split
    width, and ``sequence_parallel``/``loss_parallel`` with a plan of your own (write them
    into it)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.parallel import parallelize_module

    from ray_train_xla.toolkit.fsdp2 import prepare_fsdp2

    names = tuple(mesh.mesh_dim_names or ())
    if TP_DIM not in names or "dp_shard" not in names or not set(names) <= {TP_DIM, *DP_DIMS}:
        raise ValueError(f"parallelize: the mesh dims {names} are not ('dp_replicate', "
                         "'dp_shard', 'tp') (dp_replicate may be left out)")
    if plan is not None and (sequence_parallel or loss_parallel):
        raise ValueError("parallelize: sequence_parallel and loss_parallel shape the Hugging Face "
                         "plan; a plan of your own carries its own SequenceParallel and output styles")
    if isinstance(model, FSDPModule):
        raise ValueError("parallelize: the model is already sharded with FSDP2; pass the plain model")
    tp = mesh[TP_DIM].size()
    split = None
    if tp > 1:
        if plan is None:
            styles = tp_plan(model, sequence_parallel, loss_parallel=loss_parallel)
        else:
            styles = expand(plan, model, what="parallelize")
        check_divisible(model, styles, tp)

        def split(model: torch.nn.Module) -> None:
            ties = _ties(model)
            # prepare_fsdp2 gave every rank rank 0's values: each takes its own slices, no scatter.
            many = dist.is_initialized() and dist.get_world_size() > 1
            parallelize_module(model, mesh[TP_DIM], styles, src_data_rank=None if many else 0)
            _retie(model, ties)

    model = prepare_fsdp2(model, data_parallel_mesh(mesh), auto_wrap_policy=auto_wrap_policy,
                          mixed_precision=mixed_precision,
                          activation_checkpointing=activation_checkpointing,
                          reshard_after_forward=reshard_after_forward, before_sharding=split)
    if split is not None and sequence_parallel:  # first of all hooks: before FSDP2 gathers
        model.register_forward_pre_hook(functools.partial(_whole_slices, tp), with_kwargs=True,
                                        prepend=True)
    return model


def _whole_slices(tp: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Sequence parallelism splits the sequence in ``tp`` equal slices: refuse, before any
    collective, a batch whose length is not a multiple of ``tp``."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] % tp:
            raise ValueError(f"sequence_parallel: the sequence length {value.shape[1]} is not a "
                             f"multiple of tp={tp}; pad each batch to a multiple of {tp}")


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of ``parameters`` by their global norm, as
    ``torch.nn.utils.clip_grad_norm_`` does on one device, when they are DTensors on different
    meshes (a TP model's split parameters on ``(dp_shard, tp)``, its unsplit norms on
    ``dp_shard`` alone), which torch's cannot stack. Returns the norm, a plain tensor, the same
    on every rank."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        norm = get_total_norm([p.grad for p in params], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]), norm_type)
    for params in groups.values():
        clip_grads_with_norm_(params, max_norm, total.to(params[0].grad.device))
    return total
