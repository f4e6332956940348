"""What each runtime does on the worker itself, beyond its environment: at start-up (after the
plan is applied) and at shutdown (after the process group is destroyed). Legacy XRT
(``runtime='xrt'``) keeps its servers in check (``xrt``), ``neuron_parallel_compile=True``
compiles the extracted graphs (``neuron_compile``), and native TorchNeuron and TorchTPU check
the worker and point Ray's device helpers at its device (``native_neuron``, ``native_tpu``).
"""

from __future__ import annotations

from ray_train_xla.planning.contract import NATIVE, WorkerContext
from ray_train_xla.startup import native_neuron, native_tpu, neuron_compile, xrt


def prepare(ctx: WorkerContext) -> None:
    """Start-up steps of this worker's runtime."""
    if ctx.runtime == "xrt":
        xrt.clean_stale_servers()
        xrt.watch_for_servers(timeout_s=ctx.timeout_s)
    if ctx.parallel_compile:
        neuron_compile.on_worker_start()
    if ctx.runtime == NATIVE and ctx.device == "neuron":
        native_neuron.prepare_neuron_worker()
    if ctx.runtime == NATIVE and ctx.device == "tpu":
        native_tpu.prepare_tpu_worker()


def cleanup(ctx: WorkerContext) -> None:
    """Shutdown steps of this worker's runtime (the parallel compile runs to completion: it is
    the point of a precompile run)."""
    try:
        if ctx.runtime == "xrt":
            xrt.stop_own_servers()
    finally:
        if ctx.parallel_compile:
            neuron_compile.compile_extracted_graphs()
