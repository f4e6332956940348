"""The worker side of ``ray-train-xla check``: the training function each phase runs, one
function per step, each sending what it found to the driver's ``Records`` actor.

Phases (one ``TorchTrainer`` fit each, ``tools/check.py``):

- ``main``: world, correctness, bandwidth, compute, training, and a checkpoint saved through Ray
  at the end of training (its state's digests recorded at the save);
- ``restart``: a fresh worker group of the same size loads that checkpoint (the same-size round
  trip) and trains on from it (graphs compiled, time to first step);
- ``reload``: a fresh worker group of half the size loads the checkpoint.

A step that raises on a worker is recorded with its error and the tail of the worker's log, and
ends that worker's run (the others then fail in their next collective, bounded by the config's
``timeout_s``). What a step finds wrong without raising (a wrong value, a compilation after
warm-up, a state that does not match) is recorded as a failure and the run goes on.

``hooks`` (tests only): an object whose methods, when present, are called at fixed points so that
a test can inject a fault the way it would happen: ``before(step)`` at the start of each step,
``batch(step, tokens)`` on each training batch, ``after_load(model, optimizer)`` after a load.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from typing import Any

from ray_train_xla.tools.demo import Records as DemoRecords

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BANDWIDTH_OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = ("float32", "bfloat16")
WARMUP_STEPS = 2  # training steps that may compile (the first step, then the optimizer's state)
# Elements per rank of the correctness checks: odd and not a power of two, so padding shows and
# no rank's chunk of a periodic pattern looks like another's.
CHECK_ELEMENTS = 1001
# bfloat16 holds every integer up to 256 exactly: its sums are checked exactly up to this world.
BF16_EXACT_WORLD = 256
# The matmul probe: bfloat16 products of this size on accelerators (the dtype of their published
# peaks; 4 a round, 4.4 TFLOP), float32 on the CPU (the dtype of its measured peak).
MATMUL_SIZE = {"accelerator": 8192, "cpu": 512}
MATMUL_SECONDS = 0.5


class StepFailed(Exception):
    """A step could not go on (raised after the step's record was sent)."""


class Records(DemoRecords):
    """The Ray actor every worker sends its findings to (the demo's, see there why an actor),
    which also answers which ranks share a node."""

    def get_all(self) -> list[dict]:
        return list(self.records)

    def nodes(self, phase: str, world_size: int) -> list[list[int]] | None:
        """The ranks of each node (by the plan's node rank), once every worker of ``phase``
        reported its world step; None before."""
        world = [r for r in self.records if r["phase"] == phase and r["step"] == "world"
                 and "node_rank" in r]
        if len(world) < world_size:
            return None
        by_node: dict[int, list[int]] = {}
        for r in world:
            by_node.setdefault(r["node_rank"], []).append(r["rank"])
        return [sorted(by_node[k]) for k in sorted(by_node)]


def _hook(config: dict, name: str, *args):
    fn = getattr(config.get("hooks"), name, None)
    return fn(*args) if fn is not None else None


def _send(config: dict, record: dict) -> None:
    import ray

    ray.get(config["records"].add.remote(record), timeout=config["timeout_s"])


def log_tail(lines: int = 40) -> str:
    """The last ``lines`` lines of this worker's log: the file Ray redirected its stderr to."""
    try:
        path = os.readlink("/proc/self/fd/2")
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def check_loop(config: dict) -> None:
    """The training function of every phase (``config["phase"]``)."""
    import ray.train

    import ray_train_xla as rtx

    phase = config["phase"]
    steps = {"main": (world, correctness, bandwidth, compute, training),
             "restart": (checkpoint_round_trip, restart),
             "reload": (checkpoint_round_trip,)}[phase]
    state: dict[str, Any] = {"loop_start": time.time()}
    ray_rank = ray.train.get_context().get_world_rank()
    for step in steps:
        name = step.__name__.replace("checkpoint_round_trip", "checkpoint")
        head = {"phase": phase, "step": name, "rank": rtx.rank(), "ray_rank": ray_rank}
        start = time.perf_counter()
        try:
            _hook(config, "before", name)
            found = step(config, state) or {}
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            _send(config, {**head, "ok": False, "seconds": time.perf_counter() - start,
                           "error": error, "traceback": traceback.format_exc(limit=8),
                           "log_tail": log_tail()})
            raise StepFailed(f"check step {name!r} failed on this worker: {error}") from exc
        _send(config, {**found, **head, "seconds": time.perf_counter() - start})


# ---- world -----------------------------------------------------------------------------------


def world(config: dict, state: dict) -> dict:
    """Where this worker runs, what Ray gave it, and the environment it has: the driver compares
    it with the plan ``ray-train-xla plan`` computes from the same facts."""
    import dataclasses
    import socket

    import ray.train

    import ray_train_xla as rtx
    from ray_train_xla.startup.facts import gather_facts, gather_native_tpu_facts
    from ray_train_xla.toolkit.observability import timeline

    gather = gather_native_tpu_facts if config["native_tpu"] else gather_facts
    facts = gather(config["timeout_s"], config["device"])
    device = rtx.get_device()
    return {
        "ok": True,
        "facts": dataclasses.asdict(facts),
        "env": dict(os.environ),
        "device": str(device),
        "hostname": socket.gethostname(),
        "local_rank": rtx.local_rank(),
        "node_rank": rtx.node_rank(),
        "world_size": rtx.world_size(),
        "ray_local_rank": ray.train.get_context().get_local_rank(),
        "pid": os.getpid(),
        "instance_type": timeline.instance_type(),
        "versions": versions(),
    }


def versions() -> dict:
    """The versions of what this worker runs (none is imported to learn it)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("ray", "torch", "torch-xla", "torch-neuronx", "libneuronxla", "torch-tpu",
                 "libtpu", "ray-train-xla"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


# ---- collectives -----------------------------------------------------------------------------


def value(rank: int, i: int, world: int, op: str, dtype: str) -> int:
    """Rank ``rank``'s value at place ``i`` for ``op``: integers that differ from rank to rank
    and from place to place (so data sent to the wrong rank or place shows), all exact in
    ``dtype``: below 4093 in float32 (every sum of up to 4,096 ranks is below 2^24), below 251
    in bfloat16, and for bfloat16 reductions 0 or 1 (1 where ``rank < i mod (world + 1)``), so
    that every sum, 0 to ``world``, is exact up to 256 ranks (beyond, see ``checked``) and
    differs from place to place."""
    if dtype == "float32":
        return (rank * 1009 + i) % 4093
    if op in ("all_gather", "broadcast"):
        return (rank * 7 + i) % 251
    return 1 if rank < i % (world + 1) else 0


def pattern(rank: int, count: int, world: int, op: str = "all_reduce",
            dtype: str = "float32") -> list[int]:
    """Rank ``rank``'s ``count`` input values for ``op`` (see ``value``)."""
    return [value(rank, i, world, op, dtype) for i in range(count)]


def checked(op: str, dtype: str, world: int) -> bool:
    """Whether ``op`` in ``dtype`` can be checked exactly on ``world`` ranks."""
    return not (dtype == "bfloat16" and op in ("all_reduce", "reduce_scatter")
                and world > BF16_EXACT_WORLD)


def expected(op: str, rank: int, world: int, count: int, dtype: str = "float32") -> list[int]:
    """The exact result of ``op`` on rank ``rank`` of ``world`` when every rank r contributes
    ``pattern`` (reduce_scatter: ``pattern`` of ``count * world`` values; broadcast: from the
    last rank). Only the places this rank receives are computed: count x world values."""
    if op in ("all_reduce", "reduce_scatter"):
        start = rank * count if op == "reduce_scatter" else 0
        return [sum(value(r, i, world, op, dtype) for r in range(world))
                for i in range(start, start + count)]
    if op == "all_gather":
        return [v for r in range(world) for v in pattern(r, count, world, op, dtype)]
    if op == "broadcast":
        return pattern(world - 1, count, world, op, dtype)
    raise ValueError(op)


def run_op(op: str, tensor, world: int, group=None, out=None):
    """``op`` through torch.distributed on this worker's device, over ``group`` (of ``world``
    ranks; default the whole process group) into ``out`` (allocated when None); returns the
    output tensor."""
    import torch
    import torch.distributed as dist

    if out is None and op in ("all_gather", "reduce_scatter"):
        n = tensor.numel() * world if op == "all_gather" else tensor.numel() // world
        out = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
    if op == "all_reduce":
        dist.all_reduce(tensor, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, tensor, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, tensor, group=group)
    elif op == "broadcast":
        dist.broadcast(tensor, src=world - 1, group=group)
    else:
        raise ValueError(op)
    return tensor if out is None else out


def correctness(config: dict, state: dict) -> dict:
    """Each collective on the device in fp32 and bf16, checked element by element against the
    exact result."""
    import torch

    import ray_train_xla as rtx

    device, n, r = rtx.get_device(), rtx.world_size(), rtx.rank()
    results = []
    for op in OPS:
        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            if not checked(op, dtype_name, n):
                results.append({"op": op, "dtype": dtype_name, "ok": True, "wrong_elements": 0,
                                "first_wrong": None, "skipped": f"bfloat16 sums of {n} ranks "
                                "are not exact"})
                continue
            count = CHECK_ELEMENTS * (n if op == "reduce_scatter" else 1)
            tensor = torch.tensor(pattern(r, count, n, op, dtype_name), dtype=dtype).to(device)
            out = run_op(op, tensor, n)
            rtx.sync()
            got = out.float().cpu().tolist()
            want = [float(v) for v in expected(op, r, n, CHECK_ELEMENTS, dtype_name)]
            wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
            if len(got) != len(want):
                wrong = wrong or [min(len(got), len(want))]
            first = wrong[0] if wrong else None
            results.append({
                "op": op, "dtype": dtype_name, "ok": not wrong, "wrong_elements": len(wrong),
                "first_wrong": None if first is None else {
                    "index": first, "got": got[first] if first < len(got) else None,
                    "expected": want[first] if first < len(want) else None},
            })
    return {"ok": all(x["ok"] for x in results), "results": results}


# ---- bandwidth -------------------------------------------------------------------------------


def sizes(max_bytes: int) -> list[int]:
    """8 B, 16 B, ... up to ``max_bytes`` (powers of two)."""
    return [1 << k for k in range(3, max_bytes.bit_length())]


def iterations(size: int) -> int:
    """Timed repetitions at one size: more for small messages, whose times are short."""
    return 20 if size <= 1 << 20 else 5 if size <= 64 << 20 else 2


def device_memory_bytes() -> int | None:
    """This worker's device memory, where the device says it (XLA, torch.neuron, torch.tpu)."""
    import torch

    from ray_train_xla.planning.contract import worker_context

    ctx = worker_context()
    try:
        if not ctx.native:
            import torch_xla.core.xla_model as xm

            import ray_train_xla as rtx

            info = xm.get_memory_info(rtx.get_device())
            return int(info.get("bytes_limit") or info.get("kb_total", 0) * 1024) or None
        module = getattr(torch, ctx.device, None) if ctx.device in ("neuron", "tpu") else None
        if module is not None and hasattr(module, "mem_get_info"):
            return int(module.mem_get_info()[1])
    except Exception:  # noqa: BLE001 (no figure: the sweep keeps its own cap)
        return None
    return None


def _time_op(op: str, size: int, n: int, device, group=None) -> float:
    """Seconds for one ``op`` of ``size`` bytes (the nccl-tests size: the whole buffer of
    all_gather and reduce_scatter, a multiple of ``4 * n``), the mean of ``iterations(size)``
    after one untimed run (which allocates the output)."""
    import torch
    import torch.distributed as dist

    import ray_train_xla as rtx
    from ray_train_xla.toolkit import device as device_layer

    elements = size // 4
    tensor = torch.ones(elements // n if op == "all_gather" else elements,
                        dtype=torch.float32).to(device)
    out = run_op(op, tensor, n, group)
    rtx.sync()
    device_layer.wait()
    dist.barrier(group=group)
    reps = iterations(size)
    start = time.perf_counter()
    for _ in range(reps):
        run_op(op, tensor, n, group, out)
        rtx.sync()
    device_layer.wait()
    return (time.perf_counter() - start) / reps


def _nodes(config: dict, world_size: int) -> list[list[int]]:
    """Every node's ranks, as the workers reported them in the world step."""
    import ray

    deadline = time.monotonic() + config["timeout_s"]
    while True:
        nodes = ray.get(config["records"].nodes.remote(config["phase"], world_size),
                        timeout=config["timeout_s"])
        if nodes is not None:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every worker reported its node within {config['timeout_s']} s")
        time.sleep(0.2)


def bandwidth(config: dict, state: dict) -> dict:
    """Time all_reduce, all_gather and reduce_scatter from 8 B to ``max_bytes`` (capped at an
    eighth of the device's memory): over every worker, and within each node when the job spans
    several nodes. The driver turns times into algbw and busbw."""
    import torch.distributed as dist

    import ray_train_xla as rtx

    device, n = rtx.get_device(), rtx.world_size()
    memory = device_memory_bytes()
    cap = config["max_bytes"] if memory is None else min(config["max_bytes"], memory // 8)
    scopes = []
    nodes = _nodes(config, n)  # [[ranks of node 0], ...], from the world step's records
    if len(nodes) > 1:
        scopes.append(("across nodes", None, n))
        # Every rank creates every group. torch_xla's backend needs the replica groups of all
        # the nodes (its mesh) for a group of some ranks.
        options = ({"pg_options": {"xla_pg_options": {"mesh": nodes}}}
                   if dist.get_backend() == "xla" else {})
        groups = [dist.new_group(ranks, **options) for ranks in nodes]
        mine = next((g, len(ranks)) for g, ranks in zip(groups, nodes) if rtx.rank() in ranks)
        if mine[1] > 1:
            scopes.append(("within a node", mine[0], mine[1]))
    else:
        scopes.append(("within a node", None, n))
    rows = []
    for scope, group, members in scopes:
        for op in BANDWIDTH_OPS:
            for size in sizes(cap):
                # As nccl-tests: all_gather's and reduce_scatter's buffer is rounded down to a
                # whole number of float32 elements a rank (the size moved is reported).
                moved = size if op == "all_reduce" else size // (4 * members) * 4 * members
                if moved >= 4:
                    rows.append({"scope": scope, "op": op, "bytes": moved, "ranks": members,
                                 "seconds": _time_op(op, moved, members, device, group)})
    return {"ok": True, "rows": rows, "cap_bytes": cap, "device_memory_bytes": memory}


# ---- compute ---------------------------------------------------------------------------------


def worker_peak() -> tuple[float | None, str]:
    """(peak TFLOP/s, where it comes from) of this worker's device, as its timeline takes MFU
    against it: the config's ``peak_tflops`` (``--peak-tflops``), else the device's own."""
    from ray_train_xla.planning.contract import worker_context
    from ray_train_xla.toolkit.observability import timeline

    ctx = worker_context()
    if ctx.peak_tflops:
        return ctx.peak_tflops, "given: --peak-tflops, the config's peak_tflops"
    tl = timeline.active()
    return tl.peak() if tl is not None else timeline.device_peak(ctx.device or "cpu")


def compute(config: dict, state: dict) -> dict:
    """Matmuls on this worker's device (bfloat16 on accelerators, float32 on the CPU), timed,
    and the peak this worker's MFU is taken against: the driver sets one beside the other."""
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.toolkit.observability.flops import matmul_tflops

    kind = "cpu" if config["device"] == "cpu" else "accelerator"
    dtype = torch.float32 if kind == "cpu" else torch.bfloat16
    size = MATMUL_SIZE[kind]
    tflops = matmul_tflops(size, MATMUL_SECONDS, dtype, rtx.get_device())
    peak, source = state["peak"] = worker_peak()  # the training step's MFU takes it
    return {"ok": True, "dtype": str(dtype).removeprefix("torch."), "size": size,
            "tflops": tflops, "peak_tflops": peak, "peak_source": source}


# ---- training, checkpoint, restart -----------------------------------------------------------


def model_config() -> dict:
    from ray_train_xla.tools.examples.train_lm import lm_config

    return lm_config(dim=64, heads=4, layers=2, ff=128, batch_size=8, lr=1e-3)


def build(config: dict):
    """The small transformer and its AdamW, prepared the way the config trains: replicated
    (``prepare_model`` + ``optimizer_step``) under TorchXLAConfig, sharded with FSDP2 per block
    (``prepare_sharded_model``) under the native configs. Returns (model, optimizer, layout)."""
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.tools.examples.train_lm import make_model

    model = make_model(model_config())
    if config["native"]:
        model = rtx.prepare_sharded_model(model, auto_wrap_policy={type(model.blocks[0])})
    else:
        model = rtx.prepare_model(model)
    layout = "FSDP2 (per block)" if config["native"] else "replicated"
    optimizer = torch.optim.AdamW(model.parameters(), lr=model_config()["lr"])
    return model, optimizer, layout


def tokens_for(step: int, rank: int):
    """This rank's batch of ``step``: sequences of the example's synthetic language (the next
    token follows from the previous one, with noise), the same for every run of the check."""
    import numpy as np
    import torch

    from ray_train_xla.tools.examples.train_lm import make_tokens

    b = model_config()["batch_size"]
    ids = np.arange(b) + b * (1_000 * step + rank)
    return torch.from_numpy(make_tokens({"id": ids})["tokens"])


def train_steps(config: dict, model, optimizer, first: int, count: int) -> dict:
    """``count`` steps from step ``first`` (1-based); per step its time and the graphs compiled
    during it, and when the first one ended (Unix seconds)."""
    import ray_train_xla as rtx
    from ray_train_xla.tools.examples.train_lm import lm_loss

    device = rtx.get_device()
    monitor = rtx.CompileMonitor(warmup_steps=0, warn_after=1 << 30)
    compiled, times, losses = [], [], []
    prev, first_step_at = monitor.metrics(0)["xla/compiles"], None
    for step in range(first, first + count):
        start = time.perf_counter()
        tokens = tokens_for(step, rtx.rank())
        changed = _hook(config, "batch", step, tokens)
        tokens = tokens if changed is None else changed
        optimizer.zero_grad()
        loss = lm_loss(model, tokens.to(device))
        loss.backward()
        rtx.optimizer_step(optimizer)
        losses.append(float(loss.detach().float().cpu()))
        times.append(time.perf_counter() - start)
        now = monitor.metrics(step - first + 1)["xla/compiles"]
        compiled.append(now - prev)
        prev = now
        first_step_at = first_step_at or time.time()
    return {"compiled": compiled, "step_seconds": times, "losses": losses,
            "first_step_at": first_step_at}


def time_to_first_step(state: dict, started: float, first_step_at: float) -> dict:
    """The worker group's start to this worker's first training step, without the check's own
    steps before it: the group's set-up (its start to the training function) plus the time from
    ``started`` (building the model, and loading it on a restart) to the first step's end."""
    from ray_train_xla.planning.contract import worker_context

    group_start = worker_context().group_start
    setup = state["loop_start"] - group_start if group_start else None
    to_step = first_step_at - started
    return {"setup_s": setup, "first_step_s": None if setup is None else setup + to_step,
            "build_to_first_step_s": to_step}


def digests(model, optimizer, layout: str) -> dict[str, str] | None:
    """sha256 of every tensor of the full model and optimizer state (names, dtype, shape and
    bytes) and every hyperparameter: two states are equal bit for bit when these are. Sharded
    (FSDP2): the full state, gathered on rank 0 (None elsewhere). Replicated: every rank's own
    copy."""
    import torch

    import ray_train_xla as rtx

    if layout.startswith("FSDP2"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    else:
        model_state = model.state_dict()
        optim_state = optimizer.state_dict()
    if layout.startswith("FSDP2") and rtx.rank() != 0:
        return None
    out: dict[str, str] = {}

    def visit(prefix: str, value) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            out[prefix] = h.hexdigest()
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{prefix}.{i}", v)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[prefix] = repr(value)

    visit("model", model_state)
    visit("optimizer.state", optim_state.get("state", {}))
    visit("optimizer.param_groups", optim_state.get("param_groups", []))
    return out


def step_flops() -> float:
    """The model FLOPs of one training step of this worker (forward and backward of its batch),
    counted by torch's ``FlopCounterMode`` on a copy of the model on the meta device (nothing
    runs, nothing reaches the device)."""
    import torch

    import ray_train_xla as rtx
    from ray_train_xla.tools.examples.train_lm import SEQ, lm_loss, make_model

    with torch.device("meta"):
        model = make_model(model_config())
    tokens = torch.zeros(model_config()["batch_size"], SEQ + 1, dtype=torch.long, device="meta")
    return rtx.count_flops(lambda: lm_loss(model, tokens).backward())


def training(config: dict, state: dict) -> dict:
    """A few steps of the small transformer from a cold start: step times, graphs compiled after
    warm-up (a failure), tokens/s, TFLOP/s and MFU (this worker's model FLOPs over its median
    step after warm-up, against the peak of the compute step); then a checkpoint saved through
    Ray (``save_checkpoint``)."""
    import statistics

    import ray_train_xla as rtx
    from ray_train_xla.tools.examples.train_lm import SEQ

    started = time.time()
    model, optimizer, layout = build(config)
    steps = config["train_steps"]
    run = train_steps(config, model, optimizer, 1, steps)
    late = [(i + 1, c) for i, c in enumerate(run["compiled"]) if i >= WARMUP_STEPS and c]
    measured = run["step_seconds"][WARMUP_STEPS:]
    tokens = model_config()["batch_size"] * SEQ * rtx.world_size() * len(measured)
    flops = step_flops()
    tflops = flops / statistics.median(measured) / 1e12 if measured else None
    peak, source = state.get("peak") or worker_peak()
    digest = digests(model, optimizer, layout)
    rtx.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "step": steps}, {"step": steps, "check": "training"}, wait=True)
    return {
        "ok": not late, "layout": layout, "train_steps": steps, "warmup_steps": WARMUP_STEPS,
        "compiled_per_step": run["compiled"], "recompiled_at": late,
        "step_seconds": run["step_seconds"], "losses": run["losses"],
        "tokens_per_s": tokens / sum(measured) if measured and sum(measured) else None,
        "flops_per_step": flops, "tflops_per_s": tflops, "peak_tflops": peak,
        "peak_source": source, "mfu": tflops / peak if tflops and peak else None,
        **time_to_first_step(state, started, run["first_step_at"]),
        "cold_compiles": sum(run["compiled"]), "digest": digest,
    }


def checkpoint_round_trip(config: dict, state: dict) -> dict:
    """Load the main phase's checkpoint into a fresh model and optimizer on this worker group
    and digest the state: the driver compares it with the digest taken at the save."""
    import ray_train_xla as rtx

    state["started"] = time.time()
    model, optimizer, layout = build(config)
    start = time.perf_counter()
    rest = rtx.load_checkpoint(model, optimizer, checkpoint=config["checkpoint"])
    seconds = time.perf_counter() - start
    _hook(config, "after_load", model, optimizer)
    state.update(model=model, optimizer=optimizer, step=(rest or {}).get("step", 0))
    return {"ok": True, "layout": layout, "world_size": rtx.world_size(),
            "load_seconds": seconds, "digest": digests(model, optimizer, layout),
            "resumed_at_step": state["step"]}


def restart(config: dict, state: dict) -> dict:
    """Train on from the loaded checkpoint: the graphs the restarted group compiles (the driver
    compares them with the cold start's and with what a persistent compile cache allows) and the
    time from the group's start to the end of its first step (set-up, model, load, step)."""
    run = train_steps(config, state["model"], state["optimizer"], state["step"] + 1,
                      config["restart_steps"])
    return {"ok": True, "compiled_per_step": run["compiled"], "warm_compiles": sum(run["compiled"]),
            **time_to_first_step(state, state["started"], run["first_step_at"]),
            "step_seconds": run["step_seconds"], "losses": run["losses"]}
