"""Sharded state: find it, keep it out of the replicated helpers, shard models with it.

The replicated helpers (``prepare_model``, ``optimizer_step``, the single-file checkpoint) assume
every worker holds the whole model. With sharded state that is silently wrong: rank 0's values
would overwrite the other ranks' shards, gradients that XLA already reduced would be averaged
again, and rank 0 alone would pull a sharded tensor to the host. So they call
:func:`refuse_sharded` first, which names the first sharded thing it finds and the path to use.

Sharded means here: an XLA tensor with an SPMD sharding that is not fully replicated, an
``XLAShardedTensor``, a ``DTensor``, a torch_xla FSDP (v1) flat parameter or state-dict key, or a
module wrapped in torch_xla's FSDP or FSDPv2.

:func:`prepare_sharded_model` and :func:`get_sharded_mesh` are one call on every config: torch_xla's
FSDPv2 over an SPMD mesh under ``TorchXLAConfig(spmd=True)``, FSDP2 (``fully_shard``) over a
DeviceMesh on the native configs and their CPU twins (``fsdp2.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ray_train_xla.errors import ShardedStateError
from ray_train_xla.toolkit.observability.flops import note_model
from ray_train_xla.toolkit.stacks import stack

# The two layouts of sharded state a checkpoint holds: torch_xla SPMD tensors, DTensors.
SPMD, DTENSOR = "spmd", "dtensor"
FSDP_AXES = ("fsdp", "model")
FSDP_V1_CLASS = "XlaFullyShardedDataParallel"
# torch_xla's FSDP module classes, as walk_sharded describes them.
FSDP_MODULES = {"SpmdFullyShardedDataParallel": "a torch_xla FSDPv2 module (SpmdFullyShardedDataParallel)",
                FSDP_V1_CLASS: "a torch_xla FSDP module (XlaFullyShardedDataParallel)"}
# Keys of a torch_xla FSDP (v1) state dict: per-rank flat shards, not the model's parameters.
FSDP_V1_KEYS = ("_fsdp_wrapped_module", "flat_param")

SHARDED_PATH = (
    "rtx.prepare_sharded_model(model) (torch_xla FSDPv2 with TorchXLAConfig(spmd=True), FSDP2 with "
    "TorchNeuronConfig or TorchTPUConfig); save and load its state with rtx.save_checkpoint / "
    "rtx.load_checkpoint, which write every rank's own shards"
)


def spmd_sharding(tensor: torch.Tensor) -> str:
    """The SPMD sharding of an XLA tensor when it is split over devices, else ""."""
    if "torch_xla" not in sys.modules or tensor.device.type != "xla":
        return ""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec(tensor)
    if not spec or "replicated" in spec or "maximal" in spec:
        return ""
    return spec


def describe_tensor(value: Any) -> str:
    """How ``value`` is sharded ("" for a tensor every rank holds whole, or a non-tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = None
    if DTensor is not None and isinstance(value, DTensor):
        return f"a DTensor with placements {tuple(value.placements)}"
    if type(value).__name__ == "XLAShardedTensor":
        return f"an XLAShardedTensor ({value.sharding_spec})"
    if not isinstance(value, torch.Tensor):
        return ""
    if getattr(value, "_is_sharded", False):
        return "a torch_xla FSDP flat parameter shard"
    spec = spmd_sharding(value)
    return f"an SPMD tensor sharded {spec}" if spec else ""


def walk_sharded(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, description) of every sharded thing in nested modules/optimizers/containers."""
    if isinstance(value, torch.nn.Module):
        for name, module in value.named_modules(prefix=path):
            if type(module).__name__ in FSDP_MODULES:
                yield name or "model", FSDP_MODULES[type(module).__name__]
        for name, tensor in (*value.named_parameters(prefix=path), *value.named_buffers(prefix=path)):
            if desc := describe_tensor(tensor):
                yield name, desc
        return
    if isinstance(value, torch.optim.Optimizer):
        for g, group in enumerate(value.param_groups):
            for i, param in enumerate(group["params"]):
                if desc := describe_tensor(param):
                    yield f"{path}param_groups[{g}].params[{i}]", desc
        for s, state in enumerate(value.state.values()):
            yield from walk_sharded(state, f"{path}state[{s}].")
        return
    if desc := describe_tensor(value):
        yield path.rstrip("."), desc
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and any(k in key for k in FSDP_V1_KEYS):
                yield f"{path}{key}", "a torch_xla FSDP (v1) state-dict entry (a per-rank flat shard)"
                continue
            yield from walk_sharded(item, f"{path}{key}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from walk_sharded(item, f"{path}{i}.")


def find_sharded(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first sharded thing in ``value`` as (path, description), or None."""
    return next(walk_sharded(value, path), None)


def is_sharded(value: Any) -> bool:
    """True when ``value`` (a module, optimizer, tensor or nested state) holds sharded state."""
    return find_sharded(value) is not None


def refuse_sharded(value: Any, helper: str, why: str, use: str = SHARDED_PATH, path: str = "") -> None:
    """Raise ShardedStateError when ``value`` holds sharded state that ``helper`` cannot handle."""
    found = find_sharded(value, path)
    if found is not None:
        where, desc = found
        raise ShardedStateError(
            f"{helper}: {where} is {desc}. {helper} {why}, which would silently be wrong for "
            f"sharded state. Use {use}."
        )


def get_sharded_mesh(shape=None):
    """The mesh for :func:`prepare_sharded_model` over every device of the job.

    torch_xla (``TorchXLAConfig(spmd=True)``): an SPMD mesh with axes ("fsdp", "model") of
    the layout's sizes ``(dp_shard, tp)``: by default every device is on ``fsdp``
    (parameters, gradients and optimizer state split N ways); under a layout with ``tp`` the
    ``model`` axis is tensor parallelism, and with ``dp_replicate`` a ``data`` axis of replicas
    comes first (``("data", "fsdp", "model")``). A ``shape`` of 2 or 3 sizes names those axes.
    Native configs (FSDP2): a DeviceMesh over the workers, 1-D ``("fsdp",)`` by default; a 2-D
    ``shape`` ``(replicas, shards)`` gives ``("replicate", "fsdp")`` for HSDP, and ``"hsdp"``
    one replica per node (shards within a node, replicas across nodes). Under a layout of more
    than FSDP (the config's ``parallelism``, ``configure_parallelism``), the layout's mesh,
    made once: ``("dp_replicate", "dp_shard", "tp")``."""
    return {DTENSOR: dtensor_sharded_mesh, SPMD: spmd_sharded_mesh}[stack().sharded](shape)


def dtensor_sharded_mesh(shape=None):
    """``get_sharded_mesh`` on the native stacks (FSDP2)."""
    from ray_train_xla.toolkit.fsdp2 import native_mesh
    from ray_train_xla.toolkit.parallel import device_mesh, get_layout

    if shape is None and not get_layout().trivial:
        return device_mesh()  # the layout's: ("dp_replicate", "dp_shard", "tp")
    return native_mesh(shape)


def spmd_sharded_mesh(shape=None):
    """``get_sharded_mesh`` under torch_xla SPMD (FSDPv2)."""
    from ray_train_xla.toolkit.parallel import get_layout
    from ray_train_xla.toolkit.runtime import runtime
    from ray_train_xla.toolkit.spmd import get_mesh

    if shape is None:
        # The layout's dimensions, row-major as its coordinates (tp innermost): one name each,
        # torch_xla's ("fsdp" is the axis FSDPv2 shards over), "data" only with replicas.
        layout = get_layout()
        runtime().layout_used = True
        shape = layout.shape if layout.dp_replicate > 1 else (layout.dp_shard, layout.tp)
    return get_mesh(shape, ("data", *FSDP_AXES) if len(shape) == 3 else FSDP_AXES)


def _xla_policy(policy):
    """A policy FSDPv2 takes for the forms FSDP2 takes too: a set of classes becomes
    torch_xla's ``transformer_auto_wrap_policy`` over them."""
    if isinstance(policy, (set, frozenset, list, tuple)):
        import functools

        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(policy))
    return policy


def shard_model_output(output: Any, mesh) -> None:
    """FSDPv2's output sharding (the batch dimension over ``fsdp``, and ``data`` on a mesh with
    replicas; whole over ``model``) for what models return: a tensor, a tuple whose first
    element is one, or a mapping such as a Hugging Face ``ModelOutput`` (its ``logits``, else
    its first tensor). torch_xla's own default takes the first two only."""
    import torch_xla.distributed.spmd as xs

    from ray_train_xla.toolkit.spmd import data_axes

    tensor = None
    if isinstance(output, torch.Tensor):
        tensor = output
    elif isinstance(output, Mapping):
        values = [output["logits"]] if "logits" in output else list(output.values())
        tensor = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        tensor = output[0]
    if tensor is None:
        raise RuntimeError(
            f"prepare_sharded_model: the model returned a {type(output).__name__}, which holds no "
            "tensor to shard over the batch; pass shard_output=fn(output, mesh) that marks it")
    spec = (data_axes(mesh),) + (None,) * (tensor.dim() - 1) if tensor.dim() else ()
    xs.mark_sharding(tensor, mesh, spec)


def _mark_tensor_parallel(model: torch.nn.Module, mesh, tp: int, plan) -> torch.nn.Module:
    """Move ``model`` to the XLA device and give the weights its TP plan splits their 2-D
    partition specs on ``mesh`` (``model`` for tp, ``fsdp`` for FSDP): the plan of the native
    path (``plan`` in ``parallelize_module``'s form, else a Hugging Face decoder's own), checked
    the same way. FSDPv2 then shards what is left and skips what is marked."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from ray_train_xla.toolkit.tensor_parallel import (
        check_divisible,
        expand,
        partition_specs,
        tp_plan,
    )

    styles = tp_plan(model) if plan is None else expand(plan, model, what="prepare_sharded_model")
    check_divisible(model, styles, tp)
    specs = partition_specs(model, styles, tp_axis="model", dp_axis="fsdp")
    model = model.to(torch_xla.device())
    for name, param in model.named_parameters():
        if name in specs:
            xs.mark_sharding(param, mesh, specs[name])
    return model


def prepare_sharded_model(
    model: torch.nn.Module,
    mesh=None,
    *,
    auto_wrap_policy=None,
    shard_output=None,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    parallelism=None,
    tp_plan=None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> torch.nn.Module:
    """Shard ``model`` over every device of the job, the same call on every config.

    ``auto_wrap_policy`` names the blocks sharded on their own (gathered one at a time): a set
    of module classes, ``ModuleWrapPolicy({Block})``, or
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
    ``mesh`` defaults to :func:`get_sharded_mesh`.

    - ``TorchXLAConfig(spmd=True)``: torch_xla's FSDPv2 (``SpmdFullyShardedDataParallel``).
      Every parameter is split along its largest dimension over the mesh's ``fsdp`` axis; XLA
      gathers them for the forward pass and reduce-scatters the gradients, so step with plain
      ``optimizer.step()`` and ``torch_xla.sync()``, and shard the batch with
      ``shard_batch(batch, mesh)``. ``shard_output(output, mesh)`` marks the output's
      sharding (default :func:`shard_model_output`: tensors, tuples, Hugging Face outputs).
      The state dict's keys gain FSDPv2's ``_orig_module.`` prefix; checkpoints are written
      under the plain names. Under a layout with tensor parallelism (``parallelism``, or the
      config's) the mesh's ``model`` axis is ``tp``: first the plan's weights get 2-D
      partition specs (``tensor_parallel.partition_specs``: column-wise ``[out, in]`` is
      ``("model", "fsdp")``, row-wise ``("fsdp", "model")``, the vocabulary over ``model``),
      then FSDPv2 shards the rest over ``fsdp``; gradients and optimizer state follow each
      parameter's sharding. ``tp_plan`` as on the native configs; with replicas
      (``dp_replicate``) parameters are whole on each row of the mesh's ``data`` axis.
    - ``TorchNeuronConfig`` / ``TorchTPUConfig`` (and their CPU twins): FSDP2 (``fully_shard``)
      on a DeviceMesh (``fsdp2.py``); every worker starts from rank 0's values; each worker
      feeds its own batch (``prepare_data_loader``), ``optimizer.step()`` or
      ``optimizer_step()`` is the step. ``mixed_precision="bf16"`` computes in bf16 and reduces
      gradients in fp32; ``activation_checkpointing=True`` recomputes each block in backward.
      Under a layout with tensor parallelism or replicas (the config's ``parallelism``, or
      ``parallelism=`` here, as ``configure_parallelism`` takes it) the model is split over
      ``tp`` first, then FSDP2 shards it over the data-parallel dimensions
      (``tensor_parallel.parallelize``): ``tp_plan`` is the plan (``{module path:
      ParallelStyle}``, torch's ``parallelize_module`` form), by default a Hugging Face
      decoder's own (``base_model_tp_plan``); ``sequence_parallel`` splits norms and the
      residual stream over the sequence; ``loss_parallel`` keeps the logits split by
      vocabulary (compute the loss and backward inside
      ``torch.distributed.tensor.parallel.loss_parallel()``).
    """
    prepare = {DTENSOR: prepare_dtensor, SPMD: prepare_fsdpv2}[stack().sharded]
    return prepare(
        model, mesh, auto_wrap_policy=auto_wrap_policy, shard_output=shard_output,
        mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
        parallelism=parallelism, tp_plan=tp_plan, sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel)


def prepare_dtensor(model: torch.nn.Module, mesh, *, auto_wrap_policy, shard_output,
                    mixed_precision, activation_checkpointing, parallelism, tp_plan,
                    sequence_parallel, loss_parallel) -> torch.nn.Module:
    """``prepare_sharded_model`` on the native stacks: FSDP2, with TP under a layout."""
    from ray_train_xla.planning.layout import DIMS
    from ray_train_xla.toolkit.fsdp2 import prepare_fsdp2
    from ray_train_xla.toolkit.parallel import configure_parallelism, device_mesh, get_layout
    from ray_train_xla.toolkit.tensor_parallel import parallelize

    if shard_output is not None:
        raise ValueError("prepare_sharded_model: shard_output is torch_xla FSDPv2's; FSDP2 "
                         "(native configs) returns the model's own outputs")
    layout = configure_parallelism(parallelism) if parallelism is not None else get_layout()
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is None and (not layout.trivial or tp_plan is not None or sequence_parallel
                         or loss_parallel):
        mesh, names = device_mesh(), DIMS
    if names == DIMS or "tp" in names:
        model = parallelize(model, mesh, tp_plan, sequence_parallel=sequence_parallel,
                            loss_parallel=loss_parallel, auto_wrap_policy=auto_wrap_policy,
                            mixed_precision=mixed_precision,
                            activation_checkpointing=activation_checkpointing)
    else:
        model = prepare_fsdp2(model, mesh, auto_wrap_policy=auto_wrap_policy,
                              mixed_precision=mixed_precision,
                              activation_checkpointing=activation_checkpointing)
    note_model(model)
    return model


def prepare_fsdpv2(model: torch.nn.Module, mesh, *, auto_wrap_policy, shard_output,
                   mixed_precision, activation_checkpointing, parallelism, tp_plan,
                   sequence_parallel, loss_parallel) -> torch.nn.Module:
    """``prepare_sharded_model`` under torch_xla SPMD: FSDPv2, with TP partition specs under a
    layout."""
    if sequence_parallel or loss_parallel:
        raise ValueError("prepare_sharded_model: sequence_parallel and loss_parallel are DTensor "
                         "styles (TorchNeuronConfig, TorchTPUConfig); under torch_xla SPMD XLA's "
                         "sharding propagation places the activations: leave them off")
    from ray_train_xla.toolkit.checkpoint.names import remember
    from ray_train_xla.toolkit.parallel import configure_parallelism, get_layout
    from ray_train_xla.toolkit.spmd import require_spmd

    require_spmd()
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    if mixed_precision is not None:
        raise ValueError("prepare_sharded_model: mixed_precision is FSDP2's (native configs); "
                         "under torch_xla FSDPv2 cast the model (model.to(torch.bfloat16)) instead")
    if activation_checkpointing and auto_wrap_policy is None:
        raise ValueError("prepare_sharded_model: activation_checkpointing recomputes each "
                         "block named by auto_wrap_policy; give auto_wrap_policy")
    for name, module in model.named_modules():
        if type(module).__name__ == FSDP_V1_CLASS:
            raise ShardedStateError(
                f"prepare_sharded_model: {name or 'model'} is a torch_xla FSDP (v1) module, which "
                "does not run under SPMD; pass the unwrapped model.")
    if isinstance(model, SpmdFullyShardedDataParallel):
        remember(model)
        note_model(model.module)
        return model
    layout = configure_parallelism(parallelism) if parallelism is not None else get_layout()
    mesh = mesh if mesh is not None else get_sharded_mesh()
    if "fsdp" not in mesh.axis_names:
        raise ValueError(f"prepare_sharded_model: the mesh axes {mesh.axis_names} have no 'fsdp' axis; "
                         "build it with get_sharded_mesh(shape)")
    tp = dict(mesh.shape()).get("model", 1)
    if layout.tp > 1 and tp != layout.tp:
        raise ValueError(f"prepare_sharded_model: the layout has tp={layout.tp}, but the mesh's "
                         f"'model' axis has {tp} devices: leave mesh=None (get_sharded_mesh(), "
                         "the layout's) or give one whose 'model' axis is tp")
    if tp > 1 and (layout.tp > 1 or tp_plan is not None):
        model = _mark_tensor_parallel(model, mesh, tp, tp_plan)
    kwargs = {}
    if activation_checkpointing:
        from torch_xla.distributed.fsdp import checkpoint_module

        kwargs["auto_wrapper_callable"] = lambda m, *args, **kw: SpmdFullyShardedDataParallel(
            checkpoint_module(m), *args, **kw)
    wrapped = SpmdFullyShardedDataParallel(
        model, mesh=mesh, auto_wrap_policy=_xla_policy(auto_wrap_policy),
        shard_output=shard_output or shard_model_output, **kwargs)
    remember(wrapped)
    note_model(model)
    return wrapped
