"""Pretrained Hugging Face weights by slices: load them into a sharded model, export it back.

:func:`load_pretrained` takes a model built on the meta device (``from_config`` under
``torch.device("meta")``: no memory), shards it, allocates only this rank's shards and fills
them from the model's safetensors files with torch's ``HuggingFaceStorageReader`` through DCP's
load planner, which reads each rank's slice of each tensor (``safe_open(...).get_slice``) and
converts it to the parameter's dtype as it copies. No rank holds the whole model, and no rank
sends another what it read itself.

- FSDP2 (``TorchNeuronConfig``, ``TorchTPUConfig`` and their CPU twins): each rank reads its
  own row slice of every tensor.
- torch_xla FSDPv2 (``TorchXLAConfig(spmd=True)``, one process per host): the host's process
  reads the model once, in the training dtype, on the CPU, and FSDPv2 splits it over the host's
  devices (one copy a host, never one a device).

:func:`export_pretrained` writes the trained model in the Hugging Face layout from every rank at
once, each rank its own slices, joined by torch's safetensors consolidation.
``docs/sharded-models.md`` says what ``from_pretrained`` does that is done here too (tied
weights, computed buffers, ignored keys) and what is refused before anything is allocated.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import torch

from ray_train_xla.errors import CheckpointMismatchError
from ray_train_xla.planning.hub import INDEX_FILE, SOURCES, TOKENIZER_FILES, hub_id, snapshot
from ray_train_xla.toolkit.device import get_device
from ray_train_xla.toolkit.stacks import stack

SAFETENSORS_SUFFIX = ".safetensors"
# Largest output file of an export, as Transformers' save_pretrained defaults on the Hub.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SHARDED_SUBDIR = "sharded"  # HuggingFaceStorageWriter's per-rank files, removed at the end

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(value: Any) -> torch.dtype | None:
    """A torch dtype from ``torch.bfloat16``, ``"bfloat16"``, ``"bf16"``, ... (None as is)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "").lower()
    if name not in _DTYPES:
        raise ValueError(f"dtype {value!r}: use one of bfloat16, float16, float32")
    return _DTYPES[name]


# ----------------------------------------------------------------------------------- the files


def safetensors_files(path: str) -> list[str]:
    """The weight files of the Hugging Face model directory ``path``: ``model.safetensors``, or
    the shards ``model.safetensors.index.json`` lists. Refuses ``.bin`` checkpoints and
    directories without weights, naming the fix."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: {path} is not a directory (give the local "
                                f"directory save_pretrained wrote, a URI of one, or {SOURCES})")
    names = sorted(os.listdir(path))
    present = [n for n in names if n.endswith(SAFETENSORS_SUFFIX)]
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        absent = [n for n in files if n not in names]
        if absent:
            raise FileNotFoundError(f"load_pretrained: {INDEX_FILE} in {path} lists files that "
                                    f"are not there: {', '.join(absent[:4])}")
        # torch's reader reads every *.safetensors of the directory: one the index does not
        # list (a leftover model.safetensors, a variant) could silently replace its tensors.
        extra = [n for n in present if n not in files]
        if extra:
            raise CheckpointMismatchError(
                f"load_pretrained: {path} holds safetensors files its {INDEX_FILE} does not list "
                f"({', '.join(extra[:4])}): move them out of the directory")
        return [os.path.join(path, n) for n in files]
    if present:
        return [os.path.join(path, n) for n in present]
    if any(n.startswith("pytorch_model") and n.endswith((".bin", ".bin.index.json")) for n in names):
        raise CheckpointMismatchError(
            f"load_pretrained: {path} holds PyTorch .bin weights, which cannot be read by slices; "
            "convert them once to safetensors: AutoModelForCausalLM.from_pretrained(path)"
            ".save_pretrained(new_path) (Transformers writes safetensors), then load new_path")
    raise FileNotFoundError(f"load_pretrained: {path} holds no *.safetensors weights (found "
                            f"{', '.join(names[:6]) or 'nothing'})")


def held_model_files(out_dir: str) -> list[str]:
    """The model files (``config.json``, ``*.safetensors``, ...) directory ``out_dir`` already
    holds, which an export would mix with its own (an export refuses such a directory: stale
    shards of another export would stay beside the new ones); [] for a missing directory."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(n for n in os.listdir(out_dir) if n in ("config.json", "generation_config.json")
                  or n.endswith((SAFETENSORS_SUFFIX, ".safetensors.index.json"))
                  or n.startswith("pytorch_model"))


def saved_shapes(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of every tensor in the model's safetensors files (headers only)."""
    from safetensors import safe_open
    from torch.distributed.checkpoint._hf_utils import DTYPE_MAP

    out = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in out:
                    raise CheckpointMismatchError(
                        f"load_pretrained: {key} is in more than one safetensors file of {path}: "
                        "keep the files of one model in the directory")
                piece = f.get_slice(key)
                out[key] = (tuple(piece.get_shape()), DTYPE_MAP.get(piece.get_dtype(), torch.float32))
    return out


# ----------------------------------------------------------------------------------- the model


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied weights), in module order; one list per tensor."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def plan_names(model: torch.nn.Module, saved: Mapping[str, Any], path: str
               ) -> dict[str, str]:
    """{model key: checkpoint key} of every tensor to read, after checking the checkpoint: one
    name of each tied group (the one the checkpoint holds), every other persistent parameter and
    buffer under its own name. Raises ``CheckpointMismatchError`` naming every key missing on
    either side and every shape that differs (dtypes differ freely: they are converted)."""
    from ray_train_xla.toolkit.checkpoint.format import check_fits

    state = model.state_dict(keep_vars=True)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in state.items()
                if isinstance(v, torch.Tensor)}
    aliases: set[str] = set()
    for group in tied_groups(model):
        held = next((n for n in group if n in saved), group[0])
        aliases.update(n for n in group if n != held)
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    found = {k: (tuple(shape), expected[k][1] if k in expected else dtype)
             for k, (shape, dtype) in saved.items()
             if k in expected or not any(p.search(k) for p in ignore)}
    for alias in aliases:
        found.pop(alias, None)  # a tied copy stored as well: read once, under the other name
        expected.pop(alias, None)
    check_fits(found, expected, f"the pretrained model {path}", f"the {type(model).__name__}")
    return {k: k for k in expected}


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters (not buffers) to ``dtype``, ties kept: on the meta device this
    allocates nothing. Non-persistent buffers such as rotary frequencies keep their own dtype,
    and so do the modules the class keeps in fp32 (``_keep_in_fp32_modules``), as in
    ``from_pretrained(..., dtype=...)``."""
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    done: dict[int, torch.nn.Parameter] = {}
    for module_name, module in model.named_modules():
        if dtype != torch.float32 and any(
                k == module_name or f".{k}." in f".{module_name}." for k in keep):
            continue
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point() or param.dtype == dtype:
                continue
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
            module._parameters[name] = done[id(param)]


def _buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor, bool]]:
    """(module, name, buffer, persistent) of every buffer."""
    return [(module, name, buf, name not in module._non_persistent_buffers_set)
            for module in model.modules() for name, buf in module._buffers.items() if buf is not None]


def materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Allocate ``model``'s parameters and buffers on ``device`` (uninitialised: the load
    fills them), then give non-persistent buffers their values: those built on a real device
    keep them; those built on the meta device are computed by the model's own initialisation
    (Transformers' ``_init_weights``, which computes rotary frequencies). A non-persistent
    buffer that nothing computes is refused, naming it."""
    kept = {(id(m), n): b.detach().cpu().clone() for m, n, b, persistent in _buffers(model)
            if not persistent and b.device.type != "meta"}
    to_compute = [(m, n) for m, n, b, persistent in _buffers(model)
                  if not persistent and b.device.type == "meta"]
    ties = tied_groups(model)
    model.to_empty(device=device)
    _retie(model, ties)
    left = []
    with torch.no_grad():
        for module, name, buf, _ in _buffers(model):
            if (id(module), name) in kept:
                buf.copy_(kept[(id(module), name)])
            elif (module, name) in to_compute and buf.is_floating_point():
                buf.fill_(float("nan"))  # so that a buffer nothing computes shows
        init = getattr(model, "_init_weights", None)
        for module in {id(m): m for m, _ in to_compute}.values():
            try:  # (no _init_weights: a TypeError)
                init(module)  # its parameters, if any, are overwritten by the read after this
            except Exception:  # noqa: BLE001 - named below, with the fix
                left.extend(f"{type(module).__name__}.{n}" for m, n in to_compute if m is module)
                continue
            left.extend(f"{type(module).__name__}.{n}" for m, n in to_compute if m is module
                        and m._buffers[n].is_floating_point() and m._buffers[n].isnan().any())
    if left:
        raise CheckpointMismatchError(
            f"load_pretrained: the non-persistent buffers {', '.join(sorted(set(left))[:6])} were "
            "built on the meta device, are not in the checkpoint, and the model's _init_weights "
            "does not compute them: build the model with its buffers on the CPU "
            "(with rtx.meta_parameters(): model = ...), which keeps their values")


def _retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Share one parameter again under every name of each group: ``to_empty`` gives a plain
    module's parameters new objects one by one (FSDP2's DTensors are swapped in place and stay
    shared)."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = first


class meta_parameters:
    """``with rtx.meta_parameters(): model = ...``: parameters on the meta device, buffers on
    the CPU (computed as the model's ``__init__`` computes them, and small), as Accelerate's
    ``init_empty_weights(include_buffers=False)``. For models whose non-persistent buffers
    nothing else recomputes."""

    def __enter__(self):
        self._register = torch.nn.Module.register_parameter

        def register(module, name, param):
            self._register(module, name, param)
            if param is not None and param.device.type != "meta":
                kwargs = param.__dict__
                module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)
                module._parameters[name].__dict__.update(kwargs)

        torch.nn.Module.register_parameter = register
        return self

    def __exit__(self, *exc):
        torch.nn.Module.register_parameter = self._register
        return False


# ------------------------------------------------------------------------------------ loading


def _dist_group():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    from ray_train_xla.toolkit.collectives import host_group

    return host_group("startup")


def read_into(state: dict[str, torch.Tensor], path: str, group=None) -> None:
    """Fill ``state`` (plain tensors or DTensors: this rank's slices) from the safetensors
    files of ``path`` through DCP with torch's ``HuggingFaceStorageReader``: each request reads
    the slice it needs and copies it into its target, converting the dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dcp.load(state, storage_reader=HuggingFaceStorageReader(path),
             planner=DefaultLoadPlanner(allow_partial_load=False),
             process_group=group, no_dist=group is None)


def load_pretrained(
    model: torch.nn.Module,
    path: str,
    *,
    dtype: Any = None,
    mesh=None,
    auto_wrap_policy=None,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    shard_output=None,
    parallelism=None,
    tp_plan=None,
    sequence_parallel: bool = False,
) -> torch.nn.Module:
    """Shard ``model`` (built on the meta device) and fill it from the Hugging Face model
    directory ``path`` by slices; returns the sharded model (as ``prepare_sharded_model``).

    ``path``: a directory ``save_pretrained`` wrote (``model.safetensors``, or shards with
    ``model.safetensors.index.json``), read in place (a shared filesystem works as is), a URI
    (``s3://``, ``gs://``, any scheme pyarrow reads) or a Hugging Face Hub id (``org/name``,
    ``org/name@revision``), fetched once per node (:func:`pretrained_path`). ``dtype``:
    the parameters' dtype (the stored one is converted as it is read); default, the model's as
    built (``from_config(config, dtype=torch.bfloat16)`` builds bf16). The other arguments are
    ``prepare_sharded_model``'s: under a layout with tensor parallelism each rank reads only its
    tensor-parallel slices of its shards. Raises ``CheckpointMismatchError`` before anything is
    allocated when the checkpoint does not fit the model (every key and shape named)."""
    from ray_train_xla.toolkit.sharding import prepare_sharded_model

    path = pretrained_path(path)
    saved = saved_shapes(path)
    dtype = parse_dtype(dtype)
    if dtype is not None:
        cast_parameters(model, dtype)
    names = plan_names(model, saved, path)  # before anything is allocated
    shard = {"auto_wrap_policy": auto_wrap_policy, "mixed_precision": mixed_precision,
             "activation_checkpointing": activation_checkpointing, "parallelism": parallelism,
             "tp_plan": tp_plan, "sequence_parallel": sequence_parallel}
    # FSDP2 shards the model first, each rank reading its slices; torch_xla FSDPv2: one process
    # per host reads the model once, on the CPU, then shards it.
    native = stack().native
    if native:
        model = prepare_sharded_model(model, mesh, **shard)
    materialize(model, get_device() if native else "cpu")
    state = model.state_dict()
    read_into({k: state[k] for k in names}, path, _dist_group() if native else None)
    del state  # FSDPv2 moves the parameters to the devices: no second reference on the host
    if native:
        return model
    return prepare_sharded_model(model, mesh, shard_output=shard_output, **shard)


def pretrained_path(path: str, *, cache_dir: str | None = None, timeout_s: float = 1800.0,
                    weights: bool = True) -> str:
    """A local directory holding the model at ``path``, which is one of:

    - a directory: ``path`` itself (a shared filesystem is read in place);
    - a URI (``s3://``, ``gs://``, any scheme pyarrow reads): a node-local copy in ``cache_dir``
      (default ``$RAY_TRAIN_XLA_MODEL_CACHE``, else the temporary directory), reused by later
      runs (the URI names it: give a new URI for new weights);
    - a Hugging Face Hub id (``org/name`` or ``org/name@revision`` that is no existing path):
      its snapshot directory in the node's Hugging Face cache (``cache_dir``, default
      huggingface_hub's: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``; ``HF_HUB_OFFLINE`` and
      ``HF_TOKEN`` as huggingface_hub reads them), holding ``config.json``, the safetensors
      files its index lists (not with ``weights=False``), its tokenizer files and
      ``generation_config.json``. Files in the cache are not fetched again.

    A URI or an id is fetched once per node: the node's local rank 0 fetches it, the node's
    other workers wait for it, at most ``timeout_s``, and get its error if it fails (through
    marker files beside the copy, or in the cache's ``.locks``: the node's workers must see one
    cache directory). Call it on every worker, before building the model from the directory's
    ``config.json``."""
    import hashlib

    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")  # fresh for every fit and restart
    ident = hub_id(path)
    if ident is not None:
        from ray_train_xla.planning.hub import hf_cache

        marker = os.path.join(hf_cache(cache_dir), ".locks", "ray-train-xla-" + hashlib.sha256(
            f"{path} {weights}".encode()).hexdigest()[:16] + f".{run}")

        def fetch_id() -> str:
            local = snapshot(*ident, weights=weights, tokenizer=True, cache_dir=cache_dir)
            _write_marker(f"{marker}.done", local)  # the snapshot, for the node's other workers
            return local

        def answer() -> str:
            with open(f"{marker}.done", encoding="utf-8") as f:
                return f.read()

        return _once_per_node(path, f"{marker}.done", f"{marker}.failed", timeout_s, fetch_id,
                              answer)
    if "://" not in path:
        return path
    import tempfile

    root = cache_dir or os.environ.get("RAY_TRAIN_XLA_MODEL_CACHE") or tempfile.gettempdir()
    cache = os.path.join(root, "ray-train-xla-model-" + hashlib.sha256(path.encode()).hexdigest()[:16])
    done = os.path.join(cache, ".complete")

    def fetch_uri() -> str:
        if os.path.exists(done):
            return cache
        import uuid

        import pyarrow.fs

        tmp = f"{cache}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(tmp)
            filesystem, remote = pyarrow.fs.FileSystem.from_uri(path)
            pyarrow.fs.copy_files(remote, tmp, source_filesystem=filesystem,
                                  destination_filesystem=pyarrow.fs.LocalFileSystem())
            open(os.path.join(tmp, ".complete"), "w").close()
            try:
                os.rename(tmp, cache)  # whole, with its marker, or not at all
            except OSError:  # another process's complete copy is there: keep it
                if not os.path.exists(done):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return cache

    return _once_per_node(path, done, f"{cache}.{run}.failed", timeout_s, fetch_uri,
                          lambda: cache)


def _once_per_node(source: str, done: str, failed: str, timeout_s: float, fetch, answer) -> str:
    """``fetch()`` on this node's local rank 0 (which makes ``done`` exist, or raises: its error
    is written to ``failed``); the node's other workers wait for either, at most ``timeout_s``,
    then return ``answer()`` or raise rank 0's error."""
    import time

    from ray_train_xla.toolkit.ranks import local_rank

    if local_rank() == 0:
        try:
            local = fetch()
        except Exception as exc:
            _write_marker(failed, f"{type(exc).__name__}: {exc}")
            raise
        if os.path.exists(failed):
            os.remove(failed)
        return local
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(done):
        if os.path.exists(failed):
            with open(failed, encoding="utf-8") as f:
                raise OSError(f"load_pretrained: this node's local rank 0 could not fetch "
                              f"{source}: {f.read()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"load_pretrained: {source} was not fetched by this node's local "
                               f"rank 0 within {timeout_s:g} s (pretrained_path's timeout_s): "
                               f"{done} did not appear (the node's workers must see one cache "
                               "directory)")
        time.sleep(0.2)
    return answer()


def _write_marker(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a waiting worker never reads half)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------- exporting


def file_plan(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], dtype: torch.dtype | None,
              max_shard_bytes: int) -> dict[str, int]:
    """{name: output file index (1-based)}: tensors in order, a new file when the next one
    would pass ``max_shard_bytes`` (as ``save_pretrained`` splits a model)."""
    out, index, size = {}, 1, 0
    for name, (shape, dt) in specs.items():
        nbytes = math.prod(shape) * _export_dtype(dt, dtype).itemsize
        if size and size + nbytes > max_shard_bytes:
            index, size = index + 1, 0
        out[name] = index
        size += nbytes
    return out


def _export_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What a tensor stored as ``stored`` is exported as: ``dtype`` for floating point."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def file_name(index: int, count: int) -> str:
    """``model-0000k-of-0000N.safetensors`` (``model.safetensors`` for one file)."""
    return "model.safetensors" if count == 1 else _writer_file_name(index, count)


def _writer_file_name(index: int, count: int) -> str:
    """The name HuggingFaceStorageWriter and torch's consolidation give file ``index``."""
    from torch.distributed.checkpoint._hf_utils import _gen_file_name

    return _gen_file_name(index, count)


def _stored_dtype(source: str | None) -> torch.dtype | None:
    """The dtype ``config.json`` of ``source`` names (``dtype`` or ``torch_dtype``)."""
    if not source or not os.path.exists(os.path.join(source, "config.json")):
        return None
    with open(os.path.join(source, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(name).replace("torch.", "")) if name else None


def export_pretrained(model: torch.nn.Module, out_dir: str, *, source: str | None = None,
                      dtype: Any = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      config: Any = None) -> dict[str, Any]:
    """Write the (FSDP2-sharded) ``model`` into ``out_dir`` in the Hugging Face layout from
    every rank; call it on every rank. ``out_dir`` must be one directory every rank reaches (a
    local disk on one node, a shared filesystem on several); one that already holds model files
    is refused. For remote storage, or a torch_xla FSDPv2 model, export a checkpoint with
    ``ray-train-xla consolidate --hf``.

    ``dtype``: the export's dtype; default, the dtype ``source``'s ``config.json`` names (the
    pretrained model's), else the parameters'. ``source``: the directory or Hub id the model
    was loaded from; its tokenizer files are copied (an id's are fetched once per node, without
    its weights). ``config``: the model's Transformers config (default
    ``model.config``), written as ``config.json`` with ``generation_config.json``. Output files
    hold at most ``max_shard_bytes`` (``docs/sharded-models.md`` says how the slices are written
    and joined). An error on any rank is raised on every rank. Returns a summary (on every
    rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    if not stack().native and any(type(m).__name__ == "SpmdFullyShardedDataParallel"
                                for m in model.modules()):
        raise ValueError("export_pretrained: a torch_xla FSDPv2 model's state is SPMD tensors under "
                         "_orig_module. names; save a checkpoint (rtx.save_checkpoint) and export it "
                         "with ray-train-xla consolidate CHECKPOINT OUT_DIR --hf")
    group = _dist_group()
    if source is not None and hub_id(source) is not None:
        source = pretrained_path(source, weights=False)
    dtype = parse_dtype(dtype) or _stored_dtype(source)
    # tied weights are written once, as Transformers does
    aliases = {alias for names in tied_groups(model) for alias in _tied_aliases(model, names)}
    state = {k: v for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and k not in aliases}
    whole = [k for k, v in state.items() if not v.is_floating_point()]
    if whole and group is not None:  # torch's consolidation takes floating-point tensors only
        raise ValueError(f"export_pretrained: {', '.join(whole[:4])} are not floating-point, which "
                         "torch's safetensors consolidation does not join; save a checkpoint and "
                         "export it with ray-train-xla consolidate CHECKPOINT OUT_DIR --hf")
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    plan = file_plan(specs, dtype, max_shard_bytes)
    count = max(plan.values())
    sharded = os.path.join(out_dir, SHARDED_SUBDIR)

    def prepare() -> None:
        held = held_model_files(out_dir)
        if held:
            raise FileExistsError(f"export_pretrained: {out_dir} already holds a model "
                                  f"({', '.join(held[:4])}): name another directory, or remove "
                                  "those files first")
        shutil.rmtree(sharded, ignore_errors=True)  # a failed export's slices
        os.makedirs(sharded)

    _on_rank0(prepare, group)
    try:
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(
                     sharded, fqn_to_index_mapping=plan, save_distributed=group is not None),
                 planner=_casting_save_planner(dtype), process_group=group, no_dist=group is None)
        if group is None:  # one process: its files are the whole tensors already, to rename
            for index in sorted(set(plan.values())):
                os.replace(os.path.join(sharded, _writer_file_name(index, count)),
                           os.path.join(out_dir, file_name(index, count)))
        else:
            consolidate_safetensors_files_on_every_rank(sharded, out_dir, plan, process_group=group)
        error = None
    except Exception as exc:  # noqa: BLE001 - shared with every rank below
        error = exc
    _agree(error, group, "export_pretrained")
    names = sorted({file_name(i, count) for i in plan.values()})

    def finish() -> None:
        if count == 1 and group is not None:
            os.replace(os.path.join(out_dir, _writer_file_name(1, 1)), os.path.join(out_dir, names[0]))
        shutil.rmtree(sharded, ignore_errors=True)
        _write_index(out_dir, plan, specs, dtype, count)
        write_model_files(out_dir, config if config is not None else getattr(model, "config", None),
                          source, dtype)

    _on_rank0(finish, group)
    return {"out_dir": out_dir, "files": names, "tensors": len(plan),
            "dtype": str(dtype or next(iter(specs.values()))[1]).replace("torch.", "")}


def _agree(error: BaseException | None, group, what: str) -> None:
    """Raise on every rank when any rank failed: the first failing rank's error, named (a rank
    that raised alone would leave the others waiting in the next collective)."""
    if group is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}",
                           group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if error is not None:
        raise error
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"{what}: rank {rank} failed: {message}")


def _on_rank0(fn, group) -> None:
    """``fn()`` on rank 0, its error raised on every rank."""
    import torch.distributed as dist

    error = None
    if group is None or dist.get_rank() == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - shared with every rank
            error = exc
    _agree(error, group, "export_pretrained")


def _tied_aliases(model: torch.nn.Module, group: list[str]) -> list[str]:
    """The names of a tied group that Transformers leaves out of its files (its
    ``_tied_weights_keys``; else every name but the first)."""
    keys = getattr(model, "_tied_weights_keys", None)
    if isinstance(keys, Mapping):
        named = [n for n in group if n in keys]
    elif keys:
        named = [n for n in group if any(re.fullmatch(k, n) or n.endswith(k) for k in keys)]
    else:
        named = []
    return named if 0 < len(named) < len(group) else group[1:]


def _write_index(out_dir: str, plan: Mapping[str, int],
                 specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 dtype: torch.dtype | None, count: int) -> None:
    if count == 1:
        return
    total = sum(math.prod(shape) * _export_dtype(dt, dtype).itemsize for shape, dt in specs.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {k: file_name(i, count) for k, i in plan.items()}}
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


def write_model_files(out_dir: str, config: Any, source: str | None,
                      dtype: torch.dtype | None) -> None:
    """``config.json`` (with the export's dtype), ``generation_config.json`` (for models that
    generate) and the tokenizer files of ``source``."""
    if config is not None:
        if isinstance(config, Mapping):
            from transformers import AutoConfig

            data = dict(config)
            config = AutoConfig.for_model(data.pop("model_type"), **data)
        if dtype is not None:
            config.dtype = dtype
        config.save_pretrained(out_dir)
        try:
            from transformers import GenerationConfig

            generation = GenerationConfig.from_model_config(config)
            if source and os.path.exists(os.path.join(source, "generation_config.json")):
                generation = GenerationConfig.from_pretrained(source)
            generation.save_pretrained(out_dir)
        except (ImportError, ValueError, OSError):
            pass
    if source and os.path.isdir(source):
        copy_tokenizer_files(source, out_dir)


def copy_tokenizer_files(source: str, out_dir: str) -> list[str]:
    """Copy the tokenizer files of the model directory ``source`` into ``out_dir``; their names."""
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    return copied


def _casting_save_planner(dtype: torch.dtype | None):
    """DCP's default save planner, handing the writer each floating-point tensor converted to
    ``dtype`` as the writer asks for it (one tensor at a time, not a converted copy of the
    whole state)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class CastingSavePlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            if dtype is not None and isinstance(data, torch.Tensor) and data.is_floating_point():
                data = data.to(dtype)
            return data

    return CastingSavePlanner()
