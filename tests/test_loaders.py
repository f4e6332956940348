"""Loader and checkpoint defects, without Ray: each worker of a run is simulated by planning its
RANK/WORLD_SIZE in this process (the helpers read nothing else to shard)."""

from __future__ import annotations

import collections
import dataclasses
import os
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader, Sampler, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

import ray_train_xla as rtx

ROWS = torch.arange(10.0)


def per_worker(make_loader, workers, **kwargs):
    """Every simulated worker's batches (CPU), in rank order."""
    out = []
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    try:
        for r in range(workers):
            os.environ.update(RANK=str(r), WORLD_SIZE=str(workers))
            out.append(list(rtx.prepare_data_loader(make_loader(), to_device=False, **kwargs)))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def values(batches):
    return [float(v) for (b,) in batches for v in b]


def test_subset_random_sampler_is_sharded_not_replaced():
    subset = [0, 2, 4, 6, 8, 9]  # e.g. the training rows; 1, 3, 5, 7 are held out
    shards = per_worker(lambda: DataLoader(TensorDataset(ROWS), batch_size=1,
                                           sampler=SubsetRandomSampler(subset)), 2)
    seen = [values(s) for s in shards]
    assert sorted(seen[0] + seen[1]) == [float(i) for i in subset]  # every subset row once
    assert not set(seen[0]) & set(seen[1])


def test_weighted_random_sampler_keeps_its_weights():
    weights = torch.zeros(10)
    weights[3] = 1.0  # only row 3 can be drawn
    shards = per_worker(lambda: DataLoader(TensorDataset(ROWS), batch_size=2,
                                           sampler=WeightedRandomSampler(weights, 8)), 2)
    drawn = values(shards[0]) + values(shards[1])
    assert drawn == [3.0] * 8


def test_other_samplers_are_refused_with_a_clear_error():
    class EveryOther(Sampler):
        def __iter__(self):
            return iter(range(0, 10, 2))

        def __len__(self):
            return 5

    with pytest.raises(ValueError, match="cannot shard a EveryOther across workers"):
        per_worker(lambda: DataLoader(TensorDataset(ROWS), batch_size=1, sampler=EveryOther()), 2)


def test_a_distributed_sampler_is_kept_when_it_splits_by_data_parallel_rank_else_refused(
        monkeypatch):
    from torch.utils.data.distributed import DistributedSampler

    from ray_train_xla.planning.contract import LAYOUT_VAR

    def loader(replicas):  # split by the worker's global rank
        return lambda: DataLoader(TensorDataset(ROWS), batch_size=1, sampler=DistributedSampler(
            ROWS, num_replicas=replicas, rank=int(os.environ["RANK"]), shuffle=False))

    kept = per_worker(loader(2), 2)
    assert values(kept[0]) == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert values(kept[1]) == [1.0, 3.0, 5.0, 7.0, 9.0]
    with pytest.raises(ValueError, match=r"splits the rows num_replicas=4 ways \(rank=0\), but "
                                         r"this worker is data-parallel rank 0 of 2"):
        per_worker(loader(4), 2)
    # TP 2 on 2 workers: one data-parallel rank; a sampler by global rank would split the peers.
    monkeypatch.setenv(LAYOUT_VAR, "dp_replicate=1,dp_shard=1,tp=2")
    with pytest.raises(ValueError, match="data-parallel rank 0 of 1"):
        per_worker(loader(2), 2)


def test_pad_masks_count_every_row_once_across_four_workers():
    shards = per_worker(lambda: DataLoader(TensorDataset(ROWS), batch_size=2), 4, ragged="pad")
    assert [len(s) for s in shards] == [2, 2, 2, 2]  # every worker steps as often
    real = [float(v) for s in shards for ((b,), mask) in s for v, m in zip(b, mask) if m > 0]
    assert sorted(real) == [float(i) for i in range(10)]
    assert sum(float(mask.sum()) for s in shards for _, mask in s) == 10.0  # not 12


Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    name: str = "b"


class PairRows(torch.utils.data.Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return Pair(torch.tensor([float(i)]), torch.tensor(i))


def to_dataclass(samples):
    return Batch(torch.stack([s.x for s in samples]), torch.stack([s.y for s in samples]))


@pytest.fixture
def xla_cpu(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")


@pytest.mark.parametrize("ragged", ["drop", "pad"])
def test_namedtuple_and_dataclass_batches_keep_their_type(xla_cpu, ragged):
    for collate, kind in ((None, Pair), (to_dataclass, Batch)):
        kwargs = {"collate_fn": collate} if collate else {}
        loader = rtx.prepare_data_loader(DataLoader(PairRows(), batch_size=2, **kwargs),
                                         ragged=ragged, shuffle=False)
        batches = list(loader)
        for item in batches:
            batch = item[0] if ragged == "pad" else item
            assert type(batch) is kind
            assert batch.x.device.type == "xla" and batch.x.shape == (2, 1)
        if ragged == "pad":
            last, mask = batches[-1]
            assert mask.cpu().tolist() == [1.0, 0.0] and last.x.cpu().tolist() == [[4.0], [0.0]]


def _checkpoint_with(state):
    import ray.train

    tmp = tempfile.mkdtemp(prefix="rtx-ckpt-")
    torch.save(state, os.path.join(tmp, "checkpoint.pt"))
    return ray.train.Checkpoint.from_directory(tmp)


class NotWeights:
    """An arbitrary pickled object: loading it would run code from the checkpoint's storage."""


def test_load_checkpoint_reads_weights_only(xla_cpu):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    state = rtx.to_cpu({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
                        "epoch": 1, "lr": 0.5})
    loaded = rtx.load_checkpoint(checkpoint=_checkpoint_with(state))  # what save_checkpoint writes
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    with pytest.raises(Exception, match="Weights only load failed"):
        rtx.load_checkpoint(checkpoint=_checkpoint_with({"step": 1, "extra": NotWeights()}))
