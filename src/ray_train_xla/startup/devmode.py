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
  collective through a gloo group, and copy the result back: eager, and each call cuts the graph.
- ``torch.distributed`` carries XLA tensors: the default process group is ``xla_host``
  (:class:`HostBridgeGroup`), which runs every operation, on CPU or XLA tensors, on host copies
  through its own gloo group, so DDP works on the XLA device.

Not bridged (they raise ``NotImplementedError`` instead of silently returning local values):
``xm.all_to_all``, ``xm.collective_permute``, ``xm.send``/``xm.recv``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from ray_train_xla.planning.contract import DEVMODE_BACKEND
from ray_train_xla.startup.patching import Patches

logger = logging.getLogger(__name__)

BACKEND_NAME = DEVMODE_BACKEND  # "xla_host"
PROCESS_GROUP_BACKEND = DEVMODE_BACKEND

_REDUCE_OPS = ("sum", "mul", "and", "or", "min", "max")
_NOT_BRIDGED = ("all_to_all", "collective_permute", "send", "recv")


class _State:
    """What install() changed, to undo it at shutdown; the host groups it created."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.patches = Patches()
        self.subgroups: dict[tuple[int, ...], Any] = {}
        self.host_group: Any = None


_state: _State | None = None


def is_active() -> bool:
    """True on a worker where the CPU development mode is installed."""
    return _state is not None


# ---------------------------------------------------------------------------------------------
# Host helpers
# ---------------------------------------------------------------------------------------------


def _require() -> _State:
    if _state is None:
        raise RuntimeError("ray_train_xla CPU development mode is not installed on this worker")
    return _state


def _host_group() -> Any:
    """The gloo group that carries torch_xla's collectives (created at install, all ranks)."""
    return _require().host_group


def _members(groups: Sequence[Sequence[int]] | None) -> tuple[list[int], Any]:
    """This rank's replica group (as listed) and the gloo group that holds exactly it."""
    st = _require()
    if not groups:
        return list(range(st.world)), st.host_group
    for group in groups:
        if st.rank in group:
            members = [int(r) for r in group]
            break
    else:
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
    from torch.distributed import distributed_c10d

    return distributed_c10d.new_group(*args, **kwargs)


def _in_listed_order(values: list, members: list[int]) -> list:
    """gloo returns group members in ascending rank order; XLA in the order the group lists."""
    ordered = sorted(members)
    return [values[ordered.index(m)] for m in members]


def _to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors`` after one graph execution (the step so far, and these)."""
    import torch_xla

    if any(t.device.type == "xla" for t in tensors):
        torch_xla.sync()  # one execution computes them all; the copies are plain transfers
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
    out, offset = {}, 0
    for i in idxs:
        n = like[i].numel()
        out[i] = flat[offset:offset + n].view(like[i].shape)
        offset += n
    return out


def _gloo_reduce(reduce_type: str, host: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    if reduce_type not in _REDUCE_OPS:
        raise ValueError(f"reduce_type={reduce_type!r} is not valid: expected one of {list(_REDUCE_OPS)}")
    is_bool = host.dtype == torch.bool
    if is_bool:
        host = host.to(torch.uint8)
    if reduce_type in ("and", "or"):
        if host.is_floating_point():
            raise ValueError(f"reduce_type={reduce_type!r} needs an integer or bool tensor, got {host.dtype}")
        op = {"and": dist.ReduceOp.MIN if is_bool else dist.ReduceOp.BAND,
              "or": dist.ReduceOp.MAX if is_bool else dist.ReduceOp.BOR}[reduce_type]
    else:
        op = {"sum": dist.ReduceOp.SUM, "mul": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX}[reduce_type]
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
            host = (host * scale).to(host.dtype)
        results.update(_unpack(host.to(flat.device), idxs, tensors))
    return [results[i] for i in range(len(tensors))]


def _copy_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, v in zip(targets, values):
            t.copy_(v)


def _write_out(outputs: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``output=`` of torch_xla's collectives: the result replaces the output tensor's value,
    whatever its shape was (as the ``_xla_*_out`` ops do)."""
    with torch.no_grad():
        for t, v in zip(outputs, values):
            if t.shape == v.shape:
                t.copy_(v)
            else:
                t.data = v.to(t.dtype)


# ---------------------------------------------------------------------------------------------
# torch_xla's collectives, over the host (same signatures as torch_xla.core.xla_model)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("ray_train_xla::host_all_reduce", mutates_args=())
def _host_all_reduce_op(tensor: torch.Tensor, reduce_type: str, scale: float) -> torch.Tensor:
    """``xm.all_reduce`` of one tensor as an operator, for ``torch.compile(backend="openxla")``.

    The openxla bridge runs a graph node eagerly when executing it used a CPU fallback
    (``torch_xla/_dynamo/dynamo_bridge.py``, ``UnsupportedNodesCollector``); a host collective
    must run eagerly (compiled, its result would be a constant), so this op runs one tiny
    fallback op (``histc``) to be classified as such.
    """
    out = _reduce(reduce_type, [tensor], scale, None)[0]
    if tensor.device.type == "xla":
        torch.histc(out.new_zeros(1), bins=1)
    return out


@_host_all_reduce_op.register_fake
def _(tensor: torch.Tensor, reduce_type: str, scale: float) -> torch.Tensor:
    return torch.empty_like(tensor)


def all_reduce(reduce_type: str, inputs: torch.Tensor | list[torch.Tensor], scale: float = 1.0,
               groups: list[list[int]] | None = None, pin_layout: bool = True):
    """``xm.all_reduce``: a new tensor for a tensor; a list is reduced in place and returned."""
    if isinstance(inputs, torch.Tensor):
        if torch.compiler.is_compiling() and not groups:
            return _host_all_reduce_op(inputs, reduce_type, float(scale))
        return _reduce(reduce_type, [inputs], scale, groups)[0]
    tensors = list(inputs)
    if tensors:
        _copy_into(tensors, _reduce(reduce_type, tensors, scale, groups))
    return inputs


def all_gather(value: torch.Tensor | list[torch.Tensor], dim: int = 0,
               groups: list[list[int]] | None = None, output: Any = None, pin_layout: bool = True,
               channel_id: Any = None, use_global_device_ids: Any = None):
    """``xm.all_gather``: concatenation along ``dim`` of every group member's value."""
    import torch.distributed as dist

    single = isinstance(value, torch.Tensor)
    tensors = [value] if single else list(value)
    members, group = _members(groups)
    packs = _pack(tensors)
    hosts = _to_host([flat for flat, _ in packs])
    gathered: dict[int, torch.Tensor] = {}
    for (_flat, idxs), host in zip(packs, hosts):
        parts = [torch.empty_like(host) for _ in members]
        dist.all_gather(parts, host, group=group)
        per_rank = [_unpack(p, idxs, tensors) for p in _in_listed_order(parts, members)]
        for i in idxs:
            d = dim if dim >= 0 else tensors[i].dim() + dim
            gathered[i] = torch.cat([r[i] for r in per_rank], dim=d).to(tensors[i].device)
    results = [gathered[i] for i in range(len(tensors))]
    if output is not None:
        outputs = [output] if single else list(output)
        _write_out(outputs, results)
        return output
    return results[0] if single else results


def reduce_scatter(reduce_type: str, input: torch.Tensor | list[torch.Tensor], scale: float,
                   scatter_dim: int, shard_count: int, groups: list[list[int]] | None = None,
                   output: Any = None, pin_layout: bool = True, channel_id: Any = None,
                   use_global_device_ids: Any = None):
    """``xm.reduce_scatter``: the reduction, split along ``scatter_dim``; this member's shard."""
    single = isinstance(input, torch.Tensor)
    tensors = [input] if single else list(input)
    members, _ = _members(groups)
    if shard_count != len(members):
        raise ValueError(f"reduce_scatter: shard_count={shard_count} must equal the replica group "
                         f"size {len(members)}")
    index = members.index(_require().rank)
    reduced = _reduce(reduce_type, tensors, scale, groups)
    results = [torch.chunk(r, shard_count, dim=scatter_dim)[index] for r in reduced]
    if output is not None:
        outputs = [output] if single else list(output)
        _write_out(outputs, results)
        return output
    return results[0] if single else results


def collective_broadcast(tensors: list[torch.Tensor], root_ordinal: int = 0,
                         groups: list[list[int]] | None = None, pin_layout: bool = True) -> None:
    """``xm.collective_broadcast``: root's values, in place, on every member."""
    import torch.distributed as dist

    tensors = list(tensors)
    if not tensors:
        return
    _, group = _members(groups)
    packs = _pack(tensors)
    hosts = _to_host([flat for flat, _ in packs])
    values: dict[int, torch.Tensor] = {}
    for (flat, idxs), host in zip(packs, hosts):
        dist.broadcast(host, src=root_ordinal, group=group)
        values.update(_unpack(host.to(flat.device), idxs, tensors))
    _copy_into(tensors, [values[i] for i in range(len(tensors))])


def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] | None = None) -> list[bytes]:
    """``xm.rendezvous``: wait for the replicas (default: all) and exchange their payloads,
    returned in the order of ``replicas``. Bounded by the process group's timeout."""
    import torch.distributed as dist
    import torch_xla

    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    torch_xla.sync()
    st = _require()
    members = [int(r) for r in replicas] if replicas else list(range(st.world))
    if st.rank not in members:
        raise ValueError(f"rendezvous {tag!r}: replicas {members} do not contain this worker's "
                         f"ordinal {st.rank}")
    _, group = _members([members])
    out: list[Any] = [None] * len(members)
    dist.all_gather_object(out, payload, group=group)
    return _in_listed_order(out, members)


def xla_rendezvous(payload: bytes = b"", ordinals: list[int] | None = None,
                   tag: str | None = None) -> list[bytes]:
    """``xm.xla_rendezvous``, as :func:`rendezvous`."""
    return rendezvous(tag or "", payload, ordinals)


def _not_bridged(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"xm.{name} is not available in ray_train_xla's CPU development mode (several CPU "
            "workers): it would return this worker's local value. It runs on Neuron and TPU.")

    refuse.__name__ = name
    return refuse


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
            return BACKEND_NAME

        def _set_group_name(self, name: str) -> None:
            self._group_name = name

        @property
        def group_name(self) -> str:
            return self._group_name

        def _gloo(self) -> Any:
            # Created on first use: every member reaches the same first collective.
            if self._gloo_pg is None:
                import torch.distributed as dist

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
            return self._run(tensors, [], lambda out, _: self._gloo().reduce(out, opts))

        def barrier(self, opts=None):
            self._gloo().barrier().wait()
            return _done([])

        def allgather(self, output_lists, inputs, opts=None):
            flat = [t for outs in output_lists for t in outs]
            sizes = [len(outs) for outs in output_lists]

            def op(out, inp):
                lists, k = [], 0
                for n in sizes:
                    lists.append(out[k:k + n])
                    k += n
                return self._gloo().allgather(lists, inp)

            return self._run(flat, inputs, op)

        def _allgather_base(self, output, input, opts=None):
            return self._run([output], [input],
                             lambda out, inp: self._gloo()._allgather_base(out[0], inp[0]))

        def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
            return self._run(outputs, inputs, lambda out, inp: self._gloo()
                             .allgather_into_tensor_coalesced(out, inp))

        def _reduce_scatter_base(self, output, input, opts):
            # gloo reduce-scatter support varies by version: reduce everything, keep our chunk.
            host = _to_host([input])[0]
            self._gloo().allreduce([host], _allreduce_opts(opts.reduceOp)).wait()
            _copy_into([output], [host.reshape(self.size(), -1)[self.rank()]
                                  .view(output.shape).to(output.device)])
            return _done([output])

        def reduce_scatter(self, outputs, input_lists, opts):
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


def _allreduce_opts(reduce_op: Any) -> Any:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = reduce_op
    return opts


def _create_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return _make_group_class()(store, rank, size, timeout)


def register_backend() -> None:
    """Register the ``xla_host`` torch.distributed backend (idempotent)."""
    import torch.distributed as dist

    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        # Every tensor, CPU or XLA: a Python ProcessGroup backend is the whole group anyway.
        dist.Backend.register_backend(BACKEND_NAME, _create_group, devices=["cpu", "xla"])


# ---------------------------------------------------------------------------------------------
# Install / uninstall
# ---------------------------------------------------------------------------------------------


def install(rank: int, world: int) -> None:
    """Make this worker's torch_xla see the Ray world and reduce across it. Call after the
    default process group (``PROCESS_GROUP_BACKEND``) is initialised, on every worker."""
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
                     ("collective_broadcast", collective_broadcast), ("rendezvous", rendezvous),
                     ("xla_rendezvous", xla_rendezvous)):
        st.patches.set(xm, name, fn)
    for name in _NOT_BRIDGED:
        st.patches.set(xm, name, _not_bridged(name))
    _state = st
    logger.info("ray_train_xla: CPU development mode on (rank %d of %d): torch_xla collectives "
                "run over gloo on host copies", rank, world)


def uninstall() -> None:
    """Undo :func:`install` (at shutdown, after the process group is destroyed)."""
    global _state
    st, _state = _state, None
    if st is None:
        return
    st.patches.undo()
