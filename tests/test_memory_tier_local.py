"""The memory tier in one process on a real local Ray (its memory stores are real actors): what
a store keeps, a checkpoint kept and restored bit for bit through ``keep_in_memory`` and
``load_checkpoint`` (replicated, and FSDP2 on a one-rank gloo group), the rules that send a
restore to storage, a store that is gone served by the next holder, errors. The runs through Ray
Train on several nodes are in ``test_memory_tier_ray.py``."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from ray_train_xla.errors import ReportError

pytestmark = [pytest.mark.native, pytest.mark.ray]


# The stores' handles, kept as the backend keeps them on the run's config (a store lives as long
# as its first handle).
STORES: dict = {}


@pytest.fixture
def tier_env(ray_local, monkeypatch):
    """A worker context with a memory tier whose store runs on this node: the CPU twin of a
    native config (plain torch on the CPU, no torch_xla)."""
    from ray_train_xla.planning import contract
    from ray_train_xla.toolkit.checkpoint import memory

    node = ray_local.get_runtime_context().get_node_id()
    tier = uuid.uuid4().hex[:12]
    memory.start_stores(tier, [node], 30, STORES)
    monkeypatch.setenv(contract.RUNTIME_VAR, "native")
    monkeypatch.setenv(contract.DEVICE_VAR, "cpu")
    monkeypatch.setenv(contract.MEMORY_EVERY_VAR, "2")
    monkeypatch.setenv(contract.MEMORY_TIER_VAR, tier)
    monkeypatch.setenv(contract.MEMORY_NODES_VAR, node)
    contract.reload()
    yield tier, node
    for var in (contract.MEMORY_TIER_VAR, contract.RUNTIME_VAR, contract.DEVICE_VAR):
        monkeypatch.delenv(var)
    contract.reload()
    for name in list(STORES):
        if tier in name:
            ray_local.kill(STORES.pop(name)[0])


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_a_store_keeps_two_generations_the_newest_and_the_one_before(ray_local):
    from ray_train_xla.toolkit.checkpoint.memory import NAMESPACE, start_stores, store_name

    node = ray_local.get_runtime_context().get_node_id()
    tier = uuid.uuid4().hex[:12]
    start_stores(tier, [node], 30, STORES)
    store = ray_local.get_actor(store_name(tier, node), namespace=NAMESPACE)
    for gen in (0, 1, 2):
        ray_local.get(store.put.remote(gen, 2, 0, {"a": b"x" * 10}))
    assert sorted(ray_local.get(store.inventory.remote())["gens"]) == [1, 2]
    ray_local.get(store.put.remote(7, 2, 0, {"a": b"y" * 5}))  # storage saves took 3 to 6
    ray_local.get(store.put.remote(7, 2, 1, {"b": b"z" * 5}))
    inv = ray_local.get(store.inventory.remote())
    assert sorted(inv["gens"]) == [2, 7] and inv["gens"][7]["ranks"] == {0: {"a": 5}, 1: {"b": 5}}
    assert ray_local.get(store.held_bytes.remote()) == 20
    ray_local.kill(store)


def _writer_io(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def _start_writer(writer_process: bool) -> int | None:
    """The tier's writer process started and ready (its pid), or off."""
    from ray_train_xla.toolkit import reporting
    from ray_train_xla.toolkit.checkpoint.memory import memory_tier

    reporting.configure_reports(writer_process=writer_process)
    if not writer_process:
        return None
    assert memory_tier().wait_writer(60)
    return memory_tier().writer_pid()


def _check_formatted(tier, pid: int | None, before: int, data_bytes: int) -> None:
    """A generation formatted by the writer process wrote its data file there (the bytes went
    through that process's writes) into shared memory, which is empty again."""
    from ray_train_xla.toolkit.checkpoint.memory.tier import _shared_root

    if pid is None:
        assert tier.by_writer == 0
        return
    assert tier.by_writer == tier.kept
    assert _writer_io(pid) - before >= data_bytes
    assert not os.path.exists(os.path.join(_shared_root(), tier.tier))  # nothing left


@pytest.fixture(params=[False, True], ids=["in-process", "writer-process"])
def writer_process(request):
    from ray_train_xla.toolkit import reporting

    yield request.param
    reporting.configure_reports()


def test_replicated_state_kept_in_memory_restores_bit_for_bit_without_storage(tier_env,
                                                                              writer_process):
    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import flush_memory, memory_tier

    pid = _start_writer(writer_process)
    before = _writer_io(pid) if pid else 0
    model, opt = _model_and_opt(0)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 4}
    assert rtx.keep_in_memory(state, 3) is False  # not a multiple of memory_every=2
    draws = _draws()  # what the generators give after the keep
    _draws()  # (drawn again: moved on)
    assert rtx.keep_in_memory(state, 4) is True  # keeps the generators as they are now
    expected = _draws()
    flush_memory()
    tier = memory_tier()
    assert tier.kept == 1
    _check_formatted(tier, pid, before, sum(t.numel() * 4 for t in model.state_dict().values()))
    fresh, fresh_opt = _model_and_opt(1)
    rest = rtx.load_checkpoint(fresh, fresh_opt)  # no Ray Train checkpoint: memory serves
    assert rest["step"] == 4
    assert tier.restored["fetched_bytes"] > 0 and tier.restored["world"] == 1
    # The generators are set as the keep found them: the draws after it come again.
    assert tier.restored["generators"] is True and _draws() == expected != draws
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    saved, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(saved[i][k], got[i][k]) for i in saved for k in saved[i])
    # After a restore, the numbers go on from the newest generation the stores know.
    assert tier.next_generation() == 1


def _draws() -> tuple:
    """One draw from each generator the memory tier keeps per rank."""
    import random

    import numpy as np

    return torch.rand(2).tolist(), random.random(), np.random.rand(2).tolist()


def test_generators_come_back_only_into_a_world_of_the_size_that_kept_them(tmp_path, caplog):
    from types import SimpleNamespace

    import pyarrow.fs as pafs

    from ray_train_xla.toolkit.checkpoint.files import ROOT
    from ray_train_xla.toolkit.checkpoint.memory import rng
    from ray_train_xla.toolkit.checkpoint.memory.tier import MemoryTier

    os.makedirs(tmp_path / ROOT)
    (tmp_path / ROOT / rng.file_name(1)).write_bytes(rng.capture())
    expected = _draws()
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    choice = {"gen": 5, "world": 2, "holders": {rng.file_name(1): [("store", 1)]}}
    restore = MemoryTier.restore_generators
    # Another world size (rank 1 of 3 is another rank's place), or a generation without them:
    # left as they are, and logged.
    with caplog.at_level("INFO", logger="ray_train_xla.toolkit.checkpoint.memory.tier"):
        assert restore(SimpleNamespace(rank=1, world=3), fs, choice) is False
        assert restore(SimpleNamespace(rank=0, world=2), fs, choice) is False
    assert "kept by 2 workers (now 3)" in caplog.text and "without them" in caplog.text
    assert _draws() != expected
    assert restore(SimpleNamespace(rank=1, world=2), fs, choice) is True
    assert _draws() == expected
    # An accelerator's generator kept, restored in a process without it: the rest is set, and
    # the one left out is named.
    import pickle

    kept = pickle.loads(rng.capture())
    kept["device"] = ("neuron", torch.zeros(8, dtype=torch.uint8))
    with caplog.at_level("WARNING", logger="ray_train_xla.toolkit.checkpoint.memory.rng"):
        assert rng.restore(pickle.dumps(kept)) == ["torch", "python", "numpy"]
    assert "the neuron generator kept with this generation is not restored" in caplog.text


@pytest.fixture(params=[False, True], ids=["in-process", "in-place"])
def shared_memory(request, monkeypatch):
    """With the node's shared memory (DTensor generations written in place into slots), or
    without (formatted by ``dcp.save`` in the training process)."""
    from ray_train_xla.toolkit.checkpoint.memory import tier

    if not request.param:
        monkeypatch.setattr(tier, "_shared_root", lambda: "")
    yield request.param
    tier.memory_tier().end()


def test_fsdp2_state_kept_in_memory_restores_bit_for_bit(tier_env, tmp_path, shared_memory):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import NAMESPACE, flush_memory, memory_tier, store_name
    from ray_train_xla.toolkit.checkpoint.memory.tier import _shared_root

    def step_and_keep(step: int) -> None:
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        rtx.keep_in_memory({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "step": step}, step)
        flush_memory()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, opt = _model_and_opt(0)
        fully_shard(model)
        opt = torch.optim.AdamW(model.named_parameters(), lr=0.1)
        if shared_memory:  # a slot file an earlier run's worker left (it died before a take)
            import subprocess
            import sys

            dead = subprocess.Popen([sys.executable, "-c", "pass"])
            dead.wait()
            left = os.path.join(_shared_root(), "an-earlier-tier", f"slot-{dead.pid}-0-0-0.distcp")
            os.makedirs(os.path.dirname(left), exist_ok=True)
            open(left, "wb").close()
        step_and_keep(2)
        tier = memory_tier()
        if shared_memory:  # swept by the store's take, with its directory
            assert not os.path.exists(os.path.dirname(left))
        assert tier.by_writer == 0 and tier.writer_pid() is None  # no writer process for it
        if shared_memory:
            # Written rank by rank, in place: the rank's data file (a slot, which the store
            # mapped and unlinked), its own metadata (merged when read), its generators.
            inventory = tier.inventories()[0]
            assert sorted(inventory["gens"][0]["ranks"][0]) == [
                "__0.metadata", "__0_0.distcp", "extra.pt", "param_groups.pt",
                "rng-0.pkl", "sharded.json"], inventory
            tier_dir = os.path.join(_shared_root(), tier.tier)
            assert os.listdir(tier_dir) == []  # mapped by the store, and unlinked
            # Three more generations: the two slots are used in turn, laid out and planned
            # once; the store holds the newest two.
            for step in (4, 6, 8):
                step_and_keep(step)
            assert (tier._slots.allocations, tier._slots.plans) == (2, 1)
            assert tier.kept == tier.by_rank == 4
            assert sorted(tier.inventories()[0]["gens"]) == [2, 3]
            assert os.listdir(tier_dir) == []
            # A slot being written again no longer serves the generation it held.
            import ray

            store = ray.get_actor(store_name(tier.tier, tier.node), namespace=NAMESPACE)
            tier._slots.slots[0].stamp(-1)  # generation 2's slot, as when the next one starts
            assert sorted(tier.inventories()[0]["gens"][2]["ranks"]) == []
            with pytest.raises(Exception, match="no longer held here"):
                ray.get(store.get.remote(2, 0, "__0_0.distcp"))
            tier._slots.slots[0].stamp(2)
            assert tier.inventories()[0]["slots"] == 2  # mapped once each
        else:
            assert tier.by_rank == 0
        fresh, _ = _model_and_opt(1)
        fully_shard(fresh)
        fresh_opt = torch.optim.AdamW(fresh.named_parameters(), lr=0.1)
        if shared_memory:
            # A slot taken for a newer generation while a restore reads it (its writer alive):
            # the bytes read do not serve, though the store held the generation when asked.
            from ray_train_xla.toolkit.checkpoint.memory import restore

            slot = next(s for s in tier._slots.slots if s._stamp[0] == 3)
            read = restore.StoreFiles._read

            def read_then_written_over(self, handle, rank, name):
                slot.stamp(3)  # (as if the data file were read last)
                data = read(self, handle, rank, name)
                if name == "__0_0.distcp":
                    slot.stamp(-1)  # the next generation starts copying into it
                return data

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(restore.StoreFiles, "_read", read_then_written_over)
                # (DCP raises its CheckpointException, a BaseException)
                with pytest.raises(BaseException, match="written over while it was read"):
                    rtx.load_checkpoint(fresh, fresh_opt)
            slot.stamp(3)
        assert rtx.load_checkpoint(fresh, fresh_opt) == {"step": 8 if shared_memory else 2}
        files = memory_tier().restored
        assert files is not None and files["fetched_bytes"] > 0
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        saved, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
        assert saved.keys() == got.keys()
        for name in saved:
            for k, v in saved[name].items():
                w = got[name][k]
                assert torch.equal(getattr(v, "full_tensor", lambda v=v: v)(),
                                   getattr(w, "full_tensor", lambda w=w: w)()), (name, k)
        if shared_memory:
            # Kept another way from now on (as when another rank's node has no shared memory):
            # the rank's slots go, and the store lets go of them once it holds no generation
            # in them.
            tier._shared = ""
            for step in (10, 12):
                step_and_keep(step)
            assert tier._slots is None and tier.by_rank == 4
            assert tier.inventories()[0]["slots"] == 0
            tier.end()  # at the worker's end: nothing of its own left in shared memory
            assert not os.path.exists(tier_dir)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "blocking"])
def test_a_full_shared_memory_is_an_error_and_later_generations_are_kept_in_process(
        tier_env, tmp_path, monkeypatch, overlap):
    """Slots are allocated when made (not a SIGBUS at the first copy): /dev/shm full is a
    ReportError that says so (from the next call when the snapshot is overlapped, from this one
    when it is copied in the call); the next generations are formatted in the training process,
    and restore bit for bit."""
    import contextlib
    import errno

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ray_train_xla as rtx
    from ray_train_xla.toolkit import reporting
    from ray_train_xla.toolkit.checkpoint.memory.tier import _shared_root, flush_memory, memory_tier

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, opt = _model_and_opt(0)
        fully_shard(model)
        opt = torch.optim.AdamW(model.named_parameters(), lr=0.1)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}
        reporting.configure_reports(overlap_snapshots=overlap)
        full_error = pytest.raises(ReportError, match=r"shared memory \(/dev/shm\) is full.*"
                                                      r"later generations are formatted in the")
        with monkeypatch.context() as m:
            m.setattr(os, "posix_fallocate", full)
            with contextlib.nullcontext() if overlap else full_error:
                assert rtx.keep_in_memory(state, 2) is True
            if overlap:
                with full_error:
                    flush_memory()
        state["step"] = 4
        assert rtx.keep_in_memory(state, 4) is True
        flush_memory()
        tier = memory_tier()
        assert (tier.kept, tier.by_rank) == (1, 0)
        fresh, _ = _model_and_opt(1)
        fully_shard(fresh)
        fresh_opt = torch.optim.AdamW(fresh.named_parameters(), lr=0.1)
        assert rtx.load_checkpoint(fresh, fresh_opt) == {"step": 4}
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        assert not os.path.exists(os.path.join(_shared_root(), tier.tier))  # nothing left
    finally:
        reporting.configure_reports()
        memory_tier().end()
        dist.destroy_process_group()


def test_storage_serves_when_a_rank_is_missing_or_storage_is_newer_and_a_dead_holder_is_skipped(
        tier_env, ray_local):
    from ray_train_xla.toolkit.checkpoint.memory import NAMESPACE, memory_tier, start_stores, store_name

    tier_id, node = tier_env
    tier = memory_tier()
    store = ray_local.get_actor(store_name(tier_id, node), namespace=NAMESPACE)
    ray_local.get(store.put.remote(5, 2, 0, {"__0_0.distcp": b"a"}))  # rank 1 never arrived
    choice = tier.choose()
    assert choice["tier"] == "storage" and "rank(s) [1] of 2" in choice["why"], choice
    ray_local.get(store.put.remote(5, 2, 1, {"__1_0.distcp": b"b"}))
    assert tier.choose()["tier"] == "memory"
    ray_local.get(store.note_storage.remote(6))
    choice = tier.choose()
    assert choice["tier"] == "storage" and "newer" in choice["why"] and choice["next"] == 7
    # A file listed on a store that is gone is read from the next one that holds it.
    other = uuid.uuid4().hex[:12]
    start_stores(other, [node], 30, STORES)
    spare = ray_local.get_actor(store_name(other, node), namespace=NAMESPACE)
    ray_local.get(spare.put.remote(5, 2, 1, {"__1_0.distcp": b"b"}))
    ray_local.kill(spare)
    choice = {"gen": 5, "holders": {"__1_0.distcp": [(store_name(other, node), 1),
                                                     (store_name(tier_id, node), 1)]}}
    fs, files = tier.filesystem(choice)
    with fs.open_input_file("memory/__1_0.distcp") as f:
        assert f.read() == b"b"
    assert files.fetched_bytes == 1


def test_a_keep_while_the_previous_one_is_going_keeps_nothing(tier_env):
    import threading

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.checkpoint.memory import flush_memory, memory_tier

    tier = memory_tier()
    release = threading.Event()
    put = tier._put

    def slow_put(*args):
        release.wait(30)
        return put(*args)

    tier._put = slow_put
    model, opt = _model_and_opt(0)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}
    assert rtx.keep_in_memory(state, 2) is True
    assert rtx.keep_in_memory(state, 4) is False  # the loop does not wait for the tier
    assert (tier.kept, tier.skipped) == (0, 1)
    release.set()
    flush_memory()
    assert rtx.keep_in_memory(state, 6) is True
    flush_memory()
    assert (tier.kept, tier.skipped) == (2, 1)


def test_a_failed_keep_reaches_the_training_function_and_no_tier_is_an_error(tier_env, monkeypatch):
    import ray_train_xla as rtx
    from ray_train_xla.planning import contract
    from ray_train_xla.toolkit.checkpoint.memory import flush_memory

    rtx.keep_in_memory({"fn": lambda: 0, "step": 2}, 2)  # a lambda cannot be saved
    with pytest.raises(ReportError, match="keeping a checkpoint in memory failed"):
        flush_memory()
    monkeypatch.delenv(contract.MEMORY_EVERY_VAR)
    contract.reload()
    with pytest.raises(ValueError, match="memory_every=N on the config"):
        rtx.keep_in_memory({"step": 1}, 1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_memory_every_is_checked_in_the_config(bad):
    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig, TorchXLAConfig
    from ray_train_xla.errors import XLAConfigError

    for config in (TorchXLAConfig, TorchNeuronConfig, TorchTPUConfig):
        with pytest.raises(XLAConfigError, match="memory_every"):
            config(device="cpu", memory_every=bad)
    assert TorchNeuronConfig(device="cpu", memory_every=5).memory_every == 5
    assert os.environ.get("RAY_TRAIN_XLA_MEMORY_EVERY") is None


def test_memory_files_write_into_one_buffer_reused_from_a_generation_to_the_next():
    """A rank's data file is written into one buffer of its expected size (no copies as it
    grows), which the next generation reuses once the files were released; a file larger than
    expected grows and keeps every byte."""
    from ray_train_xla.toolkit.checkpoint.files import ROOT, MemoryFiles

    def write(chunks, expected):
        files = MemoryFiles()
        files.expected_bytes = expected
        with files.create_stream(f"{ROOT}/__0_0.distcp", "wb") as stream:
            for chunk in chunks:
                stream.write(chunk)
        return files

    chunks = [bytes([i]) * 10_000 for i in range(100)]
    first = write(chunks, 1 << 20)
    assert bytes(first.by_name()["__0_0.distcp"]) == b"".join(chunks)
    buffer = first._arrays[0]
    first.release()
    second = write(chunks[:50], 1 << 20)
    assert second._arrays[0] is buffer  # reused: nothing allocated
    assert bytes(second.by_name()["__0_0.distcp"]) == b"".join(chunks[:50])
    second.release()
    grown = write(chunks * 3, 1 << 20)  # 3 MB into 1 MB: grows, every byte kept
    assert bytes(grown.by_name()["__0_0.distcp"]) == b"".join(chunks * 3)


def test_a_tier_writer_process_that_stops_is_an_error_and_the_next_generation_goes_on(
        tier_env, monkeypatch):
    import signal
    import time

    import ray_train_xla as rtx
    from ray_train_xla.planning import contract
    from ray_train_xla.toolkit import reporting
    from ray_train_xla.toolkit.checkpoint.memory import flush_memory, memory_tier

    monkeypatch.setenv(contract.TIMEOUT_VAR, "2")
    contract.reload()
    try:
        pid = _start_writer(True)
        model, opt = _model_and_opt(0)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}
        os.kill(pid, signal.SIGSTOP)  # alive, but it writes nothing
        start = time.monotonic()
        assert rtx.keep_in_memory(state, 2) is True
        with pytest.raises(ReportError, match=r"writer process did not write .* within "
                                              r"timeout_s=2; configure_reports\(writer_process"):
            flush_memory()
        assert time.monotonic() - start < 10
        import psutil

        tier = memory_tier()
        assert not psutil.pid_exists(pid)  # ended (it was started here)
        # The next generation is kept (in this process while a new writer starts).
        assert rtx.keep_in_memory(state, 4) is True
        flush_memory()
        assert (tier.kept, tier.by_writer) == (1, 0) and tier.writer_pid() not in (None, pid)
    finally:
        reporting.configure_reports()
        memory_tier().end()
