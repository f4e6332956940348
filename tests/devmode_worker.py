"""One worker of the CPU development mode outside Ray, for tests/test_devmode_semantics.py.

The planned environment of several CPU workers comes from the test; this process starts the
process group as a Ray worker does (``init_process_group``, which installs the development
mode), then calls torch_xla's own API and records what it got: values, or the type and message
of what was raised. Prints one JSON line per check: ``{"rank", "check", "result"}``, or
``"failure"`` (with the traceback) for a check that raised unexpectedly; the others still run.
Checks to run: the command-line arguments (default: all).
"""

from __future__ import annotations

import json
import sys
import traceback


def _error(fn):
    """[type name, message] of what ``fn()`` raised (None if it returned)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (what was raised is the result)
        return [type(exc).__name__, str(exc)]
    return None


def check_rendezvous(rank, n):
    """Item 1: payloads by ordinal whatever the order of ``replicas``; subsets refused."""
    import torch_xla.core.xla_model as xm

    return {
        "listed": [p.decode() for p in xm.rendezvous("r.listed", str(rank).encode(),
                                                     replicas=[2, 0, 1])],
        "subset": _error(lambda: xm.rendezvous("r.subset", b"x", replicas=[0, 1])),
        "xla_subset": _error(lambda: xm.xla_rendezvous(b"x", ordinals=[0, 1])),
        "not_bytes": _error(lambda: xm.rendezvous("r.str", "text")),
        "all": [p.decode() for p in xm.rendezvous("r.all", f"p{rank}".encode())],
    }


def check_dist_reduce(rank, n):
    """Item 2: dist.reduce writes the result on dst only."""
    import torch
    import torch.distributed as dist
    import torch_xla

    a = torch.full((2,), float(rank + 1), device=torch_xla.device())
    dist.reduce(a, dst=1)
    return {"value": a.cpu().tolist()}


def check_step_closures(rank, n):
    """Item 3: a step closure runs at the next mark_step, never inside a bridged collective."""
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    d = torch_xla.device()
    w = torch.zeros(1, device=d)
    seen = []
    xm.add_step_closure(lambda: seen.append(w.cpu().item()))
    during = {}
    calls = {
        "all_reduce": lambda: xm.all_reduce("sum", torch.ones(1, device=d)),
        "all_reduce_list": lambda: xm.all_reduce("sum", [torch.ones(1, device=d)]),
        "all_gather": lambda: xm.all_gather(torch.ones(1, device=d)),
        "reduce_scatter": lambda: xm.reduce_scatter("sum", torch.ones(n, device=d), 1.0, 0, n),
        "collective_broadcast": lambda: xm.collective_broadcast([torch.ones(1, device=d)]),
        "dist_all_reduce": lambda: dist.all_reduce(torch.ones(1, device=d)),
        "dist_broadcast": lambda: dist.broadcast(torch.ones(1, device=d), src=0),
        "dist_all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.zeros(n, device=d), torch.ones(1, device=d)),
        "dist_reduce": lambda: dist.reduce(torch.ones(1, device=d), dst=0),
    }
    for name, call in calls.items():
        call()
        during[name] = list(seen)
    w.add_(1)
    xm.mark_step()
    after_mark_step = list(seen)

    # Inside xm.optimizer_step: the closure sees the parameters after optimizer.step().
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False).to(d)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.ones(1, 2, device=d)).sum().backward()
    weights = []
    xm.add_step_closure(lambda: weights.append(model.weight.detach().cpu().tolist()))
    xm.optimizer_step(opt)
    in_optimizer_step = len(weights)
    xm.mark_step()
    return {"during": during, "after_mark_step": after_mark_step,
            "in_optimizer_step": in_optimizer_step, "closure_weight": weights,
            "final_weight": model.weight.detach().cpu().tolist()}


def check_reduce_scatter(rank, n):
    """Item 4: a scatter dimension shard_count does not divide is refused as torch_xla does."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    d = torch_xla.device()
    return {
        "single": _error(lambda: xm.reduce_scatter("sum", torch.arange(7.0, device=d), 1.0, 0, 3)),
        "list": _error(lambda: xm.reduce_scatter("sum", [torch.arange(7.0, device=d)], 1.0, 0, 3,
                                                 pin_layout=False)),
        "dim1": _error(lambda: xm.reduce_scatter("sum", torch.zeros(2, 4, device=d), 1.0, 1, 3)),
        "ok": xm.reduce_scatter("sum", torch.arange(6.0, device=d), 1.0, 0, 3).cpu().tolist(),
    }


def check_all_gather_into_tensor(rank, n):
    """Item 5: the stacked output shape (world, *input.shape), the concatenated one, a scalar
    input; any other shape refused as torch_xla's backend does."""
    import torch
    import torch.distributed as dist
    import torch_xla

    d = torch_xla.device()
    inp = torch.full((2,), float(rank), device=d)
    stacked, flat, scalar = (torch.zeros(n, 2, device=d), torch.zeros(2 * n, device=d),
                             torch.zeros(n, device=d))
    dist.all_gather_into_tensor(stacked, inp)
    dist.all_gather_into_tensor(flat, inp)
    dist.all_gather_into_tensor(scalar, torch.tensor(float(rank), device=d))
    return {
        "stacked": stacked.cpu().tolist(), "flat": flat.cpu().tolist(),
        "scalar": scalar.cpu().tolist(),
        "wrong": _error(lambda: dist.all_gather_into_tensor(torch.zeros(5, device=d), inp)),
    }


def check_scale(rank, n):
    """Item 6: the scale is converted to the tensor's dtype before it multiplies the sum."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    d = torch_xla.device()
    ints = torch.tensor([rank + 1, rank + 2], device=d)
    return {
        "int_half": xm.all_reduce("sum", ints, scale=0.5).cpu().tolist(),
        "int_2_5": xm.all_reduce("sum", ints, scale=2.5).cpu().tolist(),
        "int_list": [t.cpu().tolist() for t in xm.all_reduce("sum", [ints.clone()], scale=0.5)],
        "bf16": xm.all_reduce("sum", torch.ones(1, dtype=torch.bfloat16, device=d),
                              scale=0.3).float().cpu().tolist(),
        "f32": xm.all_reduce("sum", torch.ones(1, device=d), scale=0.3).cpu().tolist(),
    }


def check_collective_broadcast(rank, n):
    """Item 7: groups without the root get zeros (torch_xla zeroes non-roots, then sums)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    d = torch_xla.device()
    x = torch.full((2,), float(rank + 1), device=d)
    xm.collective_broadcast([x], root_ordinal=2, groups=[[0, 2], [1]])
    y = torch.full((2,), float(rank + 1), device=d)
    xm.collective_broadcast([y], root_ordinal=1)
    return {"grouped": x.cpu().tolist(), "global": y.cpu().tolist()}


def check_refusals(rank, n):
    """Item 8: what torch_xla refuses is refused; what it accepts with unequal groups works."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    d = torch_xla.device()
    t = torch.full((1,), float(rank), device=d)
    return {
        "list_pinned": _error(lambda: xm.all_gather([t])),
        "unequal_unpinned": _error(lambda: xm.all_gather(t, groups=[[0, 2], [1]],
                                                         pin_layout=False)),
        "unequal_pinned": xm.all_gather(t, groups=[[2, 0], [1]]).cpu().tolist(),
        "not_tensor": _error(lambda: xm.all_gather(3, pin_layout=False)),
    }


def check_compile(rank, n):
    """Item 9: torch.compile(backend="openxla") of functions calling bridged collectives."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    d = torch_xla.device()
    x = torch.tensor([float(rank)], device=d)
    out = {}

    def run(name, fn, *args, **kw):
        try:
            got = torch.compile(fn, backend="openxla", **kw)(*args)
            out[name] = ([g.cpu().tolist() for g in got] if isinstance(got, (list, tuple))
                         else got.cpu().tolist())
        except Exception as exc:  # noqa: BLE001 (recorded: the test checks the message)
            out[name] = [type(exc).__name__, str(exc)[:2000]]

    run("all_gather", lambda v: xm.all_gather(v) + 1, x)
    run("all_gather_full", lambda v: xm.all_gather(v, pin_layout=False) * 2, x, fullgraph=True)

    def list_reduce(a, b):
        xm.all_reduce("sum", [a, b])
        return a + b

    a, b = x.clone(), x.clone() + 1
    run("list_all_reduce", list_reduce, a, b)
    out["list_all_reduce_inputs"] = [a.cpu().tolist(), b.cpu().tolist()]
    run("grouped_all_reduce", lambda v: xm.all_reduce("sum", v, groups=[[0, 2], [1]]) * 1, x)
    run("scaled_all_reduce", lambda v: xm.all_reduce("sum", v, scale=0.5) + 0, x,
        fullgraph=True)
    run("reduce_scatter", lambda v: xm.reduce_scatter("sum", v, 1.0, 0, n) - 1,
        torch.arange(float(n), device=d))

    def gather_out(v, o):
        xm.all_gather(v, output=o, pin_layout=False)
        return o * 1

    o = torch.zeros(n, device=d)
    run("all_gather_out", gather_out, x, o)
    out["all_gather_out_input"] = o.cpu().tolist()
    run("reduce_scatter_list", lambda v, w: xm.reduce_scatter("sum", [v, w], 0.5, 0, n,
                                                              pin_layout=False),
        torch.ones(n, device=d), torch.full((n,), float(rank), device=d))

    def bcast(v):
        xm.collective_broadcast([v], root_ordinal=1)
        return v * 1

    c = x.clone() + 5
    run("collective_broadcast", bcast, c)
    out["collective_broadcast_input"] = c.cpu().tolist()
    run("rendezvous", lambda v: v + len(xm.rendezvous("in-compile", b"x")), x)
    run("rendezvous_full", lambda v: v + len(xm.rendezvous("in-compile-full", b"x")), x,
        fullgraph=True)
    def dist_reduce(v):
        import torch.distributed as dist

        dist.all_reduce(v)
        return v * 1

    run("dist_all_reduce", dist_reduce, x.clone(), fullgraph=True)

    def dist_gather(v):
        import torch.distributed as dist

        o = torch.zeros(n, device=v.device)
        dist.all_gather_into_tensor(o, v)
        s = torch.zeros(1, device=v.device)
        dist.reduce_scatter_tensor(s, o * 2)
        return o + 0, s + 0

    run("dist_gather", dist_gather, x.clone())
    return out


CHECKS = {
    "rendezvous": check_rendezvous, "dist_reduce": check_dist_reduce,
    "step_closures": check_step_closures, "reduce_scatter": check_reduce_scatter,
    "all_gather_into_tensor": check_all_gather_into_tensor, "scale": check_scale,
    "collective_broadcast": check_collective_broadcast, "refusals": check_refusals,
    "compile": check_compile,
}


def main() -> None:
    import faulthandler
    import os

    import torch.distributed as dist

    from ray_train_xla.startup.process_group import init_process_group
    from ray_train_xla.startup.worker_patches import install_worker_patches

    # Bounded: a rank stuck in a collective its peers left prints every stack and exits.
    faulthandler.dump_traceback_later(float(os.environ.get("RTX_TEST_WORKER_LIMIT_S", "240")),
                                      exit=True)
    init_process_group()
    install_worker_patches()
    rank, n = dist.get_rank(), dist.get_world_size()
    for name in (sys.argv[1:] or CHECKS):
        record = {"rank": rank, "check": name}
        try:
            record["result"] = CHECKS[name](rank, n)
        except Exception as exc:  # noqa: BLE001 (recorded; the next checks still run)
            record["failure"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        print(json.dumps(record), flush=True)  # one line per check: a later hang loses none
        dist.barrier()  # a failed check on one rank must not shift the next one's collectives
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
