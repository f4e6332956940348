"""``ray-train-xla consolidate``: one file of the full model from a checkpoint, for plain torch.

Reads a sharded checkpoint (``torch.distributed.checkpoint``, written by ``save_checkpoint`` of
SPMD state) or a replicated one (``checkpoint.pt``) on the CPU, without torch_xla, and writes the
model's full tensors as safetensors (and, on request, a ``torch.save`` file). FSDPv2's
``_orig_module.`` key prefixes are removed, so the file loads into the unwrapped model.

Everything a user can get wrong (a missing or foreign directory, no model in it, unreachable
storage, an output that cannot be written) raises ``ConsolidateError`` with a one-line message.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from ray_train_xla.errors import CheckpointMismatchError
from ray_train_xla.toolkit.checkpoint.format import (
    NotACheckpointError,
    is_sharded_checkpoint,
    read_full_state,
)

FSDP_V2_PREFIX = "_orig_module."
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


def plain_model_state(model_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model tensors under the unwrapped model's names (FSDPv2 prefixes removed), contiguous."""
    out = {}
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor):
            out[key.replace(FSDP_V2_PREFIX, "")] = value.detach().to("cpu").contiguous()
    return out


def consolidate(checkpoint: str, out: str, torch_file: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Write the full model of ``checkpoint`` (a local checkpoint directory, or a URI Ray Train
    can read) to ``out`` (safetensors) and optionally ``torch_file``; returns a summary.

    ``timeout_s`` bounds the first answer of a URI's storage. Each output is written to a
    temporary file next to it, created before the checkpoint is read (an output that cannot be
    written fails at once), then renamed into place: a failure leaves no partial file. Raises
    ``ConsolidateError`` (one line) for anything a user can get wrong."""
    remote = "://" in checkpoint
    if remote:
        filesystem, path = _look(checkpoint, timeout_s)
    else:
        _check_directory(checkpoint)
    if torch_file and os.path.realpath(torch_file) == os.path.realpath(out):
        raise NotConsolidatableError(f"--torch file {torch_file} is OUT: name another file")
    outputs: dict[str, str] = {}
    try:
        outputs[out] = _reserve(out, "OUT")
        if torch_file:
            outputs[torch_file] = _reserve(torch_file, "--torch file")
        if remote:
            sharded, model = _read_remote(checkpoint, filesystem, path)
        else:
            sharded, model = _read_model(checkpoint)
        source = checkpoint if remote else os.path.abspath(checkpoint)
        metadata = {"format": "pt", "source": json.dumps({"checkpoint": source, "sharded": sharded})}
        _write(lambda p: _save_safetensors(model, p, metadata), outputs[out], out)
        if torch_file:
            _write(lambda p: torch.save(model, p), outputs[torch_file], torch_file)
    finally:
        for tmp in outputs.values():
            if os.path.exists(tmp):
                os.remove(tmp)
    return {
        "checkpoint": checkpoint,
        "sharded": sharded,
        "tensors": len(model),
        "parameters": sum(t.numel() for t in model.values()),
        "bytes": os.path.getsize(out),
        "out": out,
        "torch_file": torch_file,
    }


def _check_directory(path: str) -> None:
    """Refuse a local checkpoint ``path`` that does not exist or is a file."""
    if not os.path.exists(path):
        raise NotConsolidatableError(f"checkpoint {path} does not exist")
    if not os.path.isdir(path):
        raise NotConsolidatableError(f"checkpoint {path} is a file: name the checkpoint's directory")


def _read_model(checkpoint: str, name: str | None = None) -> tuple[bool, dict[str, torch.Tensor]]:
    """(sharded, the model's full tensors) of the checkpoint directory ``checkpoint`` (``name``:
    what to call it in errors, default the directory)."""
    name = name or checkpoint
    sharded = is_sharded_checkpoint(checkpoint)
    try:
        state = read_full_state(checkpoint)
    except NotACheckpointError as exc:
        raise NotConsolidatableError(f"checkpoint {str(exc).replace(checkpoint, name, 1)}") from exc
    except CheckpointMismatchError as exc:  # shards that do not make up the declared tensors
        raise ConsolidateError(f"cannot consolidate {str(exc).replace(checkpoint, name, 1)}") from exc
    except BaseException as exc:  # narrowed by _read_failure: anything else is re-raised
        reason = _read_failure(exc)
        if reason is None:
            raise
        raise ConsolidateError(f"cannot read checkpoint {name}: {reason}") from exc
    if "model" not in state:
        raise NotConsolidatableError(
            f"checkpoint {name} has no 'model' entry to consolidate (save_checkpoint("
            "{'model': model.state_dict(), ...}) writes one)")
    if not isinstance(state["model"], Mapping):
        raise NotConsolidatableError(
            f"checkpoint {name}: its 'model' entry is a {type(state['model']).__name__}, "
            "not a state dict (save model.state_dict())")
    return sharded, plain_model_state(dict(state["model"]))


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


def _reserve(path: str, what: str) -> str:
    """A new empty file next to ``path`` (a symlink's target), to be renamed onto it once
    written; created with the permissions a plain open() would give."""
    if os.path.isdir(path):
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
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise ConsolidateError(f"cannot write {what} {path}: cannot create a file in {parent} "
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
    if info.type == pyarrow.fs.FileType.NotFound:
        raise NotConsolidatableError(f"checkpoint {uri} does not exist")
    if info.type != pyarrow.fs.FileType.Directory:
        raise NotConsolidatableError(f"checkpoint {uri} is a file: name the checkpoint's directory")
    return filesystem, path


def _read_remote(uri: str, filesystem, path: str) -> tuple[bool, dict[str, torch.Tensor]]:
    """_read_model of the checkpoint at ``uri``, downloaded by Ray Train's Checkpoint."""
    import pyarrow
    import ray.train

    try:
        with ray.train.Checkpoint(path, filesystem=filesystem).as_directory() as local:
            return _read_model(local, uri)
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
