"""Worker helpers on real torch_xla (CPU), in a process whose environment the test planned.

``rank-mapping``: a worker whose Ray Train rank (1) differs from its XLA ordinal (0), with the
``xla`` process-group path. ``spmd-global``: the TPU SPMD plan's variables on an XLA CPU mesh of
4 devices (no process group exists: a helper that went to the host would fail).
Prints one JSON line of what the helpers returned.
"""

import json
import sys

import torch

scenario = sys.argv[1]
out: dict = {}
if scenario == "rank-mapping":
    import torch_xla.runtime as xr

    import ray_train_xla as rtx

    device = rtx.get_device()
    mine = torch.tensor([5.0, -1.0], device=device)
    out["ordinal"] = xr.global_ordinal()
    out["rank"] = rtx.rank()
    # World of 2, this process alone: what it contributes is all that comes back.
    out["broadcast_src_own_rank"] = rtx.broadcast(mine, src=1).cpu().tolist()
    out["broadcast_src_other_rank"] = rtx.broadcast(mine, src=0).cpu().tolist()
    with_nan = torch.tensor([float("nan"), 2.0], device=device)
    out["broadcast_nan_from_non_src"] = rtx.broadcast(with_nan, src=0).cpu().tolist()
elif scenario == "spmd-global":
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import ray_train_xla as rtx

    out["is_spmd"] = xr.is_spmd()
    out["devices"] = xr.global_runtime_device_count()
    out["uses_host_collectives"] = rtx.uses_host_collectives()
    mesh = xs.Mesh(np.arange(4), (4, 1), ("data", "model"))
    x = torch.arange(8.0).reshape(4, 2).to(rtx.get_device())
    xs.mark_sharding(x, mesh, ("data", None))
    out["sum"] = rtx.all_reduce(x, "sum").cpu().tolist()
    out["mean"] = rtx.all_reduce(x, "mean").cpu().tolist()
    out["broadcast"] = rtx.broadcast(x, src=1).cpu().tolist()
    out["x"] = x.cpu().tolist()
    # A training step: global gradients stay as XLA computed them (no host, no averaging).
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1).to(rtx.get_device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    grad = model.weight.grad.cpu().tolist()
    rtx.optimizer_step(opt)
    out["grad"] = grad
    out["expected_grad"] = x.cpu().sum(dim=0, keepdim=True).tolist()
    out["weight_moved"] = model.weight.cpu().tolist()
print(json.dumps(out), flush=True)
