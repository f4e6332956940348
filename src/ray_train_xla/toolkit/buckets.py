"""Buckets of tensors: many small tensors moved or reduced as a few flat ones (one transfer or
collective per bucket instead of one per tensor)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DEFAULT_BUCKET_MB = 25.0


def buckets(tensors: Iterable[torch.Tensor], bucket_mb: float) -> Iterator[list[torch.Tensor]]:
    """Group tensors of the same dtype into buckets of at most ``bucket_mb`` (one tensor may exceed)."""
    cap = max(1, int(bucket_mb * 1024 * 1024))
    open_buckets: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        bucket, size = open_buckets.get(t.dtype, ([], 0))
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > cap:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        open_buckets[t.dtype] = (bucket, size + nbytes)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


def flatten(bucket: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in bucket])


def unflatten_into(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    offset = 0
    for t in bucket:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n
