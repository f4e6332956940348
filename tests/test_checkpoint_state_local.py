"""A checkpoint's state as entries of their own (``toolkit/checkpoint/describe.py``), without Ray:
several sharded models and optimizers, an LR scheduler and the rest, saved by tensor-parallel
ranks and restored on fewer ranks of another layout, bit for bit; and the same entries
replicated, in one process.

The sharded case runs on gloo processes (the native CPU twin's environment): 4 ranks train a tiny
Hugging Face Llama TP 2 x FSDP 2 (column-wise layers ``(_StridedShard(0), Shard(0))``, row-wise
``(Shard(0), Shard(1))``, norms on ``dp_shard`` alone) with an EMA copy (a second sharded model)
and two optimizers, and save them in this thread (``seam.save_sharded``: the in-thread writer);
2 ranks (FSDP 2, TP 1: fewer workers, another layout) restore every entry by name."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.14

STEPS = 2


def _env(rank: int, world: int, port: int, run: str) -> None:
    from fsdp2_worker import native_cpu_env

    native_cpu_env(rank, world, port, run, 60)


def _entries(shape):
    """A model, its EMA copy (a second sharded model), an optimizer for each, a scheduler."""
    import sys

    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fsdp2_worker as w

    from ray_train_xla.toolkit.tensor_parallel import parallelize

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model = parallelize(w.make_lm(), mesh, auto_wrap_policy={w.block_class()})
    ema = parallelize(w.make_lm(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ema_opt = torch.optim.SGD(ema.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return w, {"model": model, "ema": ema, "optimizer": opt, "ema_optimizer": ema_opt,
               "scheduler": sched}


def _whole(w, entries) -> dict:
    """Every entry's state, whole, by name."""
    return {"model": w.named_state(entries["model"], entries["optimizer"]),
            "ema": w.named_state(entries["ema"], entries["ema_optimizer"]),
            "scheduler": entries["scheduler"].state_dict(),
            "lr": [g["lr"] for g in entries["optimizer"].param_groups]}


def _save(rank: int, world: int, port: int, root: str) -> None:
    _env(rank, world, port, "save")
    import torch.distributed as dist

    from ray_train_xla.toolkit.checkpoint.seam import save_sharded

    dist.init_process_group("gloo")
    w, entries = _entries((1, 2, 2))
    model, ema, opt, ema_opt = (entries[k] for k in ("model", "ema", "optimizer", "ema_optimizer"))
    for step in range(STEPS):
        dp = model.model.embed_tokens.weight.device_mesh["dp_shard"]
        ids = w.rows(step, dp.get_local_rank(), dp.size())
        for m, o in ((model, opt), (ema, ema_opt)):
            o.zero_grad()
            w.loss_of(m, ids).backward()
            o.step()
        entries["scheduler"].step()
    placements = {n: str(p.placements) for n, p in model.named_parameters()
                  if n.endswith(("q_proj.weight", "o_proj.weight", "input_layernorm.weight"))}
    written = save_sharded({**entries, "step": STEPS}, os.path.join(root, "ckpt"))
    whole = _whole(w, entries)
    if rank == 0:
        torch.save(whole, os.path.join(root, "saved.pt"))
        with open(os.path.join(root, "save.json"), "w") as f:
            json.dump({"placements": placements, "files": written["files"]}, f)
    dist.destroy_process_group()


def _load(rank: int, world: int, port: int, root: str) -> None:
    _env(rank, world, port, "load")
    import torch.distributed as dist

    from ray_train_xla.toolkit.checkpoint.seam import load_sharded

    dist.init_process_group("gloo")
    w, entries = _entries((1, world, 1))
    rest = load_sharded(os.path.join(root, "ckpt"), entries)
    saved = torch.load(os.path.join(root, "saved.pt"), weights_only=False)
    got = _whole(w, entries)
    record = {"rest": rest, "exact": {k: w.exact(got[k], saved[k]) for k in saved},
              "placements": str(entries["model"].model.layers[0].self_attn.q_proj.weight.placements)}
    # A replicated checkpoint (one plain file: the optimizer's state by position) into the
    # sharded model and optimizer: every rank takes its slices of the whole tensors.
    plain = os.path.join(root, "plain")
    if rank == 0:
        names = [n for n, _ in w.make_lm().named_parameters()]
        osd = torch.optim.AdamW(w.make_lm().parameters(), lr=1e-2).state_dict()
        osd["state"] = {i: saved["model"]["optimizer"][n] for i, n in enumerate(names)}
        os.makedirs(plain)
        torch.save({"model": saved["model"]["model"], "optimizer": osd, "step": STEPS},
                   os.path.join(plain, "checkpoint.pt"))
    dist.barrier()
    _, fresh = _entries((1, world, 1))
    whole = load_sharded(plain, fresh["model"], fresh["optimizer"])
    record["plain"] = [whole["step"], w.exact(w.named_state(fresh["model"], fresh["optimizer"]),
                                              saved["model"])]
    with open(os.path.join(root, f"load{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


def _spawn(fn, world: int, root: str) -> None:
    """``fn`` on ``world`` ranks, forked from a server that imported torch and Transformers
    once (``forkserver``: a fresh process, not this one)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch.distributed.checkpoint", "transformers.models.llama.modeling_llama",
         "ray_train_xla.toolkit.tensor_parallel", "ray_train_xla.toolkit.checkpoint.seam"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(fn, args=(world, port, root), nprocs=world, start_method="forkserver")


def test_several_models_and_optimizers_reshard_from_tp2_fsdp2_to_fsdp2_on_fewer_ranks(tmp_path):
    root = str(tmp_path)
    _spawn(_save, 4, root)
    with open(tmp_path / "save.json") as f:
        saved = json.load(f)
    # the layout saved: q_proj column-wise, o_proj row-wise over tp, the norm on FSDP alone
    assert "_StridedShard(dim=0" in saved["placements"]["model.layers.0.self_attn.q_proj.weight"]
    assert "Shard(dim=1)" in saved["placements"]["model.layers.0.self_attn.o_proj.weight"]
    assert saved["placements"]["model.layers.0.input_layernorm.weight"] == "(Shard(dim=0),)"
    marker = json.loads((tmp_path / "ckpt" / "sharded.json").read_text())
    assert marker["format_version"] == 3 and marker["workers"] == 4
    assert marker["models"] == ["model", "ema"]
    assert marker["optimizers"] == ["optimizer", "ema_optimizer"]
    _spawn(_load, 2, root)
    for rank in (0, 1):
        with open(tmp_path / f"load{rank}.json") as f:
            r = json.load(f)
        assert r["placements"] == "(Shard(dim=0),)"  # FSDP 2 alone now
        assert r["exact"] == {"model": True, "ema": True, "scheduler": True, "lr": True}, r
        assert r["rest"] == {"step": STEPS}  # the entries given back are not returned
        assert r["plain"] == [STEPS, True]  # a replicated file into the shards, by position


@pytest.fixture
def native_cpu(monkeypatch):
    """This process as a native config's CPU twin (no torch_xla)."""
    from ray_train_xla.planning import contract

    monkeypatch.setenv(contract.RUNTIME_VAR, "native")
    monkeypatch.setenv(contract.DEVICE_VAR, "cpu")
    contract.reload()
    yield
    monkeypatch.undo()
    contract.reload()


def test_replicated_entries_are_saved_as_state_dicts_and_restored_in_place(tmp_path, native_cpu):
    """Replicated state, in one process: modules, optimizers and a scheduler as entries are
    written as their state dicts (``checkpoint.pt`` loads with plain torch), and restored in
    place; the positional form returns the whole file, the mapping form the rest; an entry
    nothing can restore is refused, naming it."""
    from ray_train_xla.errors import CheckpointMismatchError
    from ray_train_xla.toolkit.checkpoint.describe import describe
    from ray_train_xla.toolkit.checkpoint.seam import load_sharded

    torch.manual_seed(0)
    model, ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    state = {"model": model, "ema": ema, "optimizer": opt, "scheduler": sched, "step": 7}
    described = describe(state)
    assert described.kind.layout is None
    assert [p.key for p in described.models] == ["model", "ema"]
    assert [o.key for o in described.optimizers] == ["optimizer"]
    staged = described.kind.stage(described)
    described.kind.writer(staged, "checkpoint.pt")(str(tmp_path), None)
    plain = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert sorted(plain) == ["ema", "model", "optimizer", "scheduler", "step"]
    assert torch.equal(plain["model"]["weight"], model.weight)

    fresh, fresh_ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    rest = load_sharded(str(tmp_path), {"model": fresh, "ema": fresh_ema, "optimizer": fresh_opt,
                                        "scheduler": fresh_sched})
    assert rest == {"step": 7}
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh_ema.bias, ema.bias)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    assert fresh_sched.state_dict() == sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.05
    whole = load_sharded(str(tmp_path), fresh, fresh_opt)  # as before: the whole file
    assert sorted(whole) == ["ema", "model", "optimizer", "scheduler", "step"]

    with pytest.raises(TypeError, match=r"cannot restore the entries 'step' \(int\)"):
        load_sharded(str(tmp_path), {"model": fresh, "step": 7})
    other = torch.nn.Linear(4, 3)
    before = other.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match="has no 'warmup' to restore"):
        load_sharded(str(tmp_path), {"model": other, "warmup": fresh_sched})
    assert torch.equal(other.weight, before)  # refused before anything was loaded
    # An optimizer under an entry the file lacks: refused too, not left fresh without a word.
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="has no 'opt' to restore"):
        load_sharded(str(tmp_path), {"model": other, "opt": other_opt})
    assert torch.equal(other.weight, before) and not other_opt.state
