"""Sharded models on every config through real Ray Train (one node): a tiny Hugging Face Llama
trained with torch_xla FSDPv2 (one SPMD worker, 4 virtual devices) and with FSDP2 on the native
configs' CPU twins (4 and 3 workers), its checkpoints moved between world sizes, layouts and
the replicated/sharded seam. Every training result is compared with torch's own unsharded run
of the same model and data; every restored state with the state saved, bit for bit, by name.

Three fits, each using the checkpoints of the ones before:

- four: FSDP2 on 4 workers trains (with and without per-block sharding, with activation
  checkpointing, in bf16) and saves (``ckpt4``);
- xla: FSDPv2 trains and saves (``ckpt_xla``); loads ``ckpt4``, written by FSDP2; and, first,
  a replicated MLP under SPMD on the same 4 devices (``test_ray_spmd_tpu.spmd_train``);
- three: 3 workers (TorchTPUConfig's twin): a mismatched model refused and untouched; ``ckpt4``
  restored onto uneven shards and trained on like the fixed run; ``ckpt_xla`` restored and
  saved again; ``ckpt4`` into a replicated model; a replicated checkpoint into FSDP2; a
  format-1 FSDPv2 checkpoint.

Where torch_xla is not installed (`make test-native`, torch 2.13), the xla fit and what reads
it are left out: the tests marked ``native`` read only the fits on the native configs. The
four-worker fit's storage is a filesystem whose handler class only Ray's cloudpickle carries (as
a driver script's would be): its replicated and sharded saves go through the writer processes,
and the next fits load them back.

(The elastic test reshards FSDP2 checkpoints 4 -> 2 -> 4 workers.)
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import HAS_TORCH_XLA, connected, fit, write_record

# The module fixture runs three fits: its time counts against the first test.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200)]

STEPS, MORE = 3, 2


@pytest.fixture(scope="module")
def one_node(one_node):
    with connected(one_node):
        yield one_node


def xla_config():
    from ray_train_xla import TorchXLAConfig

    return TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=4, timeout_s=120)


def xla_scaling():
    from ray.train import ScalingConfig

    return ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1})


def native_scaling(workers: int):
    from ray.train import ScalingConfig

    return ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})


def _errors(call) -> str:
    try:
        call()
        return ""
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        return f"{type(e).__name__}: {e}"


def _sharded_lm(policy: bool = True, hidden: int = 32, **options):
    import fsdp2_worker as w

    import ray_train_xla as rtx

    model = rtx.prepare_sharded_model(w.make_lm(hidden),
                                      auto_wrap_policy={w.block_class()} if policy else None,
                                      **options)
    return model, w.optimizer(model)


def _train(model, opt, start: int, steps: int, config) -> None:
    import fsdp2_worker as w

    import ray_train_xla as rtx

    spmd = config.get("spmd", False)
    for step in range(start, start + steps):
        opt.zero_grad()
        if spmd:
            ids = rtx.shard_batch(w.tokens(step), rtx.get_sharded_mesh())
        else:
            ids = w.rows(step, rtx.rank(), rtx.world_size())
        w.loss_of(model, ids).backward()
        rtx.clip_grad_norm_(model, 1.0)
        if spmd:
            opt.step()
            rtx.sync()
        else:
            rtx.optimizer_step(opt)


def _load(path, model, opt=None):
    import ray.train

    import ray_train_xla as rtx

    return rtx.load_checkpoint(model, opt, checkpoint=ray.train.Checkpoint(path))


def train_and_save(config):
    """Train STEPS steps (FSDPv2 or FSDP2 by the config), save, dump the whole state; on
    native workers also the same without per-block sharding, and a load of ``load``."""
    import fsdp2_worker as w

    import ray_train_xla as rtx

    record = {}
    if config.get("mlp"):  # first, on a fresh device: test_ray_spmd_tpu's SPMD MLP
        import test_ray_spmd_tpu

        test_ray_spmd_tpu.spmd_train(config, record="mlp")
    model, opt = _sharded_lm()
    _train(model, opt, 0, STEPS, config)
    ref = w.reference(STEPS)
    state = w.named_state(model, opt)
    record["diff"] = w.max_diff(state["model"], ref)
    record["moved"] = w.max_diff(state["model"], w.make_lm().state_dict())
    if not config.get("spmd"):
        plain, plain_opt = _sharded_lm(policy=False)
        _train(plain, plain_opt, 0, STEPS, config)
        record["diff_unwrapped"] = w.max_diff(w.named_state(plain)["model"], ref)
        record["placements"] = str(next(model.parameters()).placements)
        # Activation checkpointing recomputes each block: the same numbers.
        recomputed, recomputed_opt = _sharded_lm(activation_checkpointing=True)
        _train(recomputed, recomputed_opt, 0, STEPS, config)
        record["diff_recomputed"] = w.max_diff(w.named_state(recomputed)["model"], ref)
        # bf16 compute, fp32 parameters and gradient reduction: close to the fp32 run, not equal.
        half, half_opt = _sharded_lm(mixed_precision="bf16")
        _train(half, half_opt, 0, STEPS, config)
        half_state = w.named_state(half)["model"]
        record["bf16_dtypes"] = sorted({str(v.dtype) for v in half_state.values()})
        record["bf16_off"] = w.mean_diff(half_state, ref)  # from the fp32 run
        record["fp32_moved"] = w.mean_diff(ref, w.make_lm().state_dict())  # from the start
    if rtx.rank() == 0:
        torch.save(state, config["dump"])
    if config.get("load"):
        fresh, fresh_opt = _sharded_lm()
        extra = _load(config["load"], fresh, fresh_opt)
        record["load_exact"] = w.exact(w.named_state(fresh, fresh_opt),
                                       torch.load(config["load_dump"], weights_only=False))
        record["load_extra"] = extra
    if not config.get("spmd"):
        # Written once: what this process writes during a save (wchar counts every write call,
        # Ray's upload of a temporary directory included) is the checkpoint's bytes, once. A
        # replicated save (rank 0 writes) first, then the sharded one, which the run keeps last.
        blob = {"blob": torch.arange(2_000_000, dtype=torch.float32)}
        from ray_train_xla.toolkit.checkpoint.writer import save_process

        if rtx.rank() == 0:  # rank 0's save process, started (saves before it is are written
            assert save_process().wait_ready(60)  # in the reporter's thread)
        before = _wchar()
        written = rtx.save_checkpoint(blob, {"step": 0}, wait=True)
        record["replicated_write"] = [_wchar() - before, written and written["bytes"]]
        before = _wchar()
        written = rtx.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                       "step": STEPS}, {"step": STEPS}, wait=True)
        record["sharded_write"] = [_wchar() - before, written["bytes"]]
        from ray_train_xla.toolkit.checkpoint.writer import writer_process_pid

        record["writer_process"] = writer_process_pid() not in (None, os.getpid())
        if rtx.rank() == 0:  # rank 0's replicated file was written by its save process
            record["replicated_writer"] = save_process().process.pid != os.getpid()
    else:
        rtx.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "step": STEPS}, {"step": STEPS})
    import sys

    # The plan's USE_TORCH_XLA=0 kept transformers off torch_xla on the native workers.
    record["torch_xla_loaded"] = "torch_xla" in sys.modules
    write_record(config, f"rank{rtx.rank()}", record)


def _wchar() -> int:
    """Bytes this process and its checkpoint writer processes (those it has) have passed to
    write calls (``/proc/<pid>/io``)."""
    from ray_train_xla.toolkit.checkpoint.writer import writer_process_pids

    total = 0
    for pid in ("self", *writer_process_pids()):
        with open(f"/proc/{pid}/io") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("wchar"))
    return total


def restore(config):
    """Restore checkpoints onto this world size and layout and compare, by name, with what was
    saved (see the module docstring for what each fit checks)."""
    import fsdp2_worker as w

    import ray_train_xla as rtx

    record = {}
    saved4 = torch.load(config["dump4"], weights_only=False) if config.get("dump4") else None
    saved_xla = torch.load(config["dump_xla"], weights_only=False) if config.get("dump_xla") else None
    if config.get("mismatch"):
        model, opt = _sharded_lm(hidden=64)
        before = w.named_state(model)
        record["mismatch"] = _errors(lambda: _load(config["ckpt4"], model, opt))
        record["mismatch_untouched"] = w.exact(w.named_state(model), before) and not opt.state
    if config.get("ckpt4"):
        model, opt = _sharded_lm()
        record["extra4"] = _load(config["ckpt4"], model, opt)
        record["exact4"] = w.exact(w.named_state(model, opt), saved4)
        if config.get("train_on"):
            _train(model, opt, STEPS, MORE, config)
            record["diff_on"] = w.max_diff(w.named_state(model)["model"], w.reference(STEPS + MORE))
    if config.get("ckpt_xla"):
        model, opt = _sharded_lm()
        _load(config["ckpt_xla"], model, opt)
        record["exact_xla"] = w.exact(w.named_state(model, opt), saved_xla)
        if config.get("save_back"):
            rtx.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                 "step": STEPS}, {"step": STEPS})
    if config.get("replicated_target"):
        plain = w.make_lm()
        plain_opt = w.optimizer(plain)
        _load(config["ckpt4"], plain, plain_opt)
        got = w.named_state(plain, plain_opt)
        record["sharded_into_replicated"] = w.exact(got, saved4)
    if config.get("replicated_ckpt"):
        model, opt = _sharded_lm()
        _load(config["replicated_ckpt"], model, opt)
        record["replicated_into_sharded"] = w.exact(w.named_state(model, opt), saved4)
    if config.get("v1_ckpt"):
        model, opt = _sharded_lm()
        record["extra_v1"] = _load(config["v1_ckpt"], model, opt)
        record["exact_v1"] = w.exact(w.named_state(model, opt), saved_xla)
    write_record(config, f"rank{rtx.rank()}", record)


def write_replicated(dump: dict, directory: str) -> None:
    """A replicated checkpoint (``checkpoint.pt``, what save_checkpoint writes for a replicated
    model) of the dumped state: the optimizer under positions, as a plain optimizer numbers it."""
    import fsdp2_worker as w

    model = w.make_lm()
    names = [n for n, _ in model.named_parameters()]
    osd = w.optimizer(model).state_dict()
    osd["state"] = {i: dump["optimizer"][n] for i, n in enumerate(names)}
    os.makedirs(directory)
    torch.save({"model": dump["model"], "optimizer": osd, "step": STEPS},
               os.path.join(directory, "checkpoint.pt"))


def write_format1(dump: dict, directory: str) -> None:
    """A sharded checkpoint as torch_xla FSDPv2 runs wrote it before names (format 1): model
    keys with ``_orig_module.``, the optimizer state under positions, no format version."""
    import json

    import fsdp2_worker as w
    import torch.distributed.checkpoint as dcp

    model = w.make_lm()
    names = [n for n, _ in model.named_parameters()]
    osd = w.optimizer(model).state_dict()
    state = {"model": {f"_orig_module.{k}": v for k, v in dump["model"].items()},
             "optimizer": {"state": {i: dump["optimizer"][n] for i, n in enumerate(names)},
                           "param_groups": osd["param_groups"]}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    torch.save({"step": STEPS}, os.path.join(directory, "extra.pt"))
    with open(os.path.join(directory, "sharded.json"), "w") as f:
        json.dump({"format": "torch.distributed.checkpoint", "planner": "torch_xla SPMDSavePlanner",
                   "workers": 1, "devices": 4, "keys": ["model", "optimizer"]}, f)


@pytest.fixture(scope="module")
def runs(one_node, tmp_path_factory):
    """The three fits, in order (each needs the checkpoints of the ones before); the xla fit
    only where torch_xla is installed."""
    from counting_fs import driver_script_filesystem
    from ray.train import RunConfig

    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig

    tmp = tmp_path_factory.mktemp("fsdp2")
    out: dict = {}
    storage = driver_script_filesystem(str(tmp / "storage.log"))
    result, out["four"] = fit(
        train_and_save, loop_config={"dump": str(tmp / "four.pt")},
        torch_config=TorchNeuronConfig(device="cpu", timeout_s=120), scaling_config=native_scaling(4),
        run_config=RunConfig(storage_path=str(tmp / "results"), storage_filesystem=storage))
    ckpt4 = result.checkpoint.path
    from ray_train_xla.toolkit.observability.goodput import goodput_of, own_times

    out["four_own"] = own_times(goodput_of(os.path.dirname(ckpt4)).attempts[-1].workers)
    out["four_files"] = sorted(os.listdir(ckpt4))
    out["four_run"] = sorted(os.listdir(os.path.dirname(ckpt4)))
    from counting_fs import checkpoint_writes

    out["four_writes"] = [os.path.basename(p) for p in checkpoint_writes(str(tmp / "storage.log"))]
    dump4 = torch.load(tmp / "four.pt", weights_only=False)
    write_replicated(dump4, str(tmp / "replicated"))
    xla_restores = {}
    if HAS_TORCH_XLA:
        result, records = fit(
            train_and_save,
            loop_config={"spmd": True, "mlp": True, "dump": str(tmp / "xla.pt"), "load": ckpt4,
                         "load_dump": str(tmp / "four.pt")},
            torch_config=xla_config(), scaling_config=xla_scaling())
        out["mlp"] = [r for r in records if "losses" in r]
        out["xla"] = [r for r in records if "losses" not in r]
        out["xla_files"] = sorted(os.listdir(result.checkpoint.path))
        write_format1(torch.load(tmp / "xla.pt", weights_only=False), str(tmp / "format1"))
        xla_restores = {"dump_xla": str(tmp / "xla.pt"), "ckpt_xla": result.checkpoint.path,
                        "v1_ckpt": str(tmp / "format1"), "save_back": True}
    result, out["three"] = fit(
        restore, loop_config={"dump4": str(tmp / "four.pt"), "ckpt4": ckpt4, "mismatch": True,
                              "train_on": True, "replicated_target": True,
                              "replicated_ckpt": str(tmp / "replicated"), **xla_restores},
        torch_config=TorchTPUConfig(device="cpu", timeout_s=120), scaling_config=native_scaling(3))
    if HAS_TORCH_XLA:  # ckpt_xla saved back by FSDP2 on 3 workers
        out["back_marker"] = open(os.path.join(result.checkpoint.path, "sharded.json")).read()
    out["ckpt4"], out["dump4"] = ckpt4, str(tmp / "four.pt")
    return out


def test_fsdpv2_trains_like_the_unsharded_run(runs):
    (xla,) = runs["xla"]
    # XLA compiles the step: its fp32 arithmetic differs from eager torch's in the last bits
    # (2e-5 here after 3 AdamW steps at lr 1e-2; FSDP2 runs torch's own kernels, within 1e-5).
    assert xla["moved"] > 1e-3 and xla["diff"] <= 1e-4


@pytest.mark.native
def test_fsdp2_trains_like_the_unsharded_run(runs):
    assert len(runs["four"]) == 4
    for rec in runs["four"]:
        assert rec["torch_xla_loaded"] is False
        assert rec["moved"] > 1e-3
        assert rec["diff"] <= 1e-5 and rec["diff_unwrapped"] <= 1e-5
        assert rec["placements"] == "(Shard(dim=0),)"
        assert rec["diff_recomputed"] <= 1e-5
        assert rec["bf16_dtypes"] == ["torch.float32"]  # parameters stay fp32
        # Computed in bf16: off the fp32 run, but by far less than training moved it.
        assert 0 < rec["bf16_off"] < 0.25 * rec["fp32_moved"], (rec["bf16_off"], rec["fp32_moved"])
    # Every rank's own time a step (stragglers) ends at the forward's first all-gather, where
    # the model's pre-forward hook stamps it: a small part of the step, not its backward too.
    own = runs["four_own"]
    assert sorted(own) == [0, 1, 2, 3], own
    assert all(own_s < 0.5 * step_s for own_s, step_s, _ in own.values()), own


@pytest.mark.native
def test_fsdp2_checkpoints_hold_every_ranks_shards(runs):
    assert {f"__{r}_0.distcp" for r in range(4)} <= set(runs["four_files"])


def test_sharded_checkpoints_hold_every_ranks_shards_under_module_names(runs):
    assert {".metadata", "__0_0.distcp", "extra.pt", "param_groups.pt", "sharded.json"} <= set(
        runs["xla_files"])
    import json

    marker = json.loads(runs["back_marker"])
    assert marker["layout"] == "dtensor" and marker["format_version"] == 3 and marker["workers"] == 3
    assert marker["models"] == ["model"] and marker["optimizers"] == ["optimizer"]


@pytest.mark.native
def test_each_checkpoint_is_written_once_in_the_runs_storage(runs):
    """Replicated and sharded saves write their bytes once, straight into the run's storage:
    no temporary directory that Ray copies again (which wrote twice the bytes). The storage is
    a filesystem of the driver script's (see the module docstring): the writer processes got it
    as Ray's workers did."""
    slack = 256 * 1024  # the worker's log lines in the same window
    rank0 = next(r for r in runs["four"] if r["replicated_write"][1])
    wrote, size = rank0["replicated_write"]
    assert size >= 8_000_000 and wrote <= 1.05 * size + slack, (wrote, size)
    assert rank0["replicated_writer"] is True  # written by rank 0's save process
    # through the storage's filesystem (its handler class a driver script's), by the writers
    writes = runs["four_writes"]
    assert "checkpoint.pt" in writes and {f"__{r}_0.distcp" for r in range(4)} <= set(writes), writes
    for rec in runs["four"]:
        wrote, size = rec["sharded_write"]
        assert 0 < size and wrote <= 1.05 * size + slack, rec["sharded_write"]
        assert rec["writer_process"] is True  # the shards were written by the writer process
    # Each checkpoint in its own directory of the run, named as Ray names its own.
    dirs = [d for d in runs["four_run"] if d.startswith("checkpoint_") and not d.endswith(".json")]
    assert len(dirs) == 2 and os.path.basename(runs["ckpt4"]) == dirs[-1], runs["four_run"]


@pytest.mark.native
def test_resharded_onto_3_workers_bit_equal_and_training_goes_on_like_the_fixed_run(runs):
    assert len(runs["three"]) == 3
    for rec in runs["three"]:  # 4 shards onto 3: uneven
        assert rec["exact4"] is True and rec["extra4"] == {"step": STEPS}
        assert rec["diff_on"] <= 1e-5


@pytest.mark.native
def test_a_mismatched_model_is_refused_and_left_untouched(runs):
    for rec in runs["three"]:
        assert rec["mismatch"].startswith("CheckpointMismatchError: load_checkpoint: the sharded "
                                          "checkpoint"), rec["mismatch"]
        assert "model.model.embed_tokens.weight: saved [64, 32] float32, into [64, 64]" in rec["mismatch"]
        assert rec["mismatch_untouched"] is True


def test_checkpoints_move_between_torch_xla_fsdpv2_and_fsdp2_both_ways(runs):
    (xla,) = runs["xla"]
    assert xla["load_exact"] is True  # FSDP2 (4 workers) -> FSDPv2 (4 devices)
    assert all(rec["exact_xla"] for rec in runs["three"])  # FSDPv2 -> FSDP2 on 3 workers
    for rec in runs["three"]:  # a format-1 FSDPv2 checkpoint (prefixed keys, positions)
        assert rec["exact_v1"] is True and rec["extra_v1"] == {"step": STEPS}


@pytest.mark.native
def test_checkpoints_cross_the_replicated_sharded_seam_both_ways(runs):
    for rec in runs["three"]:
        assert rec["sharded_into_replicated"] is True
        assert rec["replicated_into_sharded"] is True


@pytest.mark.native
def test_consolidate_hf_of_an_fsdp2_checkpoint_loads_with_the_trained_models_logits(runs, tmp_path):
    import fsdp2_worker as w

    w.assert_consolidated_hf(runs['ckpt4'], runs['dump4'], tmp_path)


def test_spmd_on_four_virtual_cpu_devices_matches_plain_training(runs):
    """A replicated MLP, its batch sharded over the SPMD worker's 4 devices, trains like plain
    PyTorch on the whole batch (run at the start of the xla fit)."""
    import multiprocessing

    import test_ray_spmd_tpu as spmd

    (rec,) = runs["mlp"]
    assert rec["is_spmd"] is True and rec["devices"] == 4
    assert rec["mesh"] == {"data": 4, "model": 1}
    assert rec["specs"] and all(s == "{devices=[4,1]0,1,2,3}" for s in rec["specs"])
    assert rec["pg"] == ["gloo", 0, 1]

    # The same training without SPMD (plain PyTorch on CPU, same init and data), in a fresh
    # process: a CPU backward here would size autograd's device queues before torch_xla
    # registers its device, and later in-process XLA tests would then fail.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        losses, params = pool.apply(spmd.plain_training)
    assert losses[-1] < losses[0]  # it trains
    assert rec["losses"] == pytest.approx(losses, abs=1e-5)
    for got, want in zip(rec["params"], params):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
