"""Worker start-up and shutdown: what the backends run on every worker, in order.

1. ``facts``: report where the worker runs (``gather_facts``), take ports (``reserve_ports``);
2. ``environment``: apply the planned environment, then the runtime's own steps
   (``runtime_steps``: XRT server records, Neuron's parallel compile, native TorchNeuron checks);
3. ``process_group``: torch_xla's initialisation, the bounded rendezvous (``rendezvous``), the
   process group;
4. ``worker_patches``: the patches that make the worker behave like hardware (``devmode``, the CPU
   development mode) and make Ray's own torch helpers use the worker's device (``ray_helpers``);
5. ``shutdown``: destroy the process group (bounded), undo the patches, the runtime's clean-up.

Before all of these, ``import_env`` runs where a ``TorchNeuronConfig`` is unpickled on a worker:
it puts what torch-neuronx reads at ``import torch`` in the environment first. ``watchdog``
bounds the library calls at start-up that take no timeout.

Everything here runs on workers and reads the plan through ``planning.contract.worker_context``.
"""
