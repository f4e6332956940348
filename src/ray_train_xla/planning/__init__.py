"""Planning: the options, who is where, and every worker's environment. Pure: no Ray, no torch.

- ``options``: the options of every config and their validation;
- ``topology``: the facts workers report and the ranks derived from them;
- ``contract``: every planned variable name, who owns it, and ``WorkerContext`` (the typed view of
  the planned environment on a worker);
- ``runtimes/``: one module per device runtime (its own variables and checks);
- ``planner``: the whole plan (``plan``), device resolution and the runtime table.
"""

from ray_train_xla.planning.options import NeuronOptions, TPUOptions, XLAOptions
from ray_train_xla.planning.planner import Rendezvous, WorkerPlan, get_runtime, plan, resolve_device
from ray_train_xla.planning.topology import Topology, WorkerFacts, WorkerPlace

__all__ = ["NeuronOptions", "Rendezvous", "TPUOptions", "Topology", "WorkerFacts", "WorkerPlace",
           "WorkerPlan", "XLAOptions", "get_runtime", "plan", "resolve_device"]
