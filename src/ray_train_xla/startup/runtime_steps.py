"""What each runtime does on the worker itself, beyond its environment: at start-up (after the
plan is applied) and at shutdown (after the process group is destroyed).

- legacy XRT (``runtime='xrt'``): record the XRT servers this worker starts, stop the ones a
  crashed worker left, and stop our own at shutdown (``xrt``);
- Neuron with ``neuron_parallel_compile=True``: check that something can compile at start, and
  compile the extracted graphs at shutdown (``neuron_compile``);
- native TorchNeuron on Neuron: check the worker and point Ray's device helpers at its
  NeuronCore (``native_neuron``);
- native TorchTPU on TPU: the same for its chip (``native_tpu``).
"""

from __future__ import annotations

from ray_train_xla.planning.contract import NATIVE, WorkerContext


def prepare(ctx: WorkerContext) -> None:
    """Start-up steps of this worker's runtime."""
    if ctx.runtime == "xrt":
        from ray_train_xla.startup import xrt

        xrt.clean_stale_servers()
        xrt.watch_for_servers(timeout_s=ctx.timeout_s)
    if ctx.parallel_compile:
        from ray_train_xla.startup import neuron_compile

        neuron_compile.on_worker_start()
    if ctx.runtime == NATIVE and ctx.device == "neuron":
        from ray_train_xla.startup import native_neuron

        native_neuron.prepare_neuron_worker()
    if ctx.runtime == NATIVE and ctx.device == "tpu":
        from ray_train_xla.startup import native_tpu

        native_tpu.prepare_tpu_worker()


def cleanup(ctx: WorkerContext) -> None:
    """Shutdown steps of this worker's runtime (the parallel compile runs to completion: it is
    the point of a precompile run)."""
    try:
        if ctx.runtime == "xrt":
            from ray_train_xla.startup import xrt

            xrt.stop_own_servers()
    finally:
        if ctx.parallel_compile:
            from ray_train_xla.startup import neuron_compile

            neuron_compile.compile_extracted_graphs()
