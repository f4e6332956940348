"""The CPU development mode under real Ray Train and real torch_xla: code written for torch_xla
runs unchanged on CPU workers and gets the results of a multi-device runtime.

One training function runs every check as an ``_mp_fn(rank)``-style function (our own tests of
the behaviours pytorch/xla's ``test/test_mp_*.py`` check) and writes one record per worker; the
tests assert on the records. One fit of 4 workers runs every check (under Train V1: the seed
check, the world view, Ray's helpers, the pad-mask loader and ray_train_xla's own collectives);
2 workers run in test_toolkit_ray and test_reporting_ray.
"""

from __future__ import annotations

import io
import os
import traceback

import pytest

from conftest import fit, is_train_v2, write_record

pytestmark = [pytest.mark.ray]


# ---- _mp_fn-style checks: each raises AssertionError on a wrong result, returns facts ----------


def _seed_fn(rank):
    """The seed's sanity check, unchanged: xm.all_reduce of ones, in a loop."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    for _ in range(3):
        ones = torch.ones(2, 3, device=device)
        out = xm.all_reduce(xm.REDUCE_SUM, ones)
        torch_xla.sync()
        assert torch.equal(out.cpu(), torch.ones(2, 3) * xr.world_size()), out.cpu()
    return {}


def _world_fn(rank):
    import ray.train
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch.utils.data import DistributedSampler

    ctx = ray.train.get_context()
    printed = io.StringIO()
    xm.master_print("hello from the master", fd=printed)
    sampler = DistributedSampler(range(20), num_replicas=xr.world_size(), rank=xr.global_ordinal(),
                                 shuffle=False)
    return {
        "world_size": xr.world_size(), "global_ordinal": xr.global_ordinal(),
        "local_ordinal": xr.local_ordinal(), "get_local_ordinal": xm.get_local_ordinal(),
        "process_count": xr.process_count(), "process_index": xr.process_index(),
        "global_device_count": xr.global_device_count(),
        "is_master_local": xm.is_master_ordinal(local=True),
        "is_master_global": xm.is_master_ordinal(local=False),
        "master_printed": printed.getvalue(),
        "ray_rank": ctx.get_world_rank(), "ray_local_rank": ctx.get_local_rank(),
        "ray_world": ctx.get_world_size(), "ray_node_rank": ctx.get_node_rank(),
        "sampler_indices": list(sampler),
        # Removed in torch_xla 2.9 (it fails on hardware too): not added back on CPU.
        "removed_apis": [a for a in ("get_ordinal", "xrt_world_size") if hasattr(xm, a)],
        "env": {k: os.environ.get(k) for k in ("NODE_RANK", "ACCELERATE_TORCH_DEVICE")},
    }


def _replication_fn(rank):
    """All-reduce: list form (in place), single tensor, scale, and through torch.compile."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    n = xr.world_size()
    ones = torch.ones(2, 3)
    xones, xtwos = ones.to(device), (ones + 1).to(device)
    xm.all_reduce(xm.REDUCE_SUM, [xones, xtwos])
    threes = xm.all_reduce(xm.REDUCE_SUM, (ones + 2).to(device))
    fours = xm.all_reduce(xm.REDUCE_SUM, (ones + 3).to(device), scale=0.5)
    biggest = xm.all_reduce(xm.REDUCE_MAX, torch.tensor([float(rank)], device=device))
    assert xones.cpu().allclose(ones * n) and xtwos.cpu().allclose((ones + 1) * n)
    assert threes.cpu().allclose((ones + 2) * n)
    assert fours.cpu().allclose((ones + 3) * n * 0.5)
    assert biggest.cpu().item() == n - 1
    if n % 2 == 0:
        groups = [list(range(0, n, 2)), list(range(1, n, 2))]
        grouped = xm.all_reduce(xm.REDUCE_SUM, torch.tensor([float(rank)], device=device),
                                groups=groups)
        mine = groups[rank % 2]
        assert grouped.cpu().item() == sum(mine), grouped.cpu()

    def reduce(t):
        return xm.all_reduce(xm.REDUCE_SUM, t)

    compiled = torch.compile(reduce, backend="openxla", fullgraph=True)
    first = compiled((ones + 4).to(device)).cpu()
    second = compiled(torch.full((2, 3), float(rank), device=device)).cpu()  # not a constant
    assert first.allclose((ones + 4) * n), first
    assert second.allclose(torch.full((2, 3), float(sum(range(n))))), second
    return {}


def _all_gather_fn(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    n = xr.world_size()
    ordinal = torch.tensor([float(rank)], device=device)
    assert xm.all_gather(ordinal, dim=0).cpu().tolist() == [float(i) for i in range(n)]
    two_d = xm.all_gather(torch.full((2, 1), float(rank), device=device), dim=1).cpu()
    assert two_d.tolist() == [[float(i) for i in range(n)]] * 2, two_d
    if n % 2 == 0:
        groups = [[i for i in range(n) if i % 2 == 0], [i for i in range(n) if i % 2 == 1]]
        got = xm.all_gather(ordinal, dim=0, groups=groups).cpu()
        assert got.tolist() == [float(i) for i in range(rank % 2, n, 2)], got
    tensors = [torch.tensor([i * 1000.0 + rank], device=device) for i in range(5)]
    expected = [[i * 1000.0 + j for j in range(n)] for i in range(5)]
    assert [t.cpu().tolist() for t in xm.all_gather(tensors, dim=0, pin_layout=False)] == expected
    outputs = [torch.zeros(n, device=device) for _ in range(5)]
    returned = xm.all_gather(tensors, dim=0, output=outputs, pin_layout=False)
    assert returned is outputs and [t.cpu().tolist() for t in outputs] == expected
    bucketed = xm.all_gather_bucketized(tensors, dim=0, pin_layout=False)
    assert [t.cpu().tolist() for t in bucketed] == expected
    return {}


def _reduce_scatter_fn(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    n = xr.world_size()
    scale, shard = 1.0 / n, 2
    gen = torch.Generator().manual_seed(rank)
    x = torch.rand((4, shard * n, 3), generator=gen).to(device)
    res = xm.reduce_scatter(xm.REDUCE_SUM, x, scale, 1, n)
    whole = xm.all_reduce(xm.REDUCE_SUM, x, scale).cpu()
    assert res.cpu().allclose(whole[:, rank * shard:(rank + 1) * shard]), res.cpu()
    xs = [torch.rand((4, shard * n), generator=gen).to(device) for _ in range(3)]
    wholes = [xm.all_reduce(xm.REDUCE_SUM, t, scale).cpu() for t in xs]
    for result in (xm.reduce_scatter(xm.REDUCE_SUM, xs, scale, 1, n, pin_layout=False),
                   xm.reduce_scatter_bucketized(xm.REDUCE_SUM, xs, scale, 1, n, pin_layout=False)):
        for got, w in zip(result, wholes):
            assert got.cpu().allclose(w[:, rank * shard:(rank + 1) * shard])
    outs = [torch.zeros(4, shard, device=device) for _ in xs]
    assert xm.reduce_scatter(xm.REDUCE_SUM, xs, scale, 1, n, output=outs, pin_layout=False) is outs
    for got, w in zip(outs, wholes):
        assert got.cpu().allclose(w[:, rank * shard:(rank + 1) * shard])
    # output= of another shape: the result replaces it (pytorch/xla's test passes full-size ones)
    full = [torch.zeros(4, shard * n, device=device) for _ in xs]
    xm.reduce_scatter_bucketized(xm.REDUCE_SUM, xs, scale, 1, n, output=full, pin_layout=False)
    for got, w in zip(full, wholes):
        assert got.shape == (4, shard) and got.cpu().allclose(w[:, rank * shard:(rank + 1) * shard])
    return {}


def _rendezvous_fn(rank):
    """Rendezvous: ordinal i's payload at position i, whatever order ``replicas`` lists; a
    subset of the replicas is refused, as torch_xla refuses it."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    n = xr.world_size()
    everyone = xm.rendezvous("rdzv.all", str(rank).encode())
    assert [int(d) for d in everyone] == list(range(n)), everyone
    listed = xm.rendezvous("rdzv.listed", f"ORD={rank}".encode(), replicas=list(range(n))[::-1])
    assert [d.decode() for d in listed] == [f"ORD={i}" for i in range(n)], listed
    try:
        xm.rendezvous("rdzv.subset", b"", replicas=[0])
    except ValueError as exc:
        assert str(exc) == "Only global rendezvous is supported", exc
    else:
        raise AssertionError("a rendezvous of a replica subset was accepted")
    return {}


def _mesh_reduce_fn(rank):
    import torch
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    n = xr.world_size()
    assert xm.mesh_reduce("mesh.scalar", 1.25, sum) == 1.25 * n
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = xm.mesh_reduce("mesh.tensor", t, lambda v: torch.stack(v).sum(dim=0))
    assert got.allclose(t * n), got
    return {}


def _save_fn(rank, out_dir):
    """xm.save writes once (the master) and every worker reads the master's values."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    save_dir = out_dir + "-xm-save"  # out_dir holds only the JSON records
    os.makedirs(save_dir, exist_ok=True)
    device = torch_xla.device()
    path = os.path.join(save_dir, "shared.pt")
    state = {"a": torch.full((3,), float(rank), device=device), "step": 7 + rank}
    xm.save(state, path)
    xm.rendezvous("after-save")
    loaded = torch.load(path)
    assert loaded["a"].tolist() == [0.0] * 3 and loaded["step"] == 7, loaded
    xm.save(state, os.path.join(save_dir, f"rank{rank}.pt"), master_only=False)
    xm.rendezvous("after-save-all")
    files = sorted(os.listdir(save_dir))
    steps = [torch.load(os.path.join(save_dir, f"rank{i}.pt"))["step"] for i in range(xr.world_size())]
    return {"files": files, "per_rank_steps": steps}


def _broadcast_fn(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    n = xr.world_size()
    x = torch.full((2,), float(rank + 1), device=device)
    xm.collective_broadcast([x], root_ordinal=n - 1)
    assert x.cpu().tolist() == [float(n)] * 2, x.cpu()
    torch.manual_seed(rank)  # different initialisations
    model = torch.nn.Linear(3, 2).to(device)
    xm.broadcast_master_param(model)
    return {"weight": model.weight.detach().cpu().tolist()}


def _sync_batch_norm_fn(rank):
    """SyncBatchNorm trained with xm.optimizer_step equals a CPU BatchNorm on the global batch."""
    import torch
    import torch_xla
    import torch_xla.core.functions as xf
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    n, bsz, features, length = xr.world_size(), 8, 5, 6
    torch.manual_seed(1)
    batch = torch.rand((n * bsz, features, length))
    device = torch_xla.device()
    sbn = xf.SyncBatchNorm(features).to(device)
    bn = torch.nn.BatchNorm1d(features)
    opt_x = torch.optim.SGD(sbn.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(bn.parameters(), lr=0.1)
    for _ in range(2):
        out = sbn(batch[rank * bsz:(rank + 1) * bsz].to(device))
        (out * out).sum().backward()
        xm.optimizer_step(opt_x)
        opt_x.zero_grad()
        torch_xla.sync()
        ref = bn(batch)
        ((ref * ref).sum() / n).backward()  # xm.optimizer_step averages over n workers
        opt_c.step()
        opt_c.zero_grad()
        assert out.cpu().allclose(ref[rank * bsz:(rank + 1) * bsz], atol=1e-4), "outputs differ"
    sbn_cpu = sbn.cpu()
    for name in ("weight", "bias", "running_mean", "running_var"):
        a, b = getattr(sbn_cpu, name), getattr(bn, name)
        # pytorch/xla's tolerances: SyncBatchNorm's running variance differs in rounding.
        assert a.allclose(b, rtol=7e-2, atol=1e-4), (name, a, b)
    return {}


def _ddp_fn(rank):
    """torch_xla's DDP recipe, with the script's own init_process_group("xla") left in."""
    import copy

    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("xla", init_method="xla://")  # already done by the backend
    n, per = xr.world_size(), 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x, y = torch.randn(per * n, 4), torch.randn(per * n, 1)
    device = torch_xla.device()
    ddp = DDP(model.to(device), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[rank * per:(rank + 1) * per].to(device)),
                                            y[rank * per:(rank + 1) * per].to(device))
        loss.backward()
        opt.step()
        xm.mark_step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    diff = max((a.detach().cpu() - b.detach()).abs().max().item()
               for a, b in zip(ddp.module.parameters(), reference.parameters()))
    assert diff < 1e-5, diff
    return {"ddp_max_diff": diff}


def _torch_distributed_fn(rank):
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    n = dist.get_world_size()
    t = torch.full((3,), float(rank), device=device)
    dist.all_reduce(t)
    assert t.device.type == "xla" and t.cpu().tolist() == [float(sum(range(n)))] * 3
    b = torch.full((2,), float(rank), device=device)
    dist.broadcast(b, src=n - 1)
    assert b.cpu().tolist() == [float(n - 1)] * 2
    outs = [torch.zeros(2, device=device) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(rank), device=device))
    assert [o.cpu().tolist() for o in outs] == [[float(i)] * 2 for i in range(n)]
    shard = torch.zeros(2, device=device)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * n, device=device))
    assert shard.cpu().tolist() == [n * 2.0 * rank, n * (2.0 * rank + 1)], shard.cpu()
    dist.barrier()
    try:
        xm.all_to_all(t, 0, 0, n)
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    return {"backend": dist.get_backend(), "all_to_all_refused": refused}


def _ray_helpers_fn(rank):
    """Ray's own torch helpers train on the XLA device, not silently on the CPU."""
    import ray.train.torch
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    device = ray.train.torch.get_device()
    model = ray.train.torch.prepare_model(torch.nn.Linear(2, 1))
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(8.0).reshape(8, 1)), batch_size=2))
    rows = [float(v) for (b,) in loader for v in b.cpu().reshape(-1)]
    first = next(iter(loader))[0]
    return {
        "device": str(device), "devices": [str(d) for d in ray.train.torch.get_devices()],
        "ddp": isinstance(model, DistributedDataParallel),
        "param_device": next(model.parameters()).device.type,
        "batch_device": first.device.type, "rows": rows,
    }


def _pad_loader_fn(rank):
    """ragged="pad" over 10 rows: the masks of all workers count each row exactly once."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ray_train_xla as rtx

    loader = rtx.prepare_data_loader(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2),
                                     ragged="pad", shuffle=False)
    real = []
    for (values,), mask in loader:
        real += [float(v) for v, m in zip(values.cpu(), mask.cpu()) if m > 0]
    return {"real_rows": real, "batches": len(loader)}


def _helpers_fn(rank):
    """ray_train_xla's own collectives on the development mode's process group, with Ray's
    ranks; the run id this fit's workers share."""
    import torch
    import torch.distributed as dist

    import ray_train_xla as rtx

    device = rtx.get_device()
    n, r = rtx.world_size(), rtx.rank()
    summed = rtx.all_reduce(torch.ones(2, 3, device=device))
    mean = rtx.all_reduce(torch.full((2,), float(r), device=device), op="mean")
    biggest = rtx.all_reduce(torch.tensor([float(r)], device=device), op="max")
    from_last = rtx.broadcast(torch.tensor([float(r * 10)], device=device), src=n - 1)
    rtx.rendezvous("end")
    return {
        "rank": r,
        "world": n,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "pg_backend": dist.get_backend(),
        "result_device": summed.device.type,
        "sum": summed.cpu().tolist(),
        "mean": mean.cpu().tolist(),
        "max": biggest.cpu().tolist(),
        "broadcast": from_last.cpu().tolist(),
        "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        "ray_rank": __import__("ray").train.get_context().get_world_rank(),
    }


CHECKS = {
    "seed": _seed_fn, "world": _world_fn, "replication": _replication_fn,
    "all_gather": _all_gather_fn, "reduce_scatter": _reduce_scatter_fn,
    "rendezvous": _rendezvous_fn, "mesh_reduce": _mesh_reduce_fn, "save": _save_fn,
    "broadcast": _broadcast_fn, "sync_batch_norm": _sync_batch_norm_fn, "ddp": _ddp_fn,
    "torch_distributed": _torch_distributed_fn, "ray_helpers": _ray_helpers_fn,
    "pad_loader": _pad_loader_fn, "helpers": _helpers_fn,
}


def run_checks(config):
    """Run the named checks in order on this worker; one record with each result or failure."""
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    results, failures = {}, {}
    for name in config["checks"]:
        fn = CHECKS[name]
        try:
            args = (rank, config["out_dir"]) if name == "save" else (rank,)
            results[name] = fn(*args)
        except Exception as exc:  # recorded, so one fit reports every failing check
            failures[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    write_record(config, f"rank{rank}", {"rank": rank, "results": results, "failures": failures})


ALL_CHECKS = list(CHECKS)


def _by_rank(records):
    return sorted(records, key=lambda r: r["rank"])


def _assert_world(records, n):
    for rec in records:
        r, w = rec["rank"], rec["results"]["world"]
        assert w["world_size"] == w["ray_world"] == w["process_count"] == w["global_device_count"] == n
        assert w["global_ordinal"] == w["process_index"] == w["ray_rank"] == r
        assert w["local_ordinal"] == w["get_local_ordinal"] == w["ray_local_rank"]
        assert w["is_master_global"] is (r == 0) and w["is_master_local"] is (w["ray_local_rank"] == 0)
        assert w["master_printed"] == ("hello from the master\n" if r == 0 else "")
        assert w["env"] == {"NODE_RANK": str(w["ray_node_rank"]), "ACCELERATE_TORCH_DEVICE": "xla:0"}
        assert w["removed_apis"] == []
    shards = [rec["results"]["world"]["sampler_indices"] for rec in records]
    per = -(-20 // n)  # DistributedSampler repeats rows to give every worker as many
    assert [len(s) for s in shards] == [per] * n
    assert sorted(set(i for s in shards for i in s)) == list(range(20))
    every = [i for s in shards for i in s]
    assert len(every) - len(set(every)) == n * per - 20  # only the repeated tail overlaps


@pytest.fixture(scope="module")
def four_workers(ray_local):
    """One fit of 4 workers running every check (Train V1: the checks whose Ray helpers differ
    between V1 and V2, and the seed, world and loader checks)."""
    checks = ALL_CHECKS if is_train_v2() else ["seed", "world", "ray_helpers", "pad_loader",
                                                 "helpers"]
    _, records = fit(run_checks, num_workers=4, loop_config={"checks": checks})
    return _by_rank(records)


def test_torch_xla_code_runs_unchanged_on_cpu_workers(four_workers):
    workers = 4
    records = four_workers
    assert [r["rank"] for r in records] == list(range(workers))
    for rec in records:
        assert rec["failures"] == {}, f"rank {rec['rank']}: {rec['failures']}"
    _assert_world(records, workers)
    # xm.save wrote once (rank 0's values in the shared file) and per rank when asked.
    for rec in records:
        assert rec["results"]["save"]["per_rank_steps"] == [7 + i for i in range(workers)]
    # broadcast_master_param: every worker ends with rank 0's parameters.
    weights = {str(rec["results"]["broadcast"]["weight"]) for rec in records}
    assert len(weights) == 1
    for rec in records:
        assert rec["results"]["ddp"]["ddp_max_diff"] < 1e-5
        td = rec["results"]["torch_distributed"]
        assert td["backend"] == "xla_host"
        assert "not available in ray_train_xla's CPU development mode" in td["all_to_all_refused"]
    _assert_ray_helpers(records)


def _assert_ray_helpers(records):
    for rec in records:
        rh = rec["results"]["ray_helpers"]
        assert rh["device"] == "xla:0" and rh["devices"] == ["xla:0"]
        assert rh["ddp"] is True and rh["param_device"] == "xla" and rh["batch_device"] == "xla"
    # Ray's DistributedSampler shards the 8 rows (repeating some when they do not divide evenly)
    all_rows = [v for rec in records for v in rec["results"]["ray_helpers"]["rows"]]
    per = -(-8 // len(records))
    assert sorted(set(all_rows)) == [float(i) for i in range(8)] and len(all_rows) == per * len(records)


@pytest.mark.train_v1  # Ray's helpers differ between Train V1 and V2
def test_seed_check_world_view_ray_helpers_and_pad_masks_with_four_workers(four_workers):
    records = four_workers
    for rec in records:
        assert rec["failures"] == {}, f"rank {rec['rank']}: {rec['failures']}"
    _assert_world(records, 4)
    _assert_ray_helpers(records)
    assert {rec["results"]["pad_loader"]["batches"] for rec in records} == {2}
    real = sorted(v for rec in records for v in rec["results"]["pad_loader"]["real_rows"])
    assert real == [float(i) for i in range(10)]


@pytest.mark.train_v1
def test_several_workers_reduce_through_gloo(four_workers):
    """ray_train_xla's helpers (the "helpers" check of the fit above). Fresh run ids per
    worker-group start: test_elastic_local and test_neuron_ray."""
    workers = 4
    for rec in four_workers:
        assert "helpers" not in rec["failures"], rec["failures"]["helpers"]
    records = [rec["results"]["helpers"] for rec in four_workers]
    assert sorted(r["rank"] for r in records) == list(range(workers))
    expected_mean = sum(range(workers)) / workers
    for rec in records:
        assert rec["world"] == rec["dist_world"] == workers
        assert rec["dist_rank"] == rec["rank"] == rec["ray_rank"]
        assert rec["pg_backend"] == "xla_host"  # the CPU development mode
        assert rec["result_device"] == "xla"
        assert rec["sum"] == [[float(workers)] * 3] * 2
        assert rec["mean"] == pytest.approx([expected_mean] * 2)
        assert rec["max"] == [float(workers - 1)]
        assert rec["broadcast"] == [float((workers - 1) * 10)]
    assert len({r["run_id"] for r in records}) == 1
