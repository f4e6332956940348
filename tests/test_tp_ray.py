"""Tensor parallelism with FSDP2 through real Ray Train, on TorchNeuronConfig's CPU twin over two
nodes (``two_nodes``: 2 workers on each, placed by their fake NeuronCores): the layout planned
from the config's ``parallelism``, each rank's mesh coordinates, the rows each rank trains on
(``prepare_data_loader`` and Ray Data), a tiny Hugging Face Llama trained TP 2 x FSDP 2 against
torch's unsharded run, and its checkpoint resharded into other layouts.

Two fits: ``tp2`` trains, keeps its state in the memory tier and fails; restarted, it trains
again, restores the first attempt's state from memory into a second model, and saves it (the
model, the optimizer and an LR scheduler as entries of their own) through the writer process;
``reshard`` loads that checkpoint into FSDP 4, TP 4 and HSDP 2 x TP 2 meshes on the same 4
workers and compares every tensor, bit for bit, by name.
``consolidate --hf`` exports the checkpoint, which ``from_pretrained`` loads with the trained
model's logits. (Fewer workers of another layout: ``test_checkpoint_state_local.py``.)
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import connected, fit, neuron_scaling, write_record

pytestmark = [pytest.mark.ray, pytest.mark.native, pytest.mark.timeout(900)]

STEPS, EPS, ROWS = 3, 1e-4, 24


@pytest.fixture(scope="module")
def two_nodes(two_nodes):
    with connected(two_nodes):
        yield two_nodes


def _config(**kw):
    from ray_train_xla import TorchNeuronConfig

    return TorchNeuronConfig(device="cpu", timeout_s=120, **kw)


def _optimizer(model):
    # Adam divides by sqrt(v) + eps: with the default 1e-8 a gradient near 0 turns the last
    # bits of float rounding (TP sums partial products in another order) into 1e-5 of a step.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=EPS)


def _reference():
    """torch's unsharded run: one process, the whole batch each step."""
    import fsdp2_worker as w

    model = w.make_lm()
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = w.loss_of(model, w.tokens(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_tp(config):
    """TP 2 x FSDP 2: the layout, the rows, training against the reference, a checkpoint."""
    import fsdp2_worker as w
    import ray
    import ray.train
    from torch.utils.data import DataLoader, TensorDataset

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.parallel import device_mesh

    layout = rtx.get_layout()
    record = {"rank": rtx.rank(), "layout": layout.to_text(),
              "coords": layout.coordinates(rtx.rank()),
              "mesh_coords": device_mesh().get_coordinate(), "dp": list(rtx.data_parallel()),
              "node": ray.get_runtime_context().get_node_id()}  # the IP is every node's here
    # prepare_data_loader: this rank's rows, by data-parallel rank (two epochs' first batches).
    loader = rtx.prepare_data_loader(
        DataLoader(TensorDataset(torch.arange(ROWS)), batch_size=3, shuffle=True), to_device=False)
    record["loader"] = [[int(x) for x in batch[0]] for batch in loader]
    # Ray Data: every batch of the epoch, shared with the tensor-parallel peers.
    shard = ray.train.get_dataset_shard("rows")
    record["ray_data"] = [[int(x) for x in b["id"]] for b in
                          rtx.iter_xla_batches(shard, batch_size=2, to_device=False)]
    model = rtx.prepare_sharded_model(w.make_lm(), auto_wrap_policy={w.block_class()})
    # The model FLOPs the timeline counts for one device, a step of 3 sequences of 16 tokens.
    from ray_train_xla.toolkit.runtime import runtime

    record["flops"] = list(runtime().model_flops.per_step(3 * 16, 3 * 16 * 16, 3, 1))
    opt = _optimizer(model)
    dp_rank, dp = rtx.data_parallel()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = w.loss_of(model, w.rows(step, dp_rank, dp))
        loss.backward()
        rtx.clip_grad_norm_(model, 1.0)
        rtx.optimizer_step(opt)
        losses.append(float(rtx.all_reduce(loss.detach(), "mean", dim="dp")))  # over dp ranks
    record["tp_sum"] = float(rtx.all_reduce(torch.tensor(float(rtx.rank())), dim="tp"))
    ref_losses, ref = _reference()
    # An LR scheduler, stepped once after training (the reference has none): saved with the rest.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    state = w.named_state(model, opt)
    record["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    record["diff"] = w.max_diff(state["model"], ref)
    record["moved"] = w.max_diff(state["model"], w.make_lm().state_dict())
    record["placements"] = {n: str(p.placements) for n, p in model.named_parameters()
                            if n.endswith(("q_proj.weight", "o_proj.weight", "input_layernorm.weight"))}
    entries = {"model": model, "optimizer": opt, "scheduler": sched}
    # The memory tier across a failure: the first attempt keeps its state in host memory (rank
    # by rank, in place) and fails; Ray Train restarts the group, whose second attempt trains
    # the same steps again and restores the first one's state from memory (no checkpoint was
    # reported: memory first) into a model and optimizer of the same layout.
    from ray_train_xla.toolkit.checkpoint.memory import memory_tier

    failed = config["dump"] + ".failed"
    if not os.path.exists(failed):
        assert rtx.keep_in_memory({**entries, "step": STEPS}, STEPS) is True
        memory_tier().wait()
        write_record(config, f"kept{rtx.rank()}", {"kept": rtx.rank(),
                                                   "by_rank": memory_tier().by_rank})
        rtx.rendezvous("kept")
        if rtx.rank() == 0:
            open(failed, "w").close()
        raise RuntimeError("injected failure after the memory tier kept the last step")
    fresh = rtx.prepare_sharded_model(w.make_lm(), auto_wrap_policy={w.block_class()})
    fresh_opt = _optimizer(fresh)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    rest = rtx.load_checkpoint({"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched})
    record["memory"] = {"restored": memory_tier().restored is not None, "rest": rest,
                        "exact": w.exact(w.named_state(fresh, fresh_opt), state),
                        "scheduler": fresh_sched.state_dict() == sched.state_dict()}
    written = rtx.save_checkpoint({**entries, "step": STEPS}, {"step": STEPS}, wait=True)
    from ray_train_xla.toolkit.checkpoint.writer import writer_process_pid

    # written by torch's writer process (a process of its own), this rank's shards only
    record["writer_process"] = writer_process_pid() not in (None, os.getpid())
    record["written"] = sorted(written["files"])
    if rtx.rank() == 0:
        torch.save({**state, "scheduler": sched.state_dict()}, config["dump"])
    write_record(config, f"rank{rtx.rank()}", record)


def reshard(config):
    """The TP 2 x FSDP 2 checkpoint into other layouts on the same workers, by name."""
    import fsdp2_worker as w
    from torch.distributed.device_mesh import init_device_mesh

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.tensor_parallel import parallelize

    saved = torch.load(config["dump"], weights_only=False)
    scheduler = saved.pop("scheduler")
    record = {}
    for name, shape in (("fsdp4", (1, 4, 1)), ("tp4", (1, 1, 4)), ("hsdp2_tp2", (2, 1, 2))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = parallelize(w.make_lm(hidden=32), mesh, auto_wrap_policy={w.block_class()})
        opt = _optimizer(model)
        if name == "tp4":  # its entries: the scheduler given its state too
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            extra = rtx.load_checkpoint({"model": model, "optimizer": opt, "scheduler": sched},
                                        checkpoint=config["checkpoint"])
            record["scheduler"] = sched.state_dict() == scheduler
        else:
            extra = rtx.load_checkpoint(model, opt, checkpoint=config["checkpoint"])
        record[name] = {"exact": w.exact(w.named_state(model, opt), saved),
                        "step": extra.get("step")}
    write_record(config, f"rank{rtx.rank()}", record)


@pytest.fixture(scope="module")
def runs(two_nodes, tmp_path_factory):
    import ray
    import ray.train

    tmp = tmp_path_factory.mktemp("tp")
    dump = str(tmp / "tp2.pt")
    result, records = fit(train_tp, torch_config=_config(parallelism={"tp": 2}, memory_every=1),
                          scaling_config=neuron_scaling(4), loop_config={"dump": dump},
                          datasets={"rows": ray.data.range(ROWS)},
                          run_config=ray.train.RunConfig(
                              storage_path=str(tmp / "results"),
                              failure_config=ray.train.FailureConfig(max_failures=1)))
    kept = [r for r in records if "kept" in r]  # the first attempt's, before it failed
    tp2 = [r for r in records if "kept" not in r]
    _, moved = fit(reshard, torch_config=_config(), scaling_config=neuron_scaling(4),
                   loop_config={"dump": dump, "checkpoint": ray.train.Checkpoint(result.checkpoint.path)})
    return {"tp2": sorted(tp2, key=lambda r: r["coords"]["tp"] + 2 * r["coords"]["dp_shard"]),
            "reshard": moved, "checkpoint": result.checkpoint.path, "dump": dump, "kept": kept}


def test_the_layout_is_planned_and_the_mesh_follows_it(runs):
    ranks = runs["tp2"]
    assert {r["layout"] for r in ranks} == {"dp_replicate=1,dp_shard=2,tp=2"}
    for r in ranks:  # the mesh torch made puts each rank where the planned layout says
        assert r["mesh_coords"] == [r["coords"]["dp_replicate"], r["coords"]["dp_shard"],
                                    r["coords"]["tp"]], r
        assert r["dp"] == [r["coords"]["dp_shard"], 2]
    # Each tensor-parallel group sits on one node; FSDP spans the nodes.
    for dp in (0, 1):
        assert len({r["node"] for r in ranks if r["coords"]["dp_shard"] == dp}) == 1
    assert len({r["node"] for r in ranks}) == 2


def test_tensor_parallel_peers_train_on_the_same_rows(runs):
    """prepare_data_loader and Ray Data give both ranks of a tensor-parallel group the same
    rows, and the data-parallel groups disjoint rows that cover the data once."""
    ranks = runs["tp2"]
    for key in ("loader", "ray_data"):
        groups = [[r[key] for r in ranks if r["coords"]["dp_shard"] == dp] for dp in (0, 1)]
        for peers in groups:
            assert peers[0] == peers[1], (key, peers)
        rows = [x for peers in groups for batch in peers[0] for x in batch]
        assert sorted(rows) == list(range(ROWS)), (key, rows)


def test_a_tensor_parallel_devices_model_flops_are_its_share_of_its_batch(runs):
    """The model prepare_sharded_model split over TP 2 x FSDP 2 is counted whole, by its
    config; each device computes half of it on its group's batch."""
    import fsdp2_worker as w

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.observability.flops import HF_DECODER

    per_token = rtx.model_flops_per_token(w.lm_config(32), 16)
    for r in runs["tp2"]:
        assert r["flops"] == [per_token * 3 * 16 / 2, HF_DECODER], r["flops"]


def test_tp2_fsdp2_trains_as_torchs_unsharded_run(runs):
    for r in runs["tp2"]:
        # all_reduce(dim="tp") sums over the worker's tensor-parallel peers only: ranks 0+1, 2+3.
        assert r["tp_sum"] == {0: 1.0, 1: 5.0}[r["coords"]["dp_shard"]], r
        assert r["loss_diff"] < 1e-5, r["loss_diff"]
        assert r["diff"] < 1e-5 < r["moved"], (r["diff"], r["moved"])
        placements = r["placements"]
        # q_proj column-wise and o_proj row-wise over tp, the norm on FSDP alone.
        assert any("Shard(dim=1)" in v for k, v in placements.items() if "o_proj" in k), placements
        assert all("Shard(dim=0)" in v for v in placements.values()), placements


def test_the_checkpoint_reshards_into_other_layouts_bit_for_bit(runs):
    for r in runs["reshard"]:
        for name in ("fsdp4", "tp4", "hsdp2_tp2"):
            assert r[name] == {"exact": True, "step": STEPS}, (name, r[name])
        assert r["scheduler"] is True


def test_the_writer_process_and_the_memory_tier_keep_the_tp_state_bit_for_bit(runs):
    for r in runs["tp2"]:
        # the storage checkpoint: this rank's shards (its own data file), by the writer process
        assert r["writer_process"] is True and f"__{r['rank']}_0.distcp" in r["written"], r
        # memory: kept rank by rank in place by the attempt that failed, restored from memory
        # after the restart into the same layout, bit for bit
        m = r["memory"]
        assert m["restored"] is True, m
        assert m["exact"] is True and m["scheduler"] is True and m["rest"] == {"step": STEPS}, m
    assert sorted(k["kept"] for k in runs["kept"]) == [0, 1, 2, 3]
    assert all(k["by_rank"] == 1 for k in runs["kept"]), runs["kept"]


def test_consolidate_hf_of_a_tp_checkpoint_loads_with_the_trained_models_logits(runs, tmp_path):
    import fsdp2_worker as w

    w.assert_consolidated_hf(runs['checkpoint'], runs['dump'], tmp_path)
