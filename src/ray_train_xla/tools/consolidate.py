"""``ray-train-xla consolidate``: the full model from a checkpoint, for plain torch or Hugging Face.

:func:`consolidate` reads a sharded checkpoint (``torch.distributed.checkpoint``) or a replicated
one (``checkpoint.pt``) on the CPU, without torch_xla, and writes the model's full tensors as
safetensors (and, on request, a ``torch.save`` file), without FSDPv2's ``_orig_module.``
prefixes. :func:`consolidate_hf` (``--hf``) writes a Transformers ``save_pretrained`` directory
instead. Everything a user can get wrong raises ``ConsolidateError`` with a one-line message.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import secrets
import shutil
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import torch

from ray_train_xla.errors import CheckpointMismatchError
from ray_train_xla.toolkit.checkpoint.format import (
    CHECKPOINT_FILE,
    EXTRA_FILE,
    METADATA_FILE,
    NotACheckpointError,
    check_fits,
    is_sharded_checkpoint,
    read_full_state,
    spec_of,
)
from ray_train_xla.toolkit.pretrained import copy_tokenizer_files, held_model_files, parse_dtype

FSDP_V2_PREFIX = "_orig_module."
# torch's activation checkpointing wrapper (checkpoint_wrapper); its own state_dict hook removes
# it, but a state dict taken below the hook (or through another wrapper) keeps it.
CHECKPOINT_WRAPPER_PREFIX = "_checkpoint_wrapped_module."
# The entry of the checkpoint's rest of state that --hf reads the model's config from, when no
# --config is given: save_checkpoint({..., "hf_config": model.config.to_dict()}).
HF_CONFIG_KEY = "hf_config"
# save_pretrained's largest shard, as the Hub recommends (Transformers' own default is 50GB).
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Bound on the first answer of a remote checkpoint's storage (s3://, gs://, ...): without a
# network, some clients retry for many minutes before they fail.
DEFAULT_TIMEOUT_S = 60.0

T = TypeVar("T")


class ConsolidateError(Exception):
    """Why a checkpoint could not be consolidated, in one line. ``exit_code`` is the status the
    command exits with: 1, the checkpoint could not be read or the output could not be written."""

    exit_code = 1


class NotConsolidatableError(ConsolidateError):
    """The command line names nothing to consolidate: the checkpoint does not exist, is not a
    checkpoint, has no ``model`` entry, or the output is a directory (a usage error: exit 2)."""

    exit_code = 2


def plain_model_state(model_state: dict[str, Any], name: str, entry: str) -> dict[str, torch.Tensor]:
    """Model tensors under the unwrapped model's names (FSDPv2 prefixes removed), contiguous.
    Raises ``NotConsolidatableError`` when the entry is no model's state dict (an optimizer's
    or a scheduler's: nested, or without a tensor)."""
    nested = sorted(k for k, v in model_state.items() if isinstance(v, Mapping))
    tensors = {key.replace(FSDP_V2_PREFIX, ""): value.detach().to("cpu").contiguous()
               for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    if nested or not tensors:
        raise NotConsolidatableError(
            f"checkpoint {name}: its {entry!r} entry is not a model's state dict ("
            + (f"it nests {nested[:3]}, as an optimizer's does" if nested else "no tensor")
            + "): give --model the entry a model was saved under")
    return tensors


def consolidate(checkpoint: str, out: str, torch_file: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, model: str = "model") -> dict[str, Any]:
    """Write the full model of ``checkpoint`` (a local checkpoint directory, or a URI Ray Train
    can read) to ``out`` (safetensors) and optionally ``torch_file``; returns a summary.
    ``model``: the checkpoint's entry to write (another model saved beside the one under
    ``"model"``, e.g. ``{"ema": ema}``).

    ``timeout_s`` bounds the first answer of a URI's storage. Each output is written to a
    temporary file next to it, created before the checkpoint is read (an output that cannot be
    written fails at once), then renamed into place: a failure leaves no partial file. Raises
    ``ConsolidateError`` (one line) for anything a user can get wrong."""
    remote = "://" in checkpoint
    if remote:
        filesystem, path = _look(checkpoint, timeout_s)
    else:
        _check_directory(checkpoint, os.path.exists(checkpoint), os.path.isdir(checkpoint))
    if torch_file and os.path.realpath(torch_file) == os.path.realpath(out):
        raise NotConsolidatableError(f"--torch file {torch_file} is OUT: name another file")
    outputs: dict[str, str] = {}
    try:
        outputs[out] = _reserve(out, "OUT")
        if torch_file:
            outputs[torch_file] = _reserve(torch_file, "--torch file")
        if remote:
            sharded, tensors, _ = _read_remote(checkpoint, filesystem, path, entry=model)
        else:
            sharded, tensors, _ = _read_model(checkpoint, entry=model)
        source = checkpoint if remote else os.path.abspath(checkpoint)
        metadata = {"format": "pt", "source": json.dumps({"checkpoint": source, "sharded": sharded})}
        _write(lambda p: _save_safetensors(tensors, p, metadata), outputs[out], out)
        if torch_file:
            _write(lambda p: torch.save(tensors, p), outputs[torch_file], torch_file)
    finally:
        for tmp in outputs.values():
            if os.path.exists(tmp):
                os.remove(tmp)
    return {
        "checkpoint": checkpoint,
        "sharded": sharded,
        "model": model,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": os.path.getsize(out),
        "out": out,
        "torch_file": torch_file,
    }


def consolidate_hf(checkpoint: str, out_dir: str, config: str | None = None,
                   max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                   timeout_s: float = DEFAULT_TIMEOUT_S, dtype: Any = None,
                   filesystem: Any = None, model: str = "model") -> dict[str, Any]:
    """Write the model of ``checkpoint`` (a local checkpoint directory, a URI Ray Train can
    read, or a path on ``filesystem``: a pyarrow filesystem such as Ray's
    ``Checkpoint.filesystem``) into ``out_dir`` in the layout of Hugging Face Transformers'
    ``save_pretrained``; returns a summary. ``model``: the checkpoint's entry to write, as
    :func:`consolidate`'s.

    The model's config comes from ``config`` (a directory holding ``config.json``, or a
    ``config.json`` file), else from the checkpoint's ``hf_config`` entry. The model is built
    from it on the meta device (the architecture ``config.json`` names, else
    ``AutoModelForCausalLM``) and the checkpoint's names and shapes are checked against it
    before anything is written. ``dtype`` (``"bfloat16"``, ``torch.float16``, ...) is the
    export's dtype; default, the one the config names, else the checkpoint's. Written:
    ``config.json``, ``generation_config.json`` (models that generate), a ``config``
    directory's tokenizer files, and weight files of at most ``max_shard_size`` (``"5GB"``,
    ``"500MB"``, or bytes), tied weights once, as Transformers writes them.

    A sharded checkpoint is read one tensor at a time (every rank's shards of it, none of the
    optimizer state), converted and written before the next is read: no more than two tensors
    are held at once. A replicated checkpoint (``checkpoint.pt``) is read whole.

    ``out_dir`` is created if missing; a file, or a directory that already holds model files,
    is refused. Everything is written into a new directory next to it and moved into place at
    the end: a failure leaves nothing. Needs ``transformers``, not torch_xla: Transformers and
    Accelerate are imported with ``USE_TORCH_XLA=0`` when torch_xla is not imported yet.
    Raises ``ConsolidateError`` (one line) for anything a user can get wrong."""
    path = checkpoint
    if filesystem is not None:
        _check_on(filesystem, path, checkpoint)
    elif "://" in checkpoint:
        filesystem, path = _look(checkpoint, timeout_s)
    else:
        _check_directory(checkpoint, os.path.exists(checkpoint), os.path.isdir(checkpoint))
    _check_out_dir(out_dir)
    try:
        export_dtype = parse_dtype(dtype)
    except ValueError as exc:
        raise NotConsolidatableError(f"--dtype {dtype!r} is not a dtype: use bfloat16, float16 or "
                                     "float32") from exc
    config_dict = _read_config_file(config) if config is not None else None
    with _transformers() as transformers:
        shard_bytes = _shard_size(max_shard_size)
        hf_config = None
        if config_dict is not None:
            config_name = f"--config {config}"
            hf_config = _config_of(transformers, config_dict, config_name)
        tmp = _reserve(out_dir, "OUT_DIR", directory=True)
        try:
            source = _model_source(checkpoint, path, filesystem, model)
            if hf_config is None:
                if HF_CONFIG_KEY not in source.extras:
                    raise NotConsolidatableError(
                        f"checkpoint {checkpoint} holds no '{HF_CONFIG_KEY}' entry: name the "
                        "model's config with --config MODEL_DIR (a directory holding config.json, "
                        "or a config.json file), or save it with save_checkpoint({..., "
                        f"'{HF_CONFIG_KEY}': model.config.to_dict()}})")
                config_name = f"the checkpoint's {HF_CONFIG_KEY}"
                hf_config = _config_of(transformers, source.extras[HF_CONFIG_KEY], config_name)
            export_dtype = export_dtype or _config_dtype(hf_config) or _dominant_dtype(source.specs)
            built, plan, tied = _hf_plan(transformers, hf_config, source, export_dtype, checkpoint,
                                         config_name)
            try:
                written = _write_hf(tmp, built, hf_config, plan, source, export_dtype, shard_bytes)
                if config is not None and os.path.isdir(config):
                    copy_tokenizer_files(config, tmp)
                files = _move_into(tmp, out_dir)
            except (OSError, RuntimeError) as exc:  # incl. safetensors' SafetensorError
                raise ConsolidateError(f"cannot write OUT_DIR {out_dir}: {_one_line(exc)}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        weights = [f for f in files if f.endswith(".safetensors")]
        return {
            "checkpoint": checkpoint,
            "sharded": source.sharded,
            "out_dir": out_dir,
            "config": config_name,
            "model": model,
            "architecture": type(built).__name__,
            "dtype": str(export_dtype).replace("torch.", ""),
            "tensors": written["tensors"],
            "parameters": built.num_parameters(),
            "tied": sorted(tied),
            "files": files,
            "shards": len(weights),
            "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in weights),
            "max_shard_size": shard_bytes,
            "read_bytes": written["read_bytes"],
        }


@contextlib.contextmanager
def _transformers() -> Iterator[Any]:
    """The ``transformers`` module, imported (with Accelerate) so that it does not import
    torch_xla when nothing has yet, and without its progress bars."""
    hide_xla = sys.modules.get("torch_xla") is None
    before = os.environ.get("USE_TORCH_XLA")
    if hide_xla:
        os.environ["USE_TORCH_XLA"] = "0"
    try:
        try:
            import transformers
            from transformers.utils import logging as hf_logging
        except ImportError as exc:
            if getattr(exc, "name", None) == "transformers":
                raise ConsolidateError(
                    "--hf needs Hugging Face Transformers, which is not installed: pip install "
                    "transformers (or, in a checkout of ray-train-xla, pip install '.[hf]')") from exc
            raise ConsolidateError(f"--hf cannot import transformers: {_one_line(exc)}") from exc
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield transformers
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    finally:
        if hide_xla:
            if before is None:
                os.environ.pop("USE_TORCH_XLA", None)
            else:
                os.environ["USE_TORCH_XLA"] = before


SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def _shard_size(size: int | str) -> int:
    """``size`` in bytes, parsed as Transformers' save_pretrained parses ``max_shard_size``
    (huggingface_hub: digits and TB, GB, MB or KB, powers of 10), or plain bytes."""
    text = str(size).strip()
    try:
        if isinstance(size, int) or text.isdigit():
            value = int(size)
        else:
            value = int(float(text[:-2]) * SIZE_UNITS[text[-2:].upper()])
    except (KeyError, ValueError):
        value = 0
    if value < 1:
        raise NotConsolidatableError(
            f"--max-shard-size {size!r} is not a size: give digits and a unit, e.g. 5GB, 500MB, "
            "10KB (powers of 10), or bytes")
    return value


def _check_out_dir(out_dir: str) -> None:
    """Refuse an ``out_dir`` that is a file, or a directory that already holds model files."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise NotConsolidatableError(
            f"OUT_DIR {out_dir} is a file: name the directory to write the model into")
    if os.path.isdir(out_dir):
        try:
            held = held_model_files(out_dir)
        except OSError as exc:
            raise ConsolidateError(f"cannot write OUT_DIR {out_dir}: {_one_line(exc)}") from exc
        if held:
            more = f" and {len(held) - 4} more" if len(held) > 4 else ""
            raise NotConsolidatableError(
                f"OUT_DIR {out_dir} already holds a model ({', '.join(held[:4])}{more}): name "
                "another directory, or remove those files first")


def _move_into(tmp: str, out_dir: str) -> list[str]:
    """Move what ``tmp`` holds into ``out_dir`` (renamed to it when missing); the names."""
    names = sorted(os.listdir(tmp))
    if not os.path.lexists(out_dir):
        os.rename(tmp, os.path.realpath(out_dir))
    else:
        for name in names:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    return names


def _read_config_file(config: str) -> dict[str, Any]:
    """The JSON of ``config``: a directory holding ``config.json``, or such a file."""
    file = os.path.join(config, "config.json") if os.path.isdir(config) else config
    if not os.path.exists(config):
        raise NotConsolidatableError(f"--config {config} does not exist")
    if not os.path.isfile(file):
        raise NotConsolidatableError(
            f"--config {config} holds no config.json: name a model directory (as "
            "save_pretrained writes it) or a config.json file")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise NotConsolidatableError(f"--config {config}: cannot read {file} as JSON "
                                     f"({_one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise NotConsolidatableError(f"--config {config}: {file} holds a JSON "
                                     f"{type(data).__name__}, not a model config")
    return data


def _config_of(transformers, value: Any, name: str):
    """The Transformers config that ``value`` (a ``to_dict()`` dict, or a config) describes."""
    if isinstance(value, transformers.PretrainedConfig):
        return value
    if not isinstance(value, Mapping):
        raise NotConsolidatableError(
            f"{name} is a {type(value).__name__}, not a model config (save "
            "model.config.to_dict())")
    model_type = value.get("model_type")
    if not model_type:
        raise NotConsolidatableError(
            f"{name} has no model_type: it is not a Transformers model config")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise NotConsolidatableError(
            f"{name}: model_type {model_type!r} is not a model transformers "
            f"{transformers.__version__} has (models with their own code are not supported)"
        ) from None
    try:
        return config_class.from_dict(dict(value))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise NotConsolidatableError(
            f"{name} is not a valid {config_class.__name__}: {_one_line(exc)}") from exc


def _dominant_dtype(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> torch.dtype:
    """The floating-point dtype of most elements of the tensors ``specs`` describes ((shape,
    dtype) by name; float32 when none is floating-point)."""
    counts: dict[torch.dtype, int] = {}
    for shape, dtype in specs.values():
        if dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + math.prod(shape)
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


class _Source(NamedTuple):
    """The model of a checkpoint: its tensors' specs under the plain model's names, each tensor
    read on request (one at a time for a sharded checkpoint), and the rest of its state
    (``extras``: ``hf_config``)."""

    sharded: bool
    specs: dict
    read: Callable[[str], torch.Tensor]
    extras: dict


def _model_source(checkpoint: str, path: str, filesystem, entry: str = "model") -> _Source:
    """The :class:`_Source` of the checkpoint directory ``path`` (on ``filesystem`` if given):
    its model ``entry``."""
    from ray_train_xla.toolkit.checkpoint import stream

    def plain(name: str) -> str:
        return name.replace(FSDP_V2_PREFIX, "").replace(CHECKPOINT_WRAPPER_PREFIX, "")

    with _reading(checkpoint, checkpoint):
        if stream.read_file(path, METADATA_FILE, filesystem) is not None:
            tensors = stream.ModelTensors(path, filesystem, top=entry, rename=plain)
            if not tensors.entries:
                raise NotConsolidatableError(_no_entry(checkpoint, entry))
            rest = stream.load_small(path, EXTRA_FILE, filesystem)
            extras = {HF_CONFIG_KEY: rest[HF_CONFIG_KEY]} if (
                isinstance(rest, Mapping) and HF_CONFIG_KEY in rest) else {}
            return _Source(True, tensors.specs(), tensors.read, extras)
        if filesystem is not None:
            data = stream.read_file(path, CHECKPOINT_FILE, filesystem)
            if data is None:
                raise NotACheckpointError(f"{checkpoint} is neither a sharded checkpoint (no "
                                          f"{METADATA_FILE}) nor a replicated one (no {CHECKPOINT_FILE})")
            import io

            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
            sharded, model, extras = False, state.get(entry), state
            if not isinstance(model, Mapping):
                raise NotConsolidatableError(_no_entry(checkpoint, entry))
            model = plain_model_state(dict(model), checkpoint, entry)
        else:
            sharded, model, extras = _read_model(path, checkpoint, (HF_CONFIG_KEY,), entry)
    model = {k.replace(CHECKPOINT_WRAPPER_PREFIX, ""): v for k, v in model.items()}
    extras = {k: extras[k] for k in (HF_CONFIG_KEY,) if k in extras}
    return _Source(sharded, {k: (tuple(v.shape), v.dtype) for k, v in model.items()},
                   model.__getitem__, extras)


def _config_dtype(hf_config) -> torch.dtype | None:
    """The dtype the model's config names (``dtype``, or Transformers 4's ``torch_dtype``)."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    try:
        return parse_dtype(value)
    except ValueError:
        return None


def _hf_plan(transformers, hf_config, source: _Source, dtype: torch.dtype, checkpoint: str,
             config_name: str):
    """(the Transformers model of ``hf_config`` on the meta device, {name to write: name to read},
    the tied names) after checking the checkpoint's names and shapes against the model."""
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        model_class = getattr(transformers, architectures[0], None)
        if not (isinstance(model_class, type)
                and issubclass(model_class, transformers.PreTrainedModel)):
            raise NotConsolidatableError(
                f"{config_name} names architecture {architectures[0]!r}, which transformers "
                f"{transformers.__version__} does not have")
        build = model_class._from_config
    else:
        build = transformers.AutoModelForCausalLM.from_config
    try:
        with torch.device("meta"):
            model = build(hf_config, dtype=dtype)
    except (ValueError, TypeError, KeyError, AttributeError, ImportError) as exc:
        what = architectures[0] if architectures else "AutoModelForCausalLM"
        hint = ("" if architectures else " (it names no architectures: add "
                "\"architectures\": [\"...ForCausalLM\"] or the model's class)")
        raise NotConsolidatableError(
            f"cannot build {what} from {config_name}{hint}: {_one_line(exc)}") from exc
    arch = type(model).__name__
    # {tied name: the name it is tied to}, as the config says (tie_word_embeddings, ...).
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    saved = dict(source.specs)
    reads = {k: k for k in saved}
    for target, origin in tied.items():  # a checkpoint may hold one name of a tied pair only
        if target not in saved and origin in saved:
            saved[target], reads[target] = saved[origin], origin
        elif origin not in saved and target in saved:
            saved[origin], reads[origin] = saved[target], target
    expected = {k: spec_of(v) for k, v in model.state_dict().items()}
    # Dtypes are converted on export: only names and shapes must fit.
    comparable = {k: (shape, expected[k][1] if expected.get(k) else dt)
                  for k, (shape, dt) in saved.items()}
    try:
        check_fits(comparable, expected, f"checkpoint {checkpoint}", f"the {arch} of {config_name}")
    except CheckpointMismatchError as exc:
        raise NotConsolidatableError(str(exc)) from exc
    for target, origin in tied.items():
        if reads[target] != reads[origin] and not torch.equal(source.read(reads[target]),
                                                              source.read(reads[origin])):
            raise NotConsolidatableError(
                f"checkpoint {checkpoint}: {config_name} ties {target} to {origin} (e.g. "
                "tie_word_embeddings), but the checkpoint holds different values for them: name "
                "the config the model was trained with (tie_word_embeddings=false for untied "
                "weights)")
    plan = {k: reads[k] for k in expected if k not in tied}
    return model, plan, set(tied)


def _write_hf(out: str, model, hf_config, plan: Mapping[str, str], source: _Source,
              dtype: torch.dtype, max_shard_bytes: int) -> dict[str, int]:
    """Write ``plan``'s tensors (name to write: name to read) into ``out`` as safetensors files
    of at most ``max_shard_bytes``, one tensor at a time, with ``config.json`` and
    ``generation_config.json``."""
    from ray_train_xla.toolkit.checkpoint.stream import write_safetensors
    from ray_train_xla.toolkit.pretrained import INDEX_FILE, file_name, file_plan

    specs = {k: (source.specs[v][0], dtype if source.specs[v][1].is_floating_point
                 else source.specs[v][1]) for k, v in plan.items()}
    index = file_plan(specs, None, max_shard_bytes)
    count = max(index.values()) if index else 1
    read = 0

    def produce(name: str) -> torch.Tensor:
        nonlocal read
        tensor = source.read(plan[name])
        read += tensor.numel() * tensor.element_size()
        return tensor

    for i in range(1, count + 1):
        write_safetensors(os.path.join(out, file_name(i, count)),
                          [(k, *specs[k]) for k in specs if index[k] == i], produce)
    if count > 1:
        total = sum(math.prod(shape) * dt.itemsize for shape, dt in specs.values())
        with open(os.path.join(out, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {k: file_name(index[k], count) for k in specs}}, f, indent=2)
    hf_config.dtype = dtype
    hf_config.save_pretrained(out)
    if model.can_generate():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    return {"tensors": len(specs), "read_bytes": read}


def _check_on(filesystem, path: str, name: str) -> None:
    """Refuse a checkpoint ``path`` on ``filesystem`` that does not exist or is a file."""
    import pyarrow

    try:
        info = filesystem.get_file_info(path)
    except (OSError, pyarrow.ArrowException) as exc:
        raise ConsolidateError(f"cannot read checkpoint {name}: {_one_line(exc)}") from exc
    _check_info(info, name)


def _check_info(info, name: str) -> None:
    """Refuse a checkpoint whose pyarrow ``FileInfo`` says it does not exist or is a file."""
    import pyarrow.fs

    _check_directory(name, info.type != pyarrow.fs.FileType.NotFound,
                     info.type == pyarrow.fs.FileType.Directory)


def _check_directory(name: str, exists: bool, is_dir: bool) -> None:
    """Refuse a checkpoint that does not exist or is a file."""
    if not exists:
        raise NotConsolidatableError(f"checkpoint {name} does not exist")
    if not is_dir:
        raise NotConsolidatableError(f"checkpoint {name} is a file: name the checkpoint's directory")


def _read_model(checkpoint: str, name: str | None = None, extra_keys: tuple[str, ...] = (),
                entry: str = "model") -> tuple[bool, dict[str, torch.Tensor], dict[str, Any]]:
    """(sharded, the full tensors of its model ``entry``, the ``extra_keys`` entries of the rest
    of the state that it holds) of the checkpoint directory ``checkpoint`` (``name``: what to
    call it in errors, default the directory)."""
    name = name or checkpoint
    sharded = is_sharded_checkpoint(checkpoint)
    with _reading(checkpoint, name):
        state = read_full_state(checkpoint, keys=(entry,) if sharded else (entry, *extra_keys))
        extra_file = os.path.join(checkpoint, EXTRA_FILE)
        if sharded and extra_keys and os.path.exists(extra_file):
            rest = torch.load(extra_file, map_location="cpu", weights_only=False)
            if isinstance(rest, Mapping):
                state.update({k: rest[k] for k in extra_keys if k in rest})
    if entry not in state:
        raise NotConsolidatableError(_no_entry(name, entry))
    if not isinstance(state[entry], Mapping):
        raise NotConsolidatableError(
            f"checkpoint {name}: its {entry!r} entry is a {type(state[entry]).__name__}, "
            "not a state dict (save model.state_dict(), or the model itself)")
    extras = {k: state[k] for k in extra_keys if k in state}
    return sharded, plain_model_state(dict(state[entry]), name, entry), extras


def _no_entry(name: str, entry: str) -> str:
    """The message for a checkpoint without the model ``entry``."""
    if entry == "model":
        return (f"checkpoint {name} has no 'model' entry to consolidate (save_checkpoint("
                "{'model': model.state_dict(), ...}) writes one; --model names another)")
    return f"checkpoint {name} has no model entry {entry!r} to consolidate"


@contextlib.contextmanager
def _reading(path: str, name: str) -> Iterator[None]:
    """Turn what reading the checkpoint at ``path`` raises into a ``ConsolidateError`` that
    names it ``name``; an error that is not about the files (a bug) goes through as it is."""
    try:
        yield
    except ConsolidateError:
        raise
    except NotACheckpointError as exc:
        raise NotConsolidatableError(f"checkpoint {str(exc).replace(path, name, 1)}") from exc
    except CheckpointMismatchError as exc:  # shards that do not make up the declared tensors
        raise ConsolidateError(f"cannot consolidate {str(exc).replace(path, name, 1)}") from exc
    except BaseException as exc:  # narrowed by _read_failure: anything else is re-raised
        reason = _read_failure(exc)
        if reason is None:
            raise
        raise ConsolidateError(f"cannot read checkpoint {name}: {reason}") from exc


def _read_failure(exc: BaseException) -> str | None:
    """One line saying why reading checkpoint files failed, or None for an error that is not
    about the files (a bug: shown with its traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        # torch.distributed.checkpoint wraps each rank's error with its traceback as text.
        failures = [pair[0] for pair in exc.failures.values()]
        return "torch.distributed.checkpoint could not load it" + (
            f" ({_one_line(failures[0])})" if failures else "")
    # OSError: unreadable files; the others: a truncated, corrupt or foreign torch file, or one
    # that pickles classes this interpreter cannot import.
    if isinstance(exc, (OSError, EOFError, pickle.UnpicklingError, RuntimeError, ImportError,
                        AttributeError)):
        return _one_line(exc)
    return None


def _reserve(path: str, what: str, directory: bool = False) -> str:
    """A new empty file (or ``directory``) next to ``path`` (a symlink's target), to be renamed
    onto it once written (a directory: where save_pretrained writes before its files are moved
    into ``path``); a file is created with the permissions a plain open() would give."""
    if not directory and os.path.isdir(path):
        raise NotConsolidatableError(f"{what} {path} is a directory: name the file to write")
    target = os.path.realpath(path)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ConsolidateError(f"cannot write {what} {path}: cannot create directory "
                               f"{exc.filename or parent} ({exc.strerror or exc})") from exc
    tmp = os.path.join(parent, f".{os.path.basename(target)}.{secrets.token_hex(4)}.tmp")
    try:
        if directory:
            os.mkdir(tmp)
        else:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise ConsolidateError(f"cannot write {what} {path}: cannot create a "
                               f"{'directory' if directory else 'file'} in {parent} "
                               f"({exc.strerror or exc})") from exc
    return tmp


def _save_safetensors(model: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(model, path, metadata=metadata)
    except SafetensorError as exc:  # the Rust writer's I/O errors (disk full, ...)
        raise OSError(str(exc)) from exc


def _write(save: Callable[[str], None], tmp: str, path: str) -> None:
    """``save`` to ``tmp``, then rename it to ``path``."""
    try:
        save(tmp)
        os.replace(tmp, os.path.realpath(path))
    except (OSError, RuntimeError) as exc:  # torch.save reports I/O errors as RuntimeError
        raise ConsolidateError(f"cannot write {path}: {_one_line(exc)}") from exc


def _look(uri: str, timeout_s: float):
    """(filesystem, path) of the checkpoint directory at ``uri``, after one look at it bounded
    by ``timeout_s``."""
    import pyarrow
    import pyarrow.fs

    def look():
        filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
        return filesystem, path, filesystem.get_file_info(path)

    try:
        filesystem, path, info = _bounded(look, timeout_s)
    except TimeoutError:
        raise ConsolidateError(f"cannot read checkpoint {uri}: its storage did not answer "
                               f"within {timeout_s:g} s (see --timeout)") from None
    except pyarrow.ArrowInvalid as exc:  # e.g. an unknown scheme
        raise NotConsolidatableError(f"checkpoint {uri}: {_one_line(exc)}") from exc
    except (OSError, pyarrow.ArrowException) as exc:  # unreachable storage, no credentials
        raise ConsolidateError(f"cannot read checkpoint {uri}: {_one_line(exc)}") from exc
    _check_info(info, uri)
    return filesystem, path


def _read_remote(uri: str, filesystem, path: str, extra_keys: tuple[str, ...] = (),
                 entry: str = "model") -> tuple[bool, dict[str, torch.Tensor], dict[str, Any]]:
    """_read_model of the checkpoint at ``uri``, downloaded by Ray Train's Checkpoint."""
    import pyarrow
    import ray.train

    try:
        with ray.train.Checkpoint(path, filesystem=filesystem).as_directory() as local:
            return _read_model(local, uri, extra_keys, entry)
    except (OSError, pyarrow.ArrowException) as exc:  # the download failed
        raise ConsolidateError(f"cannot read checkpoint {uri}: {_one_line(exc)}") from exc


def _bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()``, or TimeoutError after ``timeout_s`` (``fn`` is then left running in a daemon
    thread: storage clients offer no way to cancel a call)."""
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="ray-train-xla-consolidate-look", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _one_line(exc: BaseException) -> str:
    """The exception's message on one line (its lines joined), with its type when that says
    more than the message alone."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if not text or isinstance(exc, (EOFError, pickle.UnpicklingError, ImportError,
                                    AttributeError)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text
