"""CPU development mode: several XLA CPU workers behave like one multi-device XLA runtime.

torch_xla 2.9 on CPU cannot reduce across processes: every process is a world of one device, so
``xm.all_reduce`` returns the local value and ``xr.world_size()`` is 1 on every worker. With
several CPU workers the backend installs this mode at process-group initialisation (the planner
sets ``RAY_TRAIN_XLA_CPU_DEVMODE=1``; never on an accelerator, never with one worker), and then:

- torch_xla's view of the world is Ray's, as on a runtime with one device per process:
  ``xr.world_size()``, ``xr.global_ordinal()``, ``xr.process_count()``, ``xr.process_index()``,
  ``xr.global_device_count()``; ``xr.local_ordinal()`` and ``xm.is_master_ordinal()`` follow
  ``PJRT_LOCAL_PROCESS_RANK`` (planned as the worker's local rank).
- torch_xla's collectives (``xm.all_reduce``, ``all_gather``, ``reduce_scatter``,
  ``collective_broadcast``, ``rendezvous``, and what is built on them: ``mesh_reduce``,
  ``reduce_gradients``, ``optimizer_step``, ``save``) copy the tensors to the host, run the
  collective through a gloo group, and copy the result back: eager, and each call cuts the graph
  (without running step closures: they run at the next ``torch_xla.sync()``). Each gives torch_xla
  2.9's result, or raises what torch_xla raises (its checks and messages). Under
  ``torch.compile(backend="openxla")`` the tensor collectives are one graph node each
  (``ray_train_xla::host_collective``) that runs eagerly between compiled parts; ``rendezvous``
  is a graph break (with ``fullgraph=True``, an error naming it and the workaround).
- ``torch.distributed`` carries XLA tensors: the default process group is ``xla_host``
  (:class:`HostBridgeGroup`), which runs every operation, on CPU or XLA tensors, on host copies
  through its own gloo group, with the results of torch_xla's ``xla`` backend, so DDP works on
  the XLA device.

Not bridged (they raise ``NotImplementedError`` instead of silently returning local values):
``xm.all_to_all``, ``xm.collective_permute``, ``xm.send``/``xm.recv``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ray_train_xla.planning.contract import DEVMODE_BACKEND
from ray_train_xla.startup.patching import Patches

logger = logging.getLogger(__name__)

REDUCE_SUM = "sum"
_REDUCE_OPS = ("sum", "mul", "and", "or", "min", "max")
_NOT_BRIDGED = ("all_to_all", "collective_permute", "send", "recv")


@dataclasses.dataclass
class _State:
    """What install() changed, to undo it at shutdown; the host groups it created."""

    rank: int
    world: int
    patches: Patches = dataclasses.field(default_factory=Patches)
    subgroups: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)
    host_group: Any = None
    functional_kernels: Any = None


_state: _State | None = None


# ---------------------------------------------------------------------------------------------
# Host helpers
# ---------------------------------------------------------------------------------------------


def _require() -> _State:
    if _state is None:
        raise RuntimeError("ray_train_xla CPU development mode is not installed on this worker")
    return _state


def _members(groups: Sequence[Sequence[int]] | None) -> tuple[list[int], Any]:
    """This rank's replica group (as listed) and the gloo group that holds exactly it."""
    st = _require()
    if not groups:
        return list(range(st.world)), st.host_group
    members = next(([int(r) for r in group] for group in groups if st.rank in group), None)
    if members is None:
        raise ValueError(f"replica groups {groups} do not contain this worker's ordinal {st.rank}")
    key = tuple(sorted(members))
    if key == tuple(range(st.world)):
        return members, st.host_group
    if key not in st.subgroups:
        # Only the members create (and later use) the group: the others are in their own groups.
        st.subgroups[key] = _new_group(list(key), backend="gloo", use_local_synchronization=True)
    return members, st.subgroups[key]


def _new_group(*args: Any, **kwargs: Any) -> Any:
    # torch's own new_group: importing torch_xla.distributed.xla_backend replaces
    # torch.distributed.new_group with a version that lacks use_local_synchronization.
    # Bounded by timeout_s, as every group of the package (torch's default: 30 minutes).
    from ray_train_xla.toolkit.collectives import group_timeout

    kwargs.setdefault("timeout", group_timeout())
    return dist.distributed_c10d.new_group(*args, **kwargs)


def _in_listed_order(values: list, members: list[int]) -> list:
    """gloo returns group members in ascending rank order; XLA in the order the group lists."""
    ordered = sorted(members)
    return [values[ordered.index(m)] for m in members]


def _to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors`` after one execution of the pending graph (the step so far, and
    these), so that the copies are plain transfers. The execution is ``torch_xla.sync()`` less
    its step closures (``xm._run_step_closures``): a bridged collective stands for one op of the
    graph, so the closures wait for the user's next ``torch_xla.sync()``/``xm.mark_step()``, as
    they do on hardware."""
    if any(t.device.type == "xla" for t in tensors):
        import torch_xla

        torch_xla._XLAC._xla_step_marker(torch_xla._XLAC._xla_get_default_device(), [],
                                         wait=False, reset_scope=True)
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _pack(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """One flat tensor per dtype (still on the device) and the indices of the tensors in it."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    packs = []
    for idxs in by_dtype.values():
        parts = [tensors[i].detach().reshape(-1) for i in idxs]
        packs.append((parts[0] if len(parts) == 1 else torch.cat(parts), idxs))
    return packs


def _unpack(flat: torch.Tensor, idxs: list[int], like: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    parts = flat.split([like[i].numel() for i in idxs])
    return {i: part.view(like[i].shape) for i, part in zip(idxs, parts)}


def _gloo_reduce(reduce_type: str, host: torch.Tensor, group: Any) -> torch.Tensor:
    if reduce_type not in _REDUCE_OPS:
        raise ValueError(f"reduce_type={reduce_type!r} is not valid: expected one of {list(_REDUCE_OPS)}")
    is_bool = host.dtype == torch.bool
    if is_bool:
        host = host.to(torch.uint8)
    if reduce_type in ("and", "or") and host.is_floating_point():
        raise ValueError(f"reduce_type={reduce_type!r} needs an integer or bool tensor, got {host.dtype}")
    ops = dist.ReduceOp
    op = {"sum": ops.SUM, "mul": ops.PRODUCT, "min": ops.MIN, "max": ops.MAX,
          "and": ops.MIN if is_bool else ops.BAND, "or": ops.MAX if is_bool else ops.BOR}[reduce_type]
    dist.all_reduce(host, op=op, group=group)
    return host.to(torch.bool) if is_bool else host


def _reduce(reduce_type: str, tensors: Sequence[torch.Tensor], scale: float,
            groups: Sequence[Sequence[int]] | None) -> list[torch.Tensor]:
    """All-reduce ``tensors`` over this rank's replica group; results on the tensors' devices
    (one host round trip per dtype)."""
    _, group = _members(groups)
    packs = _pack(tensors)
    hosts = _to_host([flat for flat, _ in packs])
    results: dict[int, torch.Tensor] = {}
    for (flat, idxs), host in zip(packs, hosts):
        host = _gloo_reduce(reduce_type, host, group)
        if scale != 1.0:
            # As XLA builds it: the scale is a constant of the tensor's type (an int64 tensor
            # scaled by 0.5 is multiplied by 0; bf16 by bf16(scale)), then one multiply.
            host = host * torch.tensor(scale, dtype=host.dtype)
        results.update(_unpack(host.to(flat.device), idxs, tensors))
    return [results[i] for i in range(len(tensors))]


def _gather(tensors: Sequence[torch.Tensor], dim: int,
            groups: Sequence[Sequence[int]] | None) -> list[torch.Tensor]:
    """Every member's ``tensors`` concatenated along ``dim``, in the order the group lists them."""
    members, group = _members(groups)
    packs = _pack(tensors)
    hosts = _to_host([flat for flat, _ in packs])
    gathered: dict[int, torch.Tensor] = {}
    for (_flat, idxs), host in zip(packs, hosts):
        parts = [torch.empty_like(host) for _ in members]
        dist.all_gather(parts, host, group=group)
        per_rank = [_unpack(p, idxs, tensors) for p in _in_listed_order(parts, members)]
        for i in idxs:
            gathered[i] = torch.cat([r[i] for r in per_rank], dim=dim).to(tensors[i].device)
    return [gathered[i] for i in range(len(tensors))]


def _reduce_scatter(reduce_type: str, tensors: Sequence[torch.Tensor], scale: float,
                    scatter_dim: int, shard_count: int,
                    groups: Sequence[Sequence[int]] | None) -> list[torch.Tensor]:
    """The reduction of ``tensors``, split along ``scatter_dim``: this member's shard."""
    members, _ = _members(groups)
    index = members.index(_require().rank)
    reduced = _reduce(reduce_type, tensors, scale, groups)
    return [torch.chunk(r, shard_count, dim=scatter_dim)[index] for r in reduced]


def _copy_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(targets, values):
            t.copy_(v)


def _write_out(outputs: Sequence[torch.Tensor], values: Sequence[torch.Tensor], call: str) -> None:
    """``output=`` of torch_xla's collectives: the result replaces the output tensor's value,
    whatever its shape was (as the ``_xla_*_out`` ops do)."""
    compiling = torch.compiler.is_compiling()
    with torch.no_grad():
        for t, v in zip(outputs, values):
            if t.shape == v.shape:
                t.copy_(_computed(v) if compiling else v)
            elif compiling:
                raise RuntimeError(
                    f"xm.{call}(..., output=...) with an output of shape {tuple(t.shape)} (the "
                    f"result has shape {tuple(v.shape)}) cannot be compiled in ray_train_xla's "
                    "CPU development mode: pass outputs of the result's shape, or call "
                    f"xm.{call} outside the compiled function")
            else:
                t.data = v.to(t.dtype)


# ---------------------------------------------------------------------------------------------
# Bridged collectives inside torch.compile(backend="openxla")
# ---------------------------------------------------------------------------------------------


def _split(flat: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """``flat`` cut into consecutive lists of ``sizes``."""
    out, k = [], 0
    for n in sizes:
        out.append(list(flat[k:k + n]))
        k += n
    return out


@torch.library.custom_op("ray_train_xla::host_collective", mutates_args=())
def _host_collective_op(tensors: list[torch.Tensor], op: str, reduce_type: str, scale: float,
                        dim: int, shard_count: int, group_ranks: list[int],
                        group_sizes: list[int]) -> list[torch.Tensor]:
    """A bridged collective as one operator, for ``torch.compile(backend="openxla")``.

    The openxla bridge runs a graph node eagerly when executing it used a CPU fallback
    (``torch_xla/_dynamo/dynamo_bridge.py``, ``UnsupportedNodesCollector``); a host collective
    must run eagerly (compiled, its result would be a constant), so this op runs one tiny
    fallback op (``histc``) to be classified as such.
    """
    groups = _split(group_ranks, group_sizes) or None
    out = _run_eagerly(op, tensors, reduce_type, scale, dim, shard_count, groups)
    if any(t.device.type == "xla" for t in tensors):
        torch.histc(torch.zeros(1, device=tensors[0].device), bins=1)
    return [t.clone() for t in out]  # an operator's outputs alias nothing


@_host_collective_op.register_fake
def _(tensors, op, reduce_type, scale, dim, shard_count, group_ranks, group_sizes):
    size = group_sizes[0] if group_sizes else _require().world
    out = []
    for t in tensors:
        shape = list(t.shape)
        if op != "all_reduce":
            shape[dim] = shape[dim] * size if op == "all_gather" else shape[dim] // shard_count
        out.append(t.new_empty(shape))
    return out


def _computed(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a value the compiled graph computes. The openxla bridge fails (``IndexError``
    in its output de-duplication) when an input is updated in place with a fallback node's
    output as it is; ``t - 0`` (``t | False`` for bool) is the same value, computed."""
    return t | False if t.dtype == torch.bool else t - 0


def _run_collective(op: str, tensors: list[torch.Tensor], *, reduce_type: str = "sum",
                    scale: float = 1.0, dim: int = 0, shard_count: int = 0,
                    groups: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """Eager: run it now over the host. Being compiled: one ``host_collective`` node, run
    eagerly where the compiled graph reaches it."""
    if torch.compiler.is_compiling():
        ranks, sizes = [int(r) for g in groups or [] for r in g], [len(g) for g in groups or []]
        return list(_host_collective_op(tensors, op, reduce_type, float(scale), dim, shard_count,
                                        ranks, sizes))
    return _run_eagerly(op, tensors, reduce_type, scale, dim, shard_count, groups)


def _run_eagerly(op: str, tensors: list[torch.Tensor], reduce_type: str, scale: float, dim: int,
                 shard_count: int, groups: Sequence[Sequence[int]] | None) -> list[torch.Tensor]:
    if op == "all_reduce":
        return _reduce(reduce_type, tensors, scale, groups)
    if op == "all_gather":
        return _gather(tensors, dim, groups)
    return _reduce_scatter(reduce_type, tensors, scale, dim, shard_count, groups)


# ---------------------------------------------------------------------------------------------
# torch_xla's collectives, over the host (same signatures, checks and errors as
# torch_xla.core.xla_model in torch_xla 2.9)
# ---------------------------------------------------------------------------------------------


def all_reduce(reduce_type: str, inputs: torch.Tensor | list[torch.Tensor], scale: float = 1.0,
               groups: list[list[int]] | None = None, pin_layout: bool = True):
    """``xm.all_reduce``: a new tensor for a tensor; a list is reduced in place and returned."""
    if isinstance(inputs, torch.Tensor):
        return _run_collective("all_reduce", [inputs], reduce_type=reduce_type, scale=scale,
                               groups=groups)[0]
    tensors = list(inputs)
    if tensors:
        _write_out(tensors, _run_collective("all_reduce", tensors, reduce_type=reduce_type,
                                            scale=scale, groups=groups), "all_reduce")
    return inputs


def _tensor_list(value: Any, name: str) -> list[torch.Tensor]:
    """A tensor's or a list of tensors' tensors; anything else is refused as torch_xla does."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    raise TypeError(f"`{name}` needs to be a Tensor or a list of Tensors, but given {type(value)}.")


def _check_output_list(output: Any, inputs: list) -> None:
    if not isinstance(output, list) or any(not isinstance(v, torch.Tensor) for v in output):
        raise TypeError(f"`output` needs to be a list of Tensors, but given {type(output)}.")
    if len(output) != len(inputs):
        raise ValueError("`output` length doesn't match `input` length: "
                         f"{len(output)} vs {len(inputs)}.")


def all_gather(value: torch.Tensor | list[torch.Tensor], dim: int = 0,
               groups: list[list[int]] | None = None, output: Any = None, pin_layout: bool = True,
               channel_id: Any = None, use_global_device_ids: Any = None):
    """``xm.all_gather``: concatenation along ``dim`` of every group member's value."""
    single = isinstance(value, torch.Tensor)
    # torch_xla gathers a pinned tensor through a padded all_reduce within each group: groups
    # of any sizes, each in the order it lists its members.
    if groups and not (pin_layout and output is None and single):
        if len({len(group) for group in groups}) > 1:
            raise AssertionError("Replica groups must have the same number of replicas/shards.")
    tensors = _tensor_list(value, "value")
    if not single:
        if pin_layout:
            raise RuntimeError("For xm.all_gather with list of tensors input, pin_layout=True is "
                               "not yet supported.")
        if output is not None:
            _check_output_list(output, value)
    results = _run_collective("all_gather", tensors, dim=dim, groups=groups) if tensors else []
    if output is not None:
        _write_out([output] if single else output, results, "all_gather")
        return output
    return results[0] if single else results


def reduce_scatter(reduce_type: str, input: torch.Tensor | list[torch.Tensor], scale: float,
                   scatter_dim: int, shard_count: int, groups: list[list[int]] | None = None,
                   output: Any = None, pin_layout: bool = True, channel_id: Any = None,
                   use_global_device_ids: Any = None):
    """``xm.reduce_scatter``: the reduction, split along ``scatter_dim``; this member's shard."""
    single = isinstance(input, torch.Tensor)
    tensors = _tensor_list(input, "input")
    if output is not None and not single:
        _check_output_list(output, tensors)
    for t in tensors:  # XLA's shape check (RuntimeError when the op is built)
        size = t.shape[scatter_dim]
        if size % shard_count:
            raise RuntimeError(f"ReduceScatter operand scatter dimension size {size} must be "
                               f"dividable by shard_count {shard_count}.")
    members, _ = _members(groups)
    if shard_count != len(members):
        raise ValueError(f"reduce_scatter: shard_count={shard_count} must equal the replica group "
                         f"size {len(members)}")
    results = (_run_collective("reduce_scatter", tensors, reduce_type=reduce_type, scale=scale,
                               dim=scatter_dim, shard_count=shard_count, groups=groups)
               if tensors else [])
    if output is not None:
        _write_out([output] if single else list(output), results, "reduce_scatter")
        return output
    return results[0] if single else results


def collective_broadcast(tensors: list[torch.Tensor], root_ordinal: int = 0,
                         groups: list[list[int]] | None = None, pin_layout: bool = True) -> None:
    """``xm.collective_broadcast``, as torch_xla builds it: every tensor not on the root is
    multiplied by 0, then they are summed within each replica group (in place). A group
    without the root gets zeros."""
    rank = _require().rank
    with torch.no_grad():
        for tensor in tensors:
            scale = torch.tensor(1 if rank == root_ordinal else 0, dtype=tensor.dtype)
            tensor.mul_(scale.to(tensor.device))
    all_reduce(REDUCE_SUM, tensors, groups=groups, pin_layout=pin_layout)


def xla_rendezvous(payload: bytes = b"", ordinals: list[int] | None = None,
                   tag: str | None = None) -> list[bytes]:
    """``xm.xla_rendezvous``: every worker's payload, ordinal i's at position i (torch_xla
    accepts only the global rendezvous). Bounded by the process group's timeout."""
    import torch_xla

    st = _require()
    if ordinals and len(ordinals) != st.world:
        raise ValueError("Only global rendezvous is supported")
    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    torch_xla.sync()  # as torch_xla's rendezvous does (step closures run here too)
    out: list[Any] = [None] * st.world
    dist.all_gather_object(out, payload, group=st.host_group)
    return out


def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
    """``xm.rendezvous``: as :func:`xla_rendezvous`."""
    return xla_rendezvous(payload, replicas or None, tag=tag)


def _outside_graph(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` runs outside any graph ``torch.compile`` builds (a graph break); with
    ``fullgraph=True`` compiling fails, and the error gives this reason."""
    return torch.compiler.disable(fn, reason=(
        f"xm.{name} exchanges Python objects between workers and cannot be part of a compiled "
        f"graph in ray_train_xla's CPU development mode: call xm.{name} outside the compiled "
        "function (or compile without fullgraph=True, which runs it between graphs)"))


# torch.compile turns torch.distributed collectives into the functional ones
# (``torch.ops._c10d_functional``), which torch_xla runs in the graph over this worker's one
# device: the local value. Their XLA kernels are replaced by host ones while the mode is on
# (run eagerly between compiled parts, as ``host_collective``).
_FUNCTIONAL_REDUCE = {"sum": "sum", "avg": "sum", "product": "mul", "min": "min", "max": "max",
                      "band": "and", "bor": "or"}


def _functional_group(group_name: str) -> list[list[int]] | None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not group_name:
        return None
    return [dist.get_process_group_ranks(_resolve_process_group(group_name))]


def _functional_reduce_type(reduce_op: str) -> str:
    if reduce_op.lower() not in _FUNCTIONAL_REDUCE:
        raise NotImplementedError(f"reduce op {reduce_op!r} is not available on XLA tensors in "
                                  "ray_train_xla's CPU development mode")
    return _FUNCTIONAL_REDUCE[reduce_op.lower()]


def _as_fallback(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    torch.histc(torch.zeros(1, device=like.device), bins=1)  # see _host_collective_op
    return out


def _functional_all_reduce(input: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    groups = _functional_group(group_name)
    out = _reduce(_functional_reduce_type(reduce_op), [input], 1.0, groups)[0]
    if reduce_op.lower() == "avg":
        size = len(groups[0]) if groups else _require().world
        out = out / size if out.is_floating_point() else out // size
    return _as_fallback(out, input)


def _functional_all_gather(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    return _as_fallback(_gather([input], 0, _functional_group(group_name))[0], input)


def _functional_reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int,
                               group_name: str) -> torch.Tensor:
    if input.shape[0] % group_size:
        raise ValueError(f"reduce_scatter_tensor: input dimension 0 ({input.shape[0]}) must be "
                         f"divisible by the group size {group_size}")
    out = _reduce_scatter(_functional_reduce_type(reduce_op), [input], 1.0, 0, group_size,
                          _functional_group(group_name))[0]
    return _as_fallback(out.clone(), input)


def _refusal(name: str, message: str) -> Callable[..., Any]:
    """A function named ``name`` that raises NotImplementedError(``message``)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(message)

    refuse.__name__ = name
    return refuse


def _register_functional_kernels() -> Any:
    lib = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        lib.impl("all_reduce", _functional_all_reduce, "XLA")
        lib.impl("all_gather_into_tensor", _functional_all_gather, "XLA")
        lib.impl("reduce_scatter_tensor", _functional_reduce_scatter, "XLA")
        lib.impl("all_to_all_single", _refusal("all_to_all_single", (
            "torch.distributed's all_to_all_single on XLA tensors in a compiled function is not "
            "available in ray_train_xla's CPU development mode (it would return this worker's "
            "local value): call it outside the compiled function")), "XLA")
        # The wait after each: a computed copy, so that the openxla bridge never returns a
        # fallback node's output unchanged as the new value of an input (see _computed).
        lib.impl("wait_tensor", _computed, "XLA")
    return lib


# ---------------------------------------------------------------------------------------------
# torch.distributed backend for XLA tensors
# ---------------------------------------------------------------------------------------------


def _done(result: Any) -> Any:
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def _make_group_class() -> type:
    from torch._C._distributed_c10d import ProcessGroup

    class HostBridgeGroup(ProcessGroup):
        """``torch.distributed`` backend for XLA tensors: every operation copies its tensors to
        the host, runs it on a gloo group of the same ranks, and copies the result back."""

        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
            super().__init__(rank, size)
            self._store, self._timeout = store, timeout
            self._gloo_pg = None
            self._group_name = ""

        def getBackendName(self) -> str:  # noqa: N802 (torch's name)
            return DEVMODE_BACKEND

        def _set_group_name(self, name: str) -> None:
            self._group_name = name

        @property
        def group_name(self) -> str:
            return self._group_name

        def _gloo(self) -> Any:
            # Created on first use: every member reaches the same first collective.
            if self._gloo_pg is None:
                self._gloo_pg = dist.ProcessGroupGloo(self._store, self.rank(), self.size(),
                                                      self._timeout)
            return self._gloo_pg

        def _run(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 op: Callable[[list[torch.Tensor], list[torch.Tensor]], Any]) -> Any:
            hosts = _to_host(list(inputs) + list(outputs))
            host_in, host_out = hosts[:len(inputs)], hosts[len(inputs):]
            op(host_out, host_in).wait()
            _copy_into(outputs, [h.to(t.device) for h, t in zip(host_out, outputs)])
            return _done(outputs)

        def allreduce(self, tensors, opts):
            return self._run(tensors, [], lambda out, _: self._gloo().allreduce(out, opts))

        def broadcast(self, tensors, opts):
            return self._run(tensors, [], lambda out, _: self._gloo().broadcast(out, opts))

        def reduce(self, tensors, opts):
            # As torch_xla's backend: the result is written on the destination only; the
            # other ranks' tensors are left unchanged.
            hosts = _to_host(tensors)
            self._gloo().reduce(hosts, opts).wait()
            if self.rank() == opts.rootRank:
                _copy_into(tensors, [h.to(t.device) for h, t in zip(hosts, tensors)])
            return _done(tensors)

        def barrier(self, opts=None):
            self._gloo().barrier().wait()
            return _done([])

        def allgather(self, output_lists, inputs, opts=None):
            sizes = [len(outs) for outs in output_lists]
            return self._run([t for outs in output_lists for t in outs], inputs,
                             lambda out, inp: self._gloo().allgather(_split(out, sizes), inp))

        def _allgather_base(self, output, input, opts=None):
            # torch_xla's backend: the output is the concatenation along dim 0 or the stack of
            # every rank's input (PyTorch documents both); any other shape is refused.
            if input.dim() == 0:
                input = input.reshape(1)
            host = _to_host([input])[0]
            parts = [torch.empty_like(host) for _ in range(self.size())]
            self._gloo().allgather([parts], [host]).wait()
            for result in (torch.cat(parts, dim=0), torch.stack(parts, dim=0)):
                if result.shape == output.shape:
                    _copy_into([output], [result.to(output.device)])
                    return _done([output])
            raise ValueError(
                f"Input shape {input.shape} and output shape {output.shape} are not compatible "
                "for all_gather_into_tensor. Input must be stacked or concatenated to create "
                "output.")

        def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
            return self._run(outputs, inputs, lambda out, inp: self._gloo()
                             .allgather_into_tensor_coalesced(out, inp))

        def _reduce_scatter_base(self, output, input, opts):
            # gloo reduce-scatter support varies by version: reduce everything, keep our chunk.
            host = _to_host([input])[0]
            allreduce_opts = dist.AllreduceOptions()
            allreduce_opts.reduceOp = opts.reduceOp
            self._gloo().allreduce([host], allreduce_opts).wait()
            _copy_into([output], [host.reshape(self.size(), -1)[self.rank()]
                                  .view(output.shape).to(output.device)])
            return _done([output])

        def reduce_scatter(self, outputs, input_lists, opts):
            for inputs in input_lists:  # torch_xla's backend checks them all first
                for i, t in enumerate(inputs[1:], 1):
                    if t.shape != inputs[0].shape:
                        raise ValueError(f"Input {i}'s shape is different from input 0: "
                                         f"{t.shape} vs {inputs[0].shape}")
            for output, inputs in zip(outputs, input_lists):
                stacked = torch.stack([t.detach() for t in inputs])
                self._reduce_scatter_base(output, stacked, opts)
            return _done(outputs)

        def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
            return self._run([output], [input], lambda out, inp: self._gloo().alltoall_base(
                out[0], inp[0], output_split_sizes, input_split_sizes, opts))

        def send(self, tensors, dst, tag):
            host = _to_host(tensors)
            self._gloo().send(host, dst, tag).wait()
            return _done(tensors)

        def recv(self, tensors, src, tag):
            return self._run(tensors, [], lambda out, _: self._gloo().recv(out, src, tag))

    return HostBridgeGroup


def register_backend() -> None:
    """Register the ``xla_host`` torch.distributed backend (idempotent)."""
    if not hasattr(dist.Backend, DEVMODE_BACKEND.upper()):
        # Every tensor, CPU or XLA: a Python ProcessGroup backend is the whole group anyway.
        dist.Backend.register_backend(DEVMODE_BACKEND, _make_group_class(), devices=["cpu", "xla"])


# ---------------------------------------------------------------------------------------------
# Install / uninstall
# ---------------------------------------------------------------------------------------------


def install(rank: int, world: int) -> None:
    """Make this worker's torch_xla see the Ray world and reduce across it. Call after the
    default process group (``xla_host``) is initialised, on every worker."""
    global _state
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if _state is not None:
        return
    st = _State(rank, world)
    # A gloo group for torch_xla's collectives on host tensors (all ranks, collectively).
    st.host_group = _new_group(backend="gloo")
    # torch_xla caches these for Dynamo (runtime.py, "Dynamo WORLD_SIZE and ORDINAL"); every
    # reader, including the functions imported by name, returns the cached values.
    st.patches.set(xr, "_WORLD_SIZE", world)
    st.patches.set(xr, "_ORDINAL", rank)
    st.patches.set(xr, "process_count", lambda: world)
    st.patches.set(xr, "process_index", lambda: rank)
    st.patches.set(xr, "global_device_count", lambda: world)
    # Module attributes: torch_xla's own helpers (reduce_gradients, optimizer_step, mesh_reduce,
    # save, broadcast_master_param, the *_bucketized variants) look them up at call time.
    for name, fn in (("all_reduce", all_reduce), ("all_gather", all_gather),
                     ("reduce_scatter", reduce_scatter),
                     ("collective_broadcast", collective_broadcast),
                     ("rendezvous", _outside_graph(rendezvous, "rendezvous")),
                     ("xla_rendezvous", _outside_graph(xla_rendezvous, "xla_rendezvous"))):
        st.patches.set(xm, name, fn)
    for name in _NOT_BRIDGED:
        st.patches.set(xm, name, _refusal(name, (
            f"xm.{name} is not available in ray_train_xla's CPU development mode (several CPU "
            "workers): it would return this worker's local value. It runs on Neuron and TPU.")))
    st.functional_kernels = _register_functional_kernels()
    _state = st
    logger.info("ray_train_xla: CPU development mode on (rank %d of %d): torch_xla collectives "
                "run over gloo on host copies", rank, world)


def uninstall() -> None:
    """Undo :func:`install` (at shutdown, after the process group is destroyed)."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    st.functional_kernels._destroy()  # torch_xla's kernels are in force again
    st.patches.undo()
