"""One worker of the gloo start-retry test (outside Ray): the planned environment comes from the
test; ``--fail-once RANK KIND`` makes that rank's first ``init_process_group`` raise what gloo
raises when a connection it did not expect reaches its listener (``KIND`` "gloo"), or another
error ("other"), after the group was set up on that rank, so the other ranks start theirs.
Prints one JSON line: ok, the error, the attempt the group started on, an all_reduce result."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ray_train_xla.startup.process_group import init_process_group

fail_rank, kind = int(sys.argv[2]), sys.argv[3]
real = dist.init_process_group
calls = []


def init_process_group_failing_once(*args, **kwargs):
    calls.append(kwargs.get("rank"))
    if kwargs.get("rank") == fail_rank and len(calls) == 1:
        real(*args, **kwargs)  # the other ranks' pairs with this one connect
        distributed_c10d._world.group_count += 1  # as a group that failed half-way leaves it
        if kind == "gloo":
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:547] Connection closed "
                               "by peer [127.0.0.1]:38578 (injected)")
        raise RuntimeError("some other failure (injected)")
    return real(*args, **kwargs)


dist.init_process_group = init_process_group_failing_once
out: dict = {"attempts": 0}
try:
    init_process_group()
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    out.update(ok=True, total=t.item(), attempts=len(calls))
    dist.destroy_process_group()
except Exception as exc:
    out.update(ok=False, error=f"{type(exc).__name__}: {exc}", attempts=len(calls))
print(json.dumps(out), flush=True)
