"""Sharded-state scenarios, each run by test_sharded_local.py in a fresh process with its own
number of XLA CPU devices (torch_xla fixes the device count and SPMD mode per process).

    python sharded_worker.py SCENARIO OUT_DIR [ARGS...]   (writes OUT_DIR/<SCENARIO>.json)
"""

from __future__ import annotations

import json
import os
import sys

import torch

IN, HIDDEN, OUT, BATCH, STEPS, LR = 16, 32, 8, 16, 3, 0.01


def make_model(hidden: int = HIDDEN, depth: int = 1) -> torch.nn.Module:
    """IN -> hidden, ``depth`` hidden -> hidden layers, -> OUT (tanh between)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(IN, hidden), torch.nn.Tanh()]
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, OUT))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT]) + x[:, OUT:].cos()


def train(model, opt, steps, to_device=None, sync=None):
    for step in range(steps):
        x, y = batch(step)
        if to_device is not None:
            x, y = to_device((x, y))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if sync is not None:
            sync()


def reference(steps: int) -> dict[str, torch.Tensor]:
    """The same training on one (plain CPU) device."""
    model = make_model()
    train(model, torch.optim.Adam(model.parameters(), lr=LR), steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_keys(state: dict) -> dict:
    return {k.replace("_orig_module.", ""): v for k, v in state.items()}


def cpu_state(model, opt) -> dict:
    from ray_train_xla import to_cpu

    return {"model": to_cpu(plain_keys(model.state_dict())), "optimizer": to_cpu(opt.state_dict()["state"])}


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def exact(a, b) -> bool:
    """Bit-exact equality of nested tensors."""
    if isinstance(a, dict):
        return sorted(a) == sorted(b) and all(exact(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def start_spmd():
    import torch_xla.runtime as xr

    os.environ["RAY_TRAIN_XLA_SPMD"] = "1"
    if not xr.is_spmd():
        xr.use_spmd()
    return xr.global_runtime_device_count()


def sharded_setup(mesh_shape=None):
    import torch_xla

    import ray_train_xla as rtx

    mesh = rtx.get_sharded_mesh(mesh_shape)
    model = rtx.prepare_sharded_model(make_model(), mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def to_device(b):
        return rtx.shard_batch(b, mesh)

    return mesh, model, opt, to_device, torch_xla.sync


def errors(*calls) -> list[str]:
    """The message each call raises ("" when it does not raise)."""
    out = []
    for call in calls:
        try:
            call()
            out.append("")
        except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
            out.append(f"{type(e).__name__}: {e}")
    return out


def scenario_train(out_dir: str, save: str = "") -> dict:
    """FSDPv2 on all devices vs one device; the replicated helpers refuse it; optionally save."""
    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.seam import save_sharded

    devices = start_spmd()
    mesh, model, opt, to_device, sync = sharded_setup()
    refused = errors(lambda: rtx.prepare_model(model), lambda: rtx.optimizer_step(opt))
    train(model, opt, STEPS, to_device, sync)
    got = plain_keys({k: v.cpu() for k, v in model.state_dict().items()})
    record = {
        "devices": devices,
        "mesh": dict(mesh.shape()),
        "spec": rtx.sharding_spec(next(model.parameters())),
        "refused": refused,
        "max_diff": max_diff(got, reference(STEPS)),
        "diff_to_untrained": max_diff(got, reference(0)),
    }
    if save:
        record["saved"] = save_sharded({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "step": STEPS}, save)
        torch.save(cpu_state(model, opt), os.path.join(out_dir, "expected.pt"))
    return record


def scenario_load(out_dir: str, ckpt: str, *mesh_shape: str) -> dict:
    """Restore the checkpoint onto this process's devices and mesh; compare with what was saved."""
    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.seam import load_sharded

    devices = start_spmd()
    mesh, model, opt, to_device, sync = sharded_setup(tuple(int(d) for d in mesh_shape) or None)
    extra = load_sharded(ckpt, model, opt)
    expected = torch.load(os.path.join(out_dir, "expected.pt"), weights_only=False)
    got = cpu_state(model, opt)
    record = {
        "devices": devices,
        "mesh": dict(mesh.shape()),
        "spec": rtx.sharding_spec(next(model.parameters())),
        "extra": extra,
        "model_exact": exact(got["model"], expected["model"]),
        "optimizer_exact": exact(got["optimizer"], expected["optimizer"]),
    }
    return record


def scenario_refuse(out_dir: str) -> dict:
    """Without SPMD: torch_xla FSDP (v1) modules in every helper; DTensors that no FSDP2 model
    of this package holds in the replicated helpers; sharded state a checkpoint cannot name."""
    import torch.distributed as dist
    import torch_xla
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    import ray_train_xla as rtx

    fsdp = XlaFullyShardedDataParallel(make_model().to(torch_xla.device()))
    opt = torch.optim.Adam(fsdp.parameters(), lr=LR)
    x, y = batch(0)
    torch.nn.functional.mse_loss(fsdp(x.to(torch_xla.device())), y.to(torch_xla.device())).backward()
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=0, world_size=1)
    dtensor = distribute_tensor(torch.ones(4, 4), DeviceMesh("cpu", [0]), [Shard(0)])
    dmodel = torch.nn.Linear(4, 4)
    dmodel.weight = torch.nn.Parameter(distribute_tensor(dmodel.weight.detach(), DeviceMesh("cpu", [0]),
                                                         [Shard(0)]))
    fsdp_state = {"model": fsdp.state_dict(), "step": 1}
    return {
        "fsdp_v1": errors(
            lambda: rtx.prepare_model(fsdp),
            lambda: rtx.optimizer_step(opt),
            lambda: rtx.save_checkpoint(fsdp_state),
            lambda: rtx.load_checkpoint(fsdp, opt, checkpoint="unused"),
        ),
        "dtensor": errors(
            lambda: rtx.prepare_model(dmodel),
            lambda: rtx.optimizer_step(torch.optim.SGD(dmodel.parameters(), lr=LR)),
            # Optimizer state under positions only: it could not be put back on another mesh.
            lambda: rtx.save_checkpoint({"model": {"w": dtensor}, "optimizer": {
                "state": {0: {"exp_avg": dtensor}}, "param_groups": [{"lr": LR, "params": [0]}]}}),
            lambda: rtx.save_checkpoint({"model": {"w": dtensor, "b": fsdp_state["model"]}}),
        ),
        "fsdp_v1_keys": sorted(fsdp_state["model"])[:2],
    }


def scenario_train_load(out_dir: str, ckpt: str) -> dict:
    """Both in one process (one XLA start-up): train on all devices, then restore ``ckpt``."""
    return {"train": scenario_train(out_dir), "load": scenario_load(out_dir, ckpt)}


def scenario_mismatch(out_dir: str) -> dict:
    """Checkpoints of a hidden=64 model (sharded: FSDPv2 on this process's devices; replicated:
    checkpoint.pt) loaded into models of other shapes, dtypes and layers: the message each load
    raises ("" when it loads), and what the good loads restored."""
    import ray.train
    import torch_xla

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.seam import load_sharded, save_sharded
    from ray_train_xla.toolkit.checkpoint.writer import write_replicated
    from ray_train_xla.toolkit.device import to_cpu

    start_spmd()
    mesh = rtx.get_sharded_mesh()

    def sharded(hidden=64, depth=1, dtype=torch.float32, params=None):
        model = rtx.prepare_sharded_model(make_model(hidden, depth).to(dtype), mesh)
        # AdamW with weight decay: priming it (a zero-gradient step) would move the parameters.
        chosen = list(model.parameters())[:params] if params else model.parameters()
        return model, torch.optim.AdamW(chosen, lr=LR, weight_decay=0.1)

    def cpu(model):
        return plain_keys({k: v.cpu() for k, v in model.state_dict().items()})

    model, opt = sharded()
    train(model, opt, 1, lambda b: rtx.shard_batch(b, mesh), torch_xla.sync)
    ckpt = os.path.join(out_dir, "sharded64")
    save_sharded({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}, ckpt)
    saved = plain_keys({k: v.cpu() for k, v in model.state_dict().items()})
    targets = {"smaller": dict(hidden=32), "larger": dict(hidden=128),
               "bf16": dict(dtype=torch.bfloat16), "more_layers": dict(depth=2),
               "fewer_layers": dict(depth=0)}
    record: dict = {"sharded": {}, "replicated": {}}
    for name, kwargs in targets.items():
        m, o = sharded(**kwargs)
        before = cpu(m)
        record["sharded"][name] = errors(lambda m=m, o=o: load_sharded(ckpt, m, o))[0]
        record["sharded"][name + "/untouched"] = exact(cpu(m), before) and not o.state
        record["sharded"][name + "/model_only"] = errors(lambda m=m: load_sharded(ckpt, m))[0]
    m, o = sharded(params=2)  # the model fits, the optimizer holds 2 of its 6 parameters
    record["sharded"]["optimizer_subset"] = errors(lambda: load_sharded(ckpt, m, o))[0]
    m, o = sharded()
    record["sharded"]["same"] = errors(lambda: load_sharded(ckpt, m, o))[0]
    record["sharded_restored"] = exact(cpu(m), saved)

    device = torch_xla.device()
    plain = make_model(64).to(device)
    rdir = os.path.join(out_dir, "replicated64")
    os.makedirs(rdir)
    write_replicated(to_cpu({"model": plain.state_dict(), "step": 1}), rdir, "checkpoint.pt")
    checkpoint = ray.train.Checkpoint.from_directory(rdir)
    for name, kwargs in targets.items():
        target = make_model(kwargs.get("hidden", 64), kwargs.get("depth", 1)).to(
            kwargs.get("dtype", torch.float32)).to(device)
        before = {k: v.cpu() for k, v in target.state_dict().items()}
        record["replicated"][name] = errors(lambda t=target: rtx.load_checkpoint(
            t, checkpoint=checkpoint))[0]
        record["replicated"][name + "/untouched"] = exact(
            {k: v.cpu() for k, v in target.state_dict().items()}, before)
    target = make_model(64).to(device)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    record["replicated"]["same"] = errors(lambda: rtx.load_checkpoint(target, checkpoint=checkpoint))[0]
    record["replicated_restored"] = exact({k: v.cpu() for k, v in target.state_dict().items()},
                                          {k: v.cpu() for k, v in plain.state_dict().items()})
    return record


TP_EPS = 1e-4  # AdamW's eps: near 1e-8 it amplifies float rounding of tiny gradients
TP_CLIP = 0.5  # below the gradients' norm (about 0.63): clip_grad_norm_ clips each step


def local_shards(param) -> list[tuple[int, torch.Tensor]]:
    """(device, the part of ``param`` it holds) for every device, in device order."""
    import torch_xla

    shards = torch_xla._XLAC._get_local_shards([param])[0]
    return sorted((int(str(dev).rpartition(":")[2]), t.cpu()) for t, dev in shards)


def tp_train(model, opt, mesh, steps: int) -> tuple[list[float], list[str], list[float]]:
    """``steps`` steps of fsdp2_worker's batches: the losses, the batches' specs and the
    gradients' norms before clipping."""
    import fsdp2_worker as w
    import torch_xla

    import ray_train_xla as rtx

    losses, specs, norms = [], [], []
    for step in range(steps):
        ids = rtx.shard_batch(w.tokens(step), mesh)
        specs.append(rtx.sharding_spec(ids))
        opt.zero_grad()
        loss = w.loss_of(model, ids)
        loss.backward()
        norm = rtx.clip_grad_norm_(model, TP_CLIP)
        opt.step()
        torch_xla.sync()
        losses.append(float(loss))
        norms.append(float(norm))
    return losses, specs, norms


def scenario_tp(out_dir: str, ckpt: str) -> dict:
    """TP 2 x FSDPv2 2 on 4 devices (the layout planned as the config's ``parallelism``
    would be): fsdp2_worker's tiny Llama against plain torch with the whole batch; the specs of
    the parameters, gradients and optimizer state and what each device holds; a sharded
    checkpoint, restored into another TP 2 x FSDPv2 2 model (``parallelism={"tp": 2}``, per
    block); ``load_pretrained`` under the layout; HSDP x TP (mesh data 2 x fsdp 1 x model 2)
    against plain torch."""
    import fsdp2_worker as w

    import ray_train_xla as rtx
    from ray_train_xla.planning.contract import LAYOUT_VAR
    from ray_train_xla.toolkit.checkpoint.names import module_name
    from ray_train_xla.toolkit.checkpoint.seam import load_sharded, save_sharded

    devices = start_spmd()
    os.environ[LAYOUT_VAR] = "dp_replicate=1,dp_shard=2,tp=2"  # as TorchXLAConfig(parallelism=) plans
    model = rtx.prepare_sharded_model(w.make_lm())
    mesh = rtx.get_sharded_mesh()
    opt = w.optimizer(model, TP_EPS)
    losses, batch_specs, norms = tp_train(model, opt, mesh, STEPS)
    ref_losses: list = []
    ref = w.reference(STEPS, TP_EPS, ref_losses, TP_CLIP)
    params = {k.replace("_orig_module.", ""): p for k, p in model.named_parameters()}
    got = plain_keys({k: v.cpu() for k, v in model.state_dict().items()})
    exp_avg = {plain: opt.state[p]["exp_avg"] for plain, p in params.items()}
    record = {
        "devices": devices,
        "layout": rtx.get_layout().to_text(),
        "mesh": dict(mesh.shape()),
        "wrapper": type(model).__name__,
        "batch_specs": batch_specs,
        "losses": losses, "ref_losses": ref_losses, "norms": norms,
        "max_diff": max_diff(got, ref),
        "diff_to_untrained": max_diff(got, w.reference(0)),
        "specs": {k: rtx.sharding_spec(p) for k, p in params.items()},
        "grad_specs": {k: rtx.sharding_spec(p.grad) for k, p in params.items()},
        "exp_avg_specs": {k: rtx.sharding_spec(v) for k, v in exp_avg.items()},
        "shard_shapes": {k: [list(t.shape) for _, t in local_shards(p)] for k, p in params.items()},
    }
    # Which part of each weight each device d (fsdp d // 2, model d % 2) holds.
    q, o, emb = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.embed_tokens.weight")

    def holds(name, rows_by, cols_by):
        whole = got[name]
        r, c = whole.shape[0] // 2, whole.shape[1] // 2
        return all(torch.equal(t, whole[rows_by(d) * r:(rows_by(d) + 1) * r,
                                        cols_by(d) * c:(cols_by(d) + 1) * c])
                   for d, t in local_shards(params[name]))

    def by_model(d):
        return d % 2

    def by_fsdp(d):
        return d // 2

    record["holds"] = {"colwise rows by model, columns by fsdp": holds(q, by_model, by_fsdp),
                       "rowwise rows by fsdp, columns by model": holds(o, by_fsdp, by_model),
                       "embedding vocabulary by model": holds(emb, by_model, by_fsdp),
                       "control: colwise rows by fsdp": holds(q, by_fsdp, by_model)}
    state = model.state_dict()
    record["state_dict"] = {"whole_shapes": all(list(state[k].shape) == list(ref[plain].shape)
                                                for k, plain in zip(state, plain_keys(state))),
                            "q_spec": rtx.sharding_spec(state["_orig_module." + q])}
    record["ckpt"] = ckpt
    record["saved"] = save_sharded({"model": state, "optimizer": opt.state_dict(), "step": STEPS},
                                   ckpt)
    torch.save(cpu_state(model, opt), os.path.join(out_dir, "expected.pt"))
    # The layout asked for again in the call; each block sharded on its own this time.
    again = rtx.prepare_sharded_model(w.make_lm(), parallelism={"tp": 2},
                                      auto_wrap_policy={w.block_class()})
    again_opt = w.optimizer(again, TP_EPS)
    record["blocks_specs"] = {module_name(k): rtx.sharding_spec(p) for k, p in again.named_parameters()}
    record["restored_extra"] = load_sharded(ckpt, again, again_opt)
    expected, restored = cpu_state(model, opt), cpu_state(again, again_opt)
    record["restored_exact"] = (exact(restored["model"], expected["model"])
                                and exact(restored["optimizer"], expected["optimizer"]))
    record["refused"] = errors(
        lambda: rtx.prepare_sharded_model(w.make_lm(), rtx.get_sharded_mesh((4, 1))),
        lambda: rtx.configure_parallelism({"tp": 4}),
        lambda: rtx.prepare_sharded_model(w.make_lm(), sequence_parallel=True))
    # A Hugging Face directory read on the host, then split by the layout.
    w.make_lm().save_pretrained(os.path.join(out_dir, "hf"))
    with torch.device("meta"):
        meta = type(w.make_lm())(w.lm_config())
    loaded = rtx.load_pretrained(meta, os.path.join(out_dir, "hf"))
    record["pretrained"] = {
        "specs": {module_name(k): rtx.sharding_spec(p) for k, p in loaded.named_parameters()},
        "exact": exact(plain_keys({k: v.cpu() for k, v in loaded.state_dict().items()}),
                       w.reference(0))}
    # Replicas x TP: parameters whole along "data", the batch split over it.
    hsdp_mesh = rtx.get_sharded_mesh((2, 1, 2))
    hsdp = rtx.prepare_sharded_model(w.make_lm(), hsdp_mesh)
    hsdp_opt = w.optimizer(hsdp, TP_EPS)
    hsdp_losses, hsdp_batch, _ = tp_train(hsdp, hsdp_opt, hsdp_mesh, STEPS)
    hsdp_params = {k.replace("_orig_module.", ""): p for k, p in hsdp.named_parameters()}
    record["hsdp"] = {
        "mesh": dict(hsdp_mesh.shape()), "losses": hsdp_losses, "batch_specs": hsdp_batch,
        "max_diff": max_diff(plain_keys({k: v.cpu() for k, v in hsdp.state_dict().items()}), ref),
        "specs": {k: rtx.sharding_spec(hsdp_params[k]) for k in (q, o, emb, "model.norm.weight")}}
    return record


def scenario_tp_load(out_dir: str, ckpt: str) -> dict:
    """scenario_tp's TP 2 x FSDPv2 2 checkpoint restored onto FSDPv2 over 4 devices (no TP)."""
    import fsdp2_worker as w

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.seam import load_sharded

    start_spmd()
    model = rtx.prepare_sharded_model(w.make_lm())
    opt = w.optimizer(model, TP_EPS)
    extra = load_sharded(ckpt, model, opt)
    expected = torch.load(os.path.join(out_dir, "expected.pt"), weights_only=False)
    got = cpu_state(model, opt)
    return {"layout": rtx.get_layout().to_text(), "extra": extra,
            "spec": rtx.sharding_spec(next(model.parameters())),
            "model_exact": exact(got["model"], expected["model"]),
            "optimizer_exact": exact(got["optimizer"], expected["optimizer"])}


SCENARIOS = {"mismatch": scenario_mismatch, "train": scenario_train,
             "load": scenario_load, "refuse": scenario_refuse,
             "train_load": scenario_train_load, "tp": scenario_tp, "tp_load": scenario_tp_load}

if __name__ == "__main__":
    name, out = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](out, *sys.argv[3:])
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f)
