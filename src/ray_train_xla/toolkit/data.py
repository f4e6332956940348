"""Input pipelines with constant batch shapes, moved to the XLA device (in the background on
accelerators).

Every distinct input shape is a distinct XLA graph: a short last batch compiles a second step
graph (and, on Neuron, minutes of compilation). These helpers keep every batch the same shape:
``ragged="drop"`` drops the short last batch, ``ragged="pad"`` pads it with zero rows and yields
``(batch, mask)`` where ``mask`` is 1.0 for real rows and 0.0 for padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ray_train_xla.toolkit.device import get_device
from ray_train_xla.toolkit.events import batch_handed_out
from ray_train_xla.toolkit.parallel import data_parallel, shared_with_tp_peers
from ray_train_xla.toolkit.stacks import stack

RAGGED_MODES = ("drop", "pad")


def _check_ragged(ragged: str) -> str:
    if ragged not in RAGGED_MODES:
        raise ValueError(f"ragged={ragged!r} is not valid: expected one of {list(RAGGED_MODES)}")
    return ragged


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it; dicts, lists, tuples, namedtuples and
    dataclass instances keep their type."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: _map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value) if f.init
        })
    return value


def _rows(batch: Any) -> int | None:
    """The rows of the first tensor in ``batch`` that has a batch dimension (None: no such)."""
    rows: list[int] = []
    _map_tensors(batch, lambda t: rows.append(t.shape[0]) if t.dim() else None)
    return rows[0] if rows else None


def pad_batch(batch: Any, batch_size: int) -> tuple[Any, torch.Tensor]:
    """Pad every tensor in ``batch`` (nested tuples, lists, dicts) with zero rows up to
    ``batch_size``; return ``(padded, mask)`` with ``mask[i] = 1.0`` for real rows."""
    rows = _rows(batch)
    if rows is None:
        raise ValueError("pad_batch: the batch holds no tensor with a batch dimension")
    if rows > batch_size:
        raise ValueError(f"pad_batch: batch has {rows} rows, more than batch_size={batch_size}")

    def pad(value: torch.Tensor) -> torch.Tensor:
        if value.dim() and value.shape[0] == rows and rows != batch_size:
            filler = value.new_zeros((batch_size - rows, *value.shape[1:]))
            return torch.cat([value, filler])
        return value

    mask = torch.zeros(batch_size)
    mask[:rows] = 1.0
    return _map_tensors(batch, pad), mask


def _pad_collate(collate_fn: Callable, batch_size: int, samples: list) -> tuple[Any, torch.Tensor]:
    """``collate_fn``'s batch padded to ``batch_size``, with the mask.

    Samples come as ``(sample, real)`` from :class:`_Flagged`: rows that the sampler repeats to
    give every worker as many rows are in the batch (constant shapes) with mask 0.0."""
    reals = torch.tensor([float(real) for _, real in samples])
    batch, mask = pad_batch(collate_fn([sample for sample, _ in samples]), batch_size)
    mask[:len(reals)] = reals
    return batch, mask


class _Flagged(torch.utils.data.Dataset):
    """``dataset[(index, real)]`` is ``(dataset[index], real)`` (pad mode)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, bool]) -> tuple[Any, bool]:
        index, real = key
        return self.dataset[index], real


class _ShardSampler(torch.utils.data.Sampler):
    """This worker's share of a global index order that every worker computes alike.

    Like ``DistributedSampler`` (same order for the same seed and epoch, tail repeated from the
    start so every worker gets ``ceil(n / world)`` rows, worker ``r`` takes positions ``r,
    r + world, ...``), but over any order: the dataset (shuffled or not), a
    ``SubsetRandomSampler``'s indices, a ``WeightedRandomSampler``'s draws. ``flag=True`` yields
    ``(index, real)`` where ``real`` is False for the repeated tail rows.
    """

    def __init__(self, order: Callable[[torch.Generator], list[int]], rank: int, world: int,
                 length: int, seed: int, flag: bool) -> None:
        self.order, self.rank, self.world, self.seed, self.flag = order, rank, world, seed, flag
        self.per_worker = math.ceil(length / world) if length else 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_worker

    def __iter__(self) -> Iterator[Any]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = list(self.order(g))
        n, total = len(order), self.per_worker * self.world
        padded = (order * math.ceil(total / n))[:total] if n else []
        for pos in range(self.rank, total, self.world):
            yield (padded[pos], pos < n) if self.flag else padded[pos]


class _GlobalBatchSampler(torch.utils.data.Sampler):
    """This worker's rows of fixed-size global batches over a global index order that every
    worker computes alike, whatever the world size.

    Global batch ``b`` is positions ``[b * G, (b + 1) * G)`` of the epoch's order; worker ``r`` of
    ``w`` takes its ``r``-th block of ``G // w`` consecutive rows, so the workers' batches of a
    step, in rank order, are the global batch, for every ``w`` that divides ``G``. ``start`` (a
    global sample, a multiple of ``G``) is where the next epoch begins (resuming in an epoch).
    ``ragged="drop"`` drops a short last global batch; "pad" fills it with rows repeated from the
    start of the order, flagged not real (``flag=True`` yields ``(index, real)``).
    """

    def __init__(self, order: Callable[[torch.Generator], list[int]], rank: int, world: int,
                 length: int, seed: int, global_batch: int, pad: bool) -> None:
        self.order, self.rank, self.world, self.seed = order, rank, world, seed
        self.global_batch, self.pad = global_batch, pad
        self.per_worker = global_batch // world
        self.batches = (math.ceil(length / global_batch) if pad else length // global_batch)
        self.epoch = 0
        self.start = 0

    @property
    def epoch_samples(self) -> int:
        """Global samples one epoch steps through (whole global batches)."""
        return self.batches * self.global_batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return max(0, self.epoch_samples - self.start) // self.global_batch * self.per_worker

    def __iter__(self) -> Iterator[Any]:
        return self._rows(self.epoch, self.start)  # this epoch and start, whenever it is read

    def _rows(self, epoch: int, start: int) -> Iterator[Any]:
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        order = list(self.order(g))
        n = len(order)
        first = self.rank * self.per_worker
        for base in range(start, self.epoch_samples, self.global_batch):
            for pos in range(base + first, base + first + self.per_worker):
                yield (order[pos % n], pos < n) if self.pad else order[pos]


class _GivenDistributed(torch.utils.data.Sampler):
    """A user's DistributedSampler, its indices flagged real or repeated (pad mode)."""

    def __init__(self, sampler: Any, real: Callable[[int], bool]) -> None:
        self.sampler, self.real = sampler, real

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        for k, index in enumerate(self.sampler):
            yield index, self.real(k)


def _sampler_order(loader: Any, shuffle: bool | None) -> tuple[Callable[[torch.Generator], list[int]], int]:
    """The global index order of ``loader``'s sampler (a function of a seeded generator, the same
    on every worker) and its length; a ValueError for samplers that cannot be sharded so."""
    from torch.utils.data import (
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    sampler = loader.sampler
    n = len(loader.dataset)
    if isinstance(sampler, (SequentialSampler, RandomSampler)):
        if shuffle if shuffle is not None else isinstance(sampler, RandomSampler):
            return (lambda g: torch.randperm(n, generator=g).tolist()), n
        return (lambda g: list(range(n))), n
    if isinstance(sampler, SubsetRandomSampler):
        indices = [int(i) for i in sampler.indices]
        if shuffle is False:
            return (lambda g: list(indices)), len(indices)
        return (lambda g: [indices[i] for i in torch.randperm(len(indices), generator=g)]), len(indices)
    if isinstance(sampler, WeightedRandomSampler):
        weights, count, replacement = sampler.weights, sampler.num_samples, sampler.replacement
        return (lambda g: torch.multinomial(weights, count, replacement, generator=g).tolist()), count
    raise ValueError(
        f"prepare_data_loader: cannot shard a {type(sampler).__name__} across workers (it is not "
        "a SequentialSampler, RandomSampler, SubsetRandomSampler or WeightedRandomSampler). "
        "Give the DataLoader a DistributedSampler(dataset, num_replicas=dp, rank=dp_rank) with "
        "dp_rank, dp = rtx.data_parallel(), built from your sampling, or shard the dataset "
        "yourself.")


class XLADataLoader:
    """This worker's shard of a DataLoader, batches on the XLA device, reshuffled every epoch.

    Each ``iter()`` is one epoch; call ``set_epoch(e)`` to choose it (when resuming). With
    ``prepare_data_loader(global_batch_size=...)``, ``state_dict()`` is the position in the
    global sample order (save it in checkpoints) and ``load_state_dict()`` resumes there, on any
    world size that divides the global batch.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, sampler: Any, to_device: bool,
                 background: bool | None = None) -> None:
        self.loader = loader
        self.sampler = sampler
        self._to_device = to_device
        self._background = background
        self._device_loader = None  # one MpDeviceLoader: it closes the previous epoch's threads
        self._global = isinstance(sampler, _GlobalBatchSampler)
        # The position, the only state of the iteration: (epoch, global sample) of the next batch
        # (the sample moves with global batches only), and whether iter() has begun that epoch
        # (then the next iter() begins the following epoch, at sample 0).
        self._position = (0, 0)
        self._begun = False

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` uses."""
        return self._position[0] + self._begun

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (the shuffle order depends on it)."""
        # A position loaded by load_state_dict and not iterated yet keeps its sample.
        self._position = (epoch, 0 if self._begun else self._position[1])
        self._begun = False

    def state_dict(self) -> dict[str, int]:
        """Where the next batch starts: ``{"epoch", "sample", "global_batch_size"}``, ``sample``
        counting global samples of the epoch's order handed out so far (every worker returns the
        same). Only with ``global_batch_size``."""
        sampler = self._global_sampler("state_dict")
        epoch, sample = self._position
        if sample >= sampler.epoch_samples:
            epoch, sample = epoch + 1, 0
        return {"epoch": epoch, "sample": sample, "global_batch_size": sampler.global_batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at ``state`` (from ``state_dict()``, saved by a run of any world size): the
        next ``iter()`` is that epoch, from that global sample on."""
        sampler = self._global_sampler("load_state_dict")
        if int(state["global_batch_size"]) != sampler.global_batch:
            raise ValueError(
                f"XLADataLoader.load_state_dict: the state was saved with global_batch_size="
                f"{state['global_batch_size']}, this loader has {sampler.global_batch}: the "
                "same global batch is needed to resume at the same sample")
        sample = int(state["sample"])
        if sample < 0 or sample % sampler.global_batch:
            raise ValueError(f"XLADataLoader.load_state_dict: sample={sample} is not valid: "
                             f"expected a multiple of global_batch_size={sampler.global_batch}")
        self._position, self._begun = (int(state["epoch"]), sample), False
        sampler.start = sample  # len() is then what is left of it

    def _global_sampler(self, what: str) -> _GlobalBatchSampler:
        if not self._global:
            raise ValueError(f"XLADataLoader.{what} needs prepare_data_loader(global_batch_size="
                             "...): only then is the position the same on every world size")
        return self.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._begun:  # the previous epoch (whole or not): the next one, from its start
            self._position = (self._position[0] + 1, 0)
        self._begun = True
        epoch, start = self._position
        self.sampler.set_epoch(epoch)
        if self._global:
            self.sampler.start = start
        if not self._to_device:
            batches = iter(self.loader)
        elif not _use_background(self._background):
            batches = _on_device(self.loader)
        else:
            if self._device_loader is None:
                from torch_xla.distributed.parallel_loader import MpDeviceLoader

                self._device_loader = MpDeviceLoader(self.loader, get_device())
            batches = iter(self._device_loader)
        return _timed(self._counted(batches, epoch) if self._global else batches)

    def _counted(self, batches: Iterator[Any], epoch: int) -> Iterator[Any]:
        """The batches, the position moved past each one as it is handed out."""
        step = self.sampler.global_batch
        for batch in batches:
            self._position = (epoch, self._position[1] + step)
            yield batch


def _use_background(background: bool | None) -> bool:
    """Background transfer (MpDeviceLoader) hides host-to-device copies on accelerators; on the
    XLA CPU device the copy stays in host memory and the loader's threads only compete with the
    step for the cores (measured: 0.76 of a synchronous loop), so "auto" skips it there."""
    return stack().background_loader(background)  # native: copied in the loop (no MpDeviceLoader)


def move_to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor (in dicts, lists, tuples, namedtuples, dataclasses) moved to
    ``device``; containers keep their type."""
    return _map_tensors(value, lambda t: t.to(device))


def _on_device(batches: Any) -> Iterator[Any]:
    device = get_device()
    for batch in batches:
        yield move_to_device(batch, device)


def prepare_data_loader(
    loader: torch.utils.data.DataLoader,
    ragged: str = "drop",
    shuffle: bool | None = None,
    seed: int = 0,
    to_device: bool = True,
    background: bool | None = None,
    global_batch_size: int | None = None,
) -> XLADataLoader:
    """Rebuild ``loader`` for this worker: its shard of the dataset, every batch of exactly
    ``loader.batch_size`` rows, moved to the XLA device.

    The loader's sampler decides what is sharded: the whole dataset (``SequentialSampler``,
    ``RandomSampler``), a ``SubsetRandomSampler``'s indices only, a ``WeightedRandomSampler``'s
    weighted draws; a ``DistributedSampler`` you built is kept when it splits by
    ``data_parallel()`` (else a ValueError). Other samplers are refused (a ValueError) rather
    than replaced. The rows are split by data-parallel rank
    (``data_parallel()``: the worker's rank, except that tensor-parallel peers share one and
    get the same rows): each gets ``ceil(rows / dp)`` rows, the last ones repeated from the
    start when the rows do not divide evenly (as ``DistributedSampler``).

    ``ragged``: "drop" the short last batch, or "pad" it and yield ``(batch, mask)`` for every
    batch; the mask is 0.0 for padding and for the repeated rows, so the masks of all workers
    count every row exactly once. ``shuffle``: default True unless ``loader`` iterates in order
    (a ``SequentialSampler``); the order depends on ``seed`` and the epoch. ``background``: move
    batches in background threads (torch_xla's ``MpDeviceLoader``); the default (None) does so
    on accelerators and copies synchronously on the XLA CPU device. ``to_device=False`` yields
    CPU batches.

    ``global_batch_size`` (elastic runs): keep the global batch, not the per-worker batch,
    constant. Every step takes the next ``global_batch_size`` rows of the epoch's global order
    (the same on every world size: it depends on ``seed`` and the epoch only) and this worker
    gets its data-parallel rank's block of ``global_batch_size / dp`` of them
    (``loader.batch_size`` is not used), so a run that resizes sees the same global batches as
    one that does not. The data-parallel degree must divide ``global_batch_size`` (a ValueError
    names the valid sizes). Save the
    loader's ``state_dict()`` in your checkpoints and give it to ``load_state_dict()`` after a
    restart: the run resumes at the same global sample, on whatever world size it then has.
    ``ragged`` applies to the last global batch; a ``DistributedSampler`` is refused (its order
    interleaves by rank and changes with the world size).
    """
    from torch.utils.data.distributed import DistributedSampler

    _check_ragged(ragged)
    pad = ragged == "pad"
    dp_rank, dp = data_parallel()  # tensor-parallel peers read the same rows
    if global_batch_size is not None:
        _check_global_batch_size(global_batch_size, dp)
    elif loader.batch_size is None:
        raise ValueError(
            "prepare_data_loader: the DataLoader has batch_size=None (a batch_sampler or "
            "unbatched data); give it a fixed batch_size so every batch has the same shape"
        )
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise ValueError(
            "prepare_data_loader: an IterableDataset cannot be sharded by a sampler; shard it "
            "yourself by rtx.data_parallel() (rank and degree), or use Ray Data with "
            "iter_xla_batches()"
        )
    given = loader.sampler if isinstance(loader.sampler, DistributedSampler) else None
    if global_batch_size is not None:
        if given is not None:
            raise ValueError(
                "prepare_data_loader: global_batch_size= shards the loader's own order by global "
                "batch; a DistributedSampler interleaves rows by rank (its order changes with the "
                "world size): give the DataLoader its plain sampler (shuffle=True or False)")
        order, length = _sampler_order(loader, shuffle)
        sampler = _GlobalBatchSampler(order, dp_rank, dp, length, seed, global_batch_size, pad)
        # It yields whole global batches only (a short last one padded or dropped).
        rebuilt = _rebuild(loader, sampler, sampler.per_worker, pad, drop_last=False)
        return XLADataLoader(rebuilt, sampler, to_device, background)
    if given is not None:
        if (given.num_replicas, given.rank) != (dp, dp_rank):  # not another split, silently
            raise ValueError(
                f"prepare_data_loader: the DataLoader's DistributedSampler splits the rows "
                f"num_replicas={given.num_replicas} ways (rank={given.rank}), but this worker "
                f"is data-parallel rank {dp_rank} of {dp} (tensor-parallel peers read the same "
                "rows): build it with rtx.data_parallel(), DistributedSampler(dataset, "
                "num_replicas=dp, rank=dp_rank), or give the DataLoader its plain sampler")
        # Its k-th index is position rank + k * num_replicas of its padded order.
        n, r, w = len(given.dataset), given.rank, given.num_replicas
        sampler = _GivenDistributed(given, lambda k: r + k * w < n) if pad else given
    else:
        order, length = _sampler_order(loader, shuffle)
        sampler = _ShardSampler(order, dp_rank, dp, length, seed, pad)
    rebuilt = _rebuild(loader, sampler, loader.batch_size, pad, drop_last=not pad)
    return XLADataLoader(rebuilt, sampler, to_device, background)


def _check_global_batch_size(global_batch_size: Any, world: int) -> None:
    """A ValueError unless ``global_batch_size`` is an int >= 1 that ``world`` divides."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or (
            global_batch_size < 1):
        raise ValueError(f"prepare_data_loader: global_batch_size={global_batch_size!r} is not "
                         "valid: expected an int >= 1")
    if global_batch_size % world:
        sizes = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
        raise ValueError(
            f"prepare_data_loader: global_batch_size={global_batch_size} is not valid for "
            f"{world} workers: every worker takes global_batch_size / world_size rows, so the "
            f"world size must be one of {sizes} (in an elastic run, a ScalingConfig num_workers "
            "range whose sizes all divide it, or another global batch)")


def _rebuild(loader: Any, sampler: Any, batch_size: int, pad: bool,
             drop_last: bool) -> torch.utils.data.DataLoader:
    """``loader`` with ``sampler`` and ``batch_size``, its other settings kept. ``pad``: the
    sampler yields ``(index, real)`` and every batch is padded to ``batch_size`` and comes with
    its mask (``_Flagged``, ``_pad_collate``)."""
    from torch.utils.data import DataLoader

    return DataLoader(
        _Flagged(loader.dataset) if pad else loader.dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=functools.partial(_pad_collate, loader.collate_fn, batch_size) if pad
        else loader.collate_fn,
        pin_memory=False,
        drop_last=drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers else False,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
    )


def _ray_data_batches(shard: Any, batch_size: int, ragged: str, kwargs: dict) -> Iterator[Any]:
    """One epoch of a Ray Data shard as CPU batches of constant shape."""
    for batch in shard.iter_torch_batches(batch_size=batch_size, drop_last=ragged == "drop", **kwargs):
        yield pad_batch(batch, batch_size) if ragged == "pad" else batch


def iter_xla_batches(
    shard: Any,
    batch_size: int,
    ragged: str = "drop",
    to_device: bool = True,
    background: bool | None = None,
    **iter_torch_batches_kwargs: Any,
) -> Iterator[Any]:
    """Iterate one epoch of a Ray Data shard (``ray.train.get_dataset_shard(name)``) as dicts of
    XLA tensors with exactly ``batch_size`` rows, moved to the device in the background.

    ``ragged`` and ``background`` as in ``prepare_data_loader``. Every worker must get the same
    number of batches (Ray Train's default ``DataConfig`` splits datasets into equal shards).
    Under tensor parallelism the peers of a group train on the same batches, taken from each
    peer's shard in turn (``parallel.shared_with_tp_peers``): every row once, an epoch ``tp``
    times as many steps as one worker's shard holds batches.
    """
    _check_ragged(ragged)
    if batch_size < 1:
        raise ValueError(f"iter_xla_batches: batch_size={batch_size} is not valid: expected >= 1")
    # CPU batches from Ray Data (its "auto" device follows ray.train.torch.get_device(), the XLA
    # device on our workers); they are moved here, in the background on accelerators.
    iter_torch_batches_kwargs.setdefault("device", "cpu")
    batches = shared_with_tp_peers(_ray_data_batches(shard, batch_size, ragged,
                                                     iter_torch_batches_kwargs))
    if not to_device:
        return _timed(batches)
    if not _use_background(background):
        return _timed(_on_device(batches))
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    return _timed(MpDeviceLoader(batches, get_device()))


def _timed(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches``, the time the training thread waits for each one added to the step
    timeline's data wait, and each one's tokens to its step (``events.py``): two clock reads
    and a look at the first tensor's shape a batch."""
    clock = time.perf_counter
    start = clock()  # from when the loop asks (the iterator is made at the first batch)
    for batch in batches:
        batch_handed_out(clock() - start, batch)
        yield batch
        start = clock()
