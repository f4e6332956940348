"""Neuron parallel compile, run by the backend on the workers (``neuron_parallel_compile=True``).

The workflow matches Neuron's ``neuron_parallel_compile`` tool and Ray's ``TorchXLAConfig``:
a short trial run with ``NEURON_EXTRACT_GRAPHS_ONLY=1`` records every graph into the Neuron
compile cache without compiling (outputs and losses are placeholders), then, at shutdown, one
worker per node (local rank 0) compiles all recorded graphs in parallel into the cache. The real
run, with the same script and settings, then finds every graph compiled.

Unlike Ray's version: the compile module is looked for at start (a missing one fails then, not
hours later), the scratch directory is private to the run (``tempfile.mkdtemp``, mode 0700,
removed afterwards), and a failed compile fails the run with the compiler's message.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping

from ray_train_xla.errors import NeuronCompileError, WorkerSetupError
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.startup.facts import who

logger = logging.getLogger(__name__)

# Where parallel_compile(work_dir, cache_url, ...) lives: older SDKs, then the newer home.
COMPILE_MODULES = (
    "libneuronxla.neuron_parallel_compile",
    "torch_neuronx.parallel_compile.neuron_parallel_compile",
)
DEFAULT_CACHE_URL = "/var/tmp/neuron-compile-cache"


def find_compile_module() -> str | None:
    """The first importable module of COMPILE_MODULES, or None."""
    for name in COMPILE_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def explicit_cache_dir(neuron_cc_flags: str | None) -> str | None:
    """``--cache_dir`` from NEURON_CC_FLAGS (``--cache_dir=X`` or ``--cache_dir X``)."""
    if neuron_cc_flags and (m := re.search(r"--cache_dir[= ](\S+)", neuron_cc_flags)):
        return m.group(1)
    return None


def resolve_cache_url(env: Mapping[str, str]) -> str:
    """--cache_dir in NEURON_CC_FLAGS, else NEURON_COMPILE_CACHE_URL, else Neuron's default."""
    return (
        explicit_cache_dir(env.get("NEURON_CC_FLAGS"))
        or env.get("NEURON_COMPILE_CACHE_URL")
        or DEFAULT_CACHE_URL
    )


def _cache_url_argument():
    """What parallel_compile expects: libneuronxla's CacheUrl where installed (it applies the
    same precedence), else the resolved URL string."""
    try:
        from libneuronxla.neuron_cc_cache import CacheUrl
    except ImportError:
        return resolve_cache_url(os.environ)
    return CacheUrl.get_cache_url(explicit_cache_dir(os.environ.get("NEURON_CC_FLAGS")))


def on_worker_start() -> None:
    """At start: say that this is a graph-extraction run, and fail now if nothing can compile."""
    if find_compile_module() is None:
        raise WorkerSetupError(
            f"{who()}: neuron_parallel_compile=True, but neither "
            f"{' nor '.join(COMPILE_MODULES)} can be imported on this worker. Install the Neuron "
            "SDK (libneuronxla / torch-neuronx) in the workers' environment, or set "
            "neuron_parallel_compile=False."
        )
    if worker_context().local_rank == 0:
        logger.warning(
            "%s: neuron_parallel_compile=True: this run only extracts graphs; model outputs, "
            "losses and checkpoints are NOT meaningful. Graphs are compiled at shutdown into %s.",
            who(), resolve_cache_url(os.environ),
        )


def compile_extracted_graphs() -> None:
    """At shutdown, on local rank 0 only: compile every extracted graph into the cache."""
    if worker_context().local_rank != 0:
        return
    name = find_compile_module()
    if name is None:
        raise NeuronCompileError(f"{who()}: no Neuron parallel compile module is importable")
    module = importlib.import_module(name)
    workdir = tempfile.mkdtemp(prefix="ray-train-xla-parallel-compile-")  # mode 0700
    logger.info("%s: compiling extracted graphs with %s.parallel_compile in %s", who(), name,
                workdir)
    try:
        failed = module.parallel_compile(workdir, _cache_url_argument())
    except Exception as exc:
        raise NeuronCompileError(
            f"{who()}: Neuron parallel compile failed: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # Newer SDKs return the number of graphs that failed to compile.
    if isinstance(failed, int) and not isinstance(failed, bool) and failed > 0:
        raise NeuronCompileError(
            f"{who()}: Neuron parallel compile: {failed} graph(s) failed to compile; the "
            "compiler's messages are in this worker's log"
        )
