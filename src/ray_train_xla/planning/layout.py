"""The parallelism layout: how the job's devices split into data-parallel replicas, data-parallel
shards (FSDP) and tensor-parallel groups. Pure: no Ray, no torch.

``Parallelism`` is what the user asks for (a config's ``parallelism`` field, or a call's): a size
per dimension, ``dp_shard=-1`` (the default) meaning "every device the others leave". ``Layout``
is that request resolved for a job of ``world`` devices, with each device's coordinates.

The dimensions, outermost first, are ``DIMS``: ``dp_replicate`` (HSDP's replicas), ``dp_shard``
(FSDP's shards) and ``tp`` (tensor parallelism, innermost). A device's coordinates come from its
rank in row-major order over ``DIMS``, as ``torch.distributed.device_mesh.init_device_mesh``
lays out ranks: a tensor-parallel group is ``tp`` consecutive ranks. Since every config numbers
the ranks of a node consecutively, a ``tp`` that divides the devices of each node keeps each
group inside one node, on the fast links (NeuronLink, ICI), and FSDP spans the nodes.
``check_topology`` refuses a layout that would split a group across nodes, naming the field.

Context and pipeline parallelism take their place in ``DIMS`` (``pp`` outermost, ``cp`` between
``dp_shard`` and ``tp``, torchtitan's order) when they come: every size, coordinate and check
here walks ``DIMS``.

The workers get their layout as ``RAY_TRAIN_XLA_LAYOUT`` (``to_text``), planned with the rest of
their environment; ``ray-train-xla plan`` prints each worker's coordinates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ray_train_xla.errors import Term, XLAConfigError

DIMS = ("dp_replicate", "dp_shard", "tp")
REST = -1  # dp_shard: every device the other dimensions leave
# What each dimension is, for messages and docs.
MEANING = {"dp_replicate": "data-parallel replicas (HSDP: each holds the whole sharded model)",
           "dp_shard": "data-parallel shards (FSDP: parameters, gradients and optimizer state "
                       "split over them)",
           "tp": "tensor parallelism (each layer's weights split over a group of devices)"}


def flag(name: str, value: Any = None) -> Term:
    """A dimension (and its size) as the API says it (``tp=2``) and as ``ray-train-xla plan``'s
    flags do (``--tp 2``)."""
    option = "--" + name.replace("_", "-")
    return Term(name if value is None else f"{name}={value}",
                option if value is None else f"{option} {value}")


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """The sizes asked for: ``tp`` devices per tensor-parallel group, ``dp_replicate`` replicas
    (HSDP), and ``dp_shard`` devices per replica's FSDP group (-1: what is left)."""

    dp_replicate: int = 1
    dp_shard: int = REST
    tp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            low = REST if name == "dp_shard" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low or value == 0:
                allowed = "an int >= 1, or -1 for every device the others leave" \
                    if name == "dp_shard" else "an int >= 1"
                raise XLAConfigError("parallelism: ", flag(name, repr(value)),
                                     f" is not valid: expected {allowed}")

    @classmethod
    def of(cls, value: Any, owner: str = "parallelism") -> Parallelism | None:
        """A ``Parallelism`` from what a config or a call takes: None, a ``Parallelism``, or a
        mapping of ``DIMS`` names to sizes (``{"tp": 2}``)."""
        if value is None or isinstance(value, Parallelism):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(DIMS))
            if unknown:
                raise XLAConfigError(f"{owner}: {', '.join(map(repr, unknown))} "
                                     f"{'is' if len(unknown) == 1 else 'are'} not a dimension: "
                                     f"expected {', '.join(DIMS)}")
            return cls(**dict(value))
        raise XLAConfigError(f"{owner}: {value!r} is not valid: expected None, "
                             "ray_train_xla.Parallelism(...) or a dict such as {'tp': 2}")

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def resolve(self, world: int, owner: str | Term = "parallelism") -> Layout:
        """This request for ``world`` devices. Raises XLAConfigError naming the dimension and
        the sizes that would fit (``owner``: who asked, as the message names it)."""
        fixed = math.prod(getattr(self, d) for d in DIMS if getattr(self, d) != REST)
        if world % fixed:
            raise XLAConfigError(
                owner, ": ", self._sizes(), f" needs a multiple of {fixed} devices, but the job "
                f"has {world}: choose sizes whose product divides {world} (", flag("tp"),
                f" among {divisors(world)})")
        shard = world // fixed if self.dp_shard == REST else self.dp_shard
        layout = Layout(dp_replicate=self.dp_replicate, dp_shard=shard, tp=self.tp)
        if layout.world != world:
            raise XLAConfigError(
                owner, ": ", self._sizes(), f" makes {layout.world} devices, but the job has "
                f"{world}: leave ", flag("dp_shard", -1), " to take every device the others "
                "leave")
        return layout

    def _sizes(self) -> Term:
        return Term(", ".join(f"{d}={getattr(self, d)}" for d in DIMS),
                    " ".join(flag(d, getattr(self, d)).plan for d in DIMS))


@dataclass(frozen=True)
class Layout:
    """A layout resolved for a job: the size of each of ``DIMS``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches a step trains on."""
        return self.dp_replicate * self.dp_shard

    @property
    def trivial(self) -> bool:
        """FSDP over every device (or one device): the layout of a job that asks for none."""
        return self.dp_replicate == 1 and self.tp == 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over ``DIMS``, tp innermost)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a layout of {self.world} devices")
        out = {}
        for name, size in reversed(list(zip(DIMS, self.shape))):
            rank, out[name] = divmod(rank, size)
        return {d: out[d] for d in DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel batch this rank trains on (tensor-parallel peers share it)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def group(self, rank: int, dim: str) -> list[int]:
        """The ranks that differ from ``rank`` along ``dim`` only, in order."""
        c = self.coordinates(rank)
        return [self.rank_of({**c, dim: i}) for i in range(getattr(self, dim))]

    def rank_of(self, coordinates: Mapping[str, int]) -> int:
        rank = 0
        for name, size in zip(DIMS, self.shape):
            rank = rank * size + coordinates[name]
        return rank

    def to_text(self) -> str:
        """``dp_replicate=1,dp_shard=4,tp=2``: the form of ``RAY_TRAIN_XLA_LAYOUT``."""
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS)

    @classmethod
    def from_text(cls, text: str) -> Layout:
        sizes = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name.strip() not in DIMS or not value.strip().isdigit():
                raise ValueError(f"not a layout: {text!r} (expected e.g. {Layout().to_text()})")
            sizes[name.strip()] = int(value)
        return cls(**sizes)

    def describe(self) -> str:
        """'TP 2 x FSDP 4' and the like, outermost first."""
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"{self.dp_replicate} replicas")
        parts.append(f"FSDP {self.dp_shard}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        return " x ".join(parts)

    def check_nodes(self, node_of_rank: Sequence[str], owner: str | Term,
                    fix: str | Term = "") -> None:
        """Refuse a layout that splits a tensor-parallel group across nodes. ``node_of_rank``:
        the node of each rank, in rank order (the ranks the process group uses). ``fix``: how
        to change the number of devices per node, in the caller's terms."""
        if self.tp == 1:
            return
        per_node: dict[str, int] = {}
        for node in node_of_rank:
            per_node[node] = per_node.get(node, 0) + 1
        counts = sorted(set(per_node.values()))
        for start in range(0, len(node_of_rank), self.tp):
            nodes = set(node_of_rank[start:start + self.tp])
            if len(nodes) > 1:
                fitting = sorted(set.intersection(*(set(divisors(c)) for c in counts)))
                raise XLAConfigError(
                    owner, ": ", Term("parallelism ", ""), flag("tp", self.tp),
                    f" puts ranks {start} to {start + self.tp - 1} in one tensor-parallel group "
                    f"across {len(nodes)} nodes (they have {', '.join(map(str, counts))} "
                    "devices each): tensor parallelism stays inside a node, on its fast links. "
                    "Use ", flag("tp"), f" among {fitting}", *((", or ", fix) if fix else ()))

    def check_model(self, heads: int, kv_heads: int, mlp: int,
                    owner: str | Term = "parallelism", vocab: int | None = None) -> None:
        """Refuse a ``tp`` that does not divide the model's attention heads, KV heads and MLP
        width (and, for a vocabulary-parallel embedding, its vocabulary)."""
        sizes = {"attention heads": heads, "key/value heads": kv_heads, "MLP width": mlp}
        if vocab is not None:
            sizes["vocabulary"] = vocab
        for what, size in sizes.items():
            if size % self.tp:
                common = [d for d in divisors(math.gcd(*sizes.values()))]
                raise XLAConfigError(
                    owner, ": ", flag("tp", self.tp), f" does not divide the model's {size} "
                    f"{what}: each device of a tensor-parallel group holds an equal part of "
                    "them. Use ", flag("tp"), f" among {common}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
