"""``ray-train-xla check``: prove that a cluster trains, through Ray Train's own worker set-up.

Three ``TorchTrainer`` fits of :func:`check_steps.check_loop` (its phases ``main``, ``restart``
and ``reload`` are described there) on the chosen config; then the driver judges each step
(:func:`judge`): the world against the plan computed from the workers' own facts, the
collectives' values, algbw and busbw against the hardware's published figures, matmul TFLOP/s
and MFU against the device's peak (reported, not judged), compilations after warm-up, the
loaded state's digests against the saved one's, and the restart's compilations against the
persistent compile cache the device has. Every wait is bounded by ``--timeout`` (``timeout_s``
of the config).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ray_train_xla.errors import run_failure
from ray_train_xla.tools import check_report as report
from ray_train_xla.tools import check_steps as steps
from ray_train_xla.tools.args import (
    CommandError,
    positive_float,
    positive_int,
    positive_seconds,
    where,
)
from ray_train_xla.tools.examples.cluster import (
    CONFIG_CLASSES,
    CONFIG_DEVICES,
    ExampleUsageError,
    add_cluster_args,
    add_config_arg,
    check_cluster,
)


class CheckUsageError(ValueError):
    """A check that cannot run as asked (refused before any worker starts)."""


@dataclass
class CheckOptions:
    config: str = "xla"
    device: str = "auto"
    workers: int = 2
    accelerators_per_worker: int = 1
    address: str | None = None
    tpu_topology: str | None = None
    accelerator_type: str | None = None
    out: str = "ray-train-xla-check"
    storage_path: str | None = None
    max_bytes: int = 1 << 30
    timeout_s: float = 300.0
    train_steps: int = 8
    restart_steps: int = 3
    peak_tflops: float | None = None  # the config's peak_tflops (None: the device's own)

    def validate(self) -> None:
        if self.config not in CONFIG_DEVICES:
            raise CheckUsageError(
                f"--config {self.config!r}: expected one of {', '.join(CONFIG_DEVICES)}")
        if self.device != "auto" and self.device not in CONFIG_DEVICES[self.config]:
            raise CheckUsageError(
                f"--config {self.config} runs on --device "
                f"{' or '.join(CONFIG_DEVICES[self.config])}, not {self.device}")
        if self.train_steps <= steps.WARMUP_STEPS:
            raise CheckUsageError(f"train_steps must exceed the {steps.WARMUP_STEPS} warm-up steps")
        if self.max_bytes < 8:
            raise CheckUsageError(f"--max-bytes {self.max_bytes}: at least 8 bytes")


def torch_config(options: CheckOptions, device: str):
    """The config object the check runs (``device`` resolved)."""
    import ray_train_xla

    if device not in CONFIG_DEVICES[options.config]:
        raise CheckUsageError(f"--config {options.config} cannot run on this cluster's "
                              f"device, {device} (it runs on "
                              f"{' or '.join(CONFIG_DEVICES[options.config])})")
    cls = getattr(ray_train_xla, CONFIG_CLASSES[options.config])
    return cls(device=device, timeout_s=options.timeout_s, peak_tflops=options.peak_tflops)


def run_check(options: CheckOptions, hooks: Any = None) -> dict[str, Any]:
    """Run the check and return its result (``report.json``'s content); writes the report files
    under ``options.out``. ``hooks``: see ``check_steps`` (tests inject faults with it)."""
    import ray

    from ray_train_xla.tools.examples.cluster import ray_session, resolve_device, scaling_config

    options.validate()
    started, clock = time.strftime("%Y-%m-%d %H:%M:%S %Z"), time.perf_counter()
    out_dir = os.path.abspath(options.out)
    os.makedirs(out_dir, exist_ok=True)
    storage = options.storage_path or os.path.join(out_dir, "storage")
    with ray_session(options.address, num_cpus=max(2, options.workers + 1), log_to_driver=False):
        device = resolve_device(options.device)
        config = torch_config(options, device)
        check_resources(device, options)
        records = ray.remote(steps.Records).options(num_cpus=0).remote()
        common = {"records": records, "hooks": hooks, "timeout_s": options.timeout_s,
                  "device": device, "native": options.config != "xla",
                  "native_tpu": options.config == "tpu" and device == "tpu",
                  "max_bytes": options.max_bytes, "train_steps": options.train_steps,
                  "restart_steps": options.restart_steps}

        def fit(phase: str, workers: int, **extra) -> tuple[Any, str | None]:
            from ray.train import RunConfig
            from ray.train.torch import TorchTrainer

            try:
                scaling = scaling_config(device, workers, options.accelerators_per_worker,
                                         options.tpu_topology, options.accelerator_type)
                trainer = TorchTrainer(
                    steps.check_loop, train_loop_config={**common, "phase": phase, **extra},
                    torch_config=config, scaling_config=scaling,
                    run_config=RunConfig(storage_path=storage,
                                         name=f"check-{phase}-{int(time.time())}",
                                         failure_config=no_retries()))
                return trainer.fit(), None
            except Exception as exc:  # a failed phase is a finding, reported by step
                return None, run_failure(exc)

        errors: dict[str, str | None] = {}
        result_main, errors["main"] = fit("main", options.workers)
        checkpoint = result_main.checkpoint if result_main is not None else None
        if checkpoint is not None:
            _, errors["restart"] = fit("restart", options.workers, checkpoint=checkpoint)
            if half := reload_workers(options, device):
                _, errors["reload"] = fit("reload", half, checkpoint=checkpoint)
        found = ray.get(records.get_all.remote(), timeout=options.timeout_s)
        ray.kill(records)
    result = judge(options, config, device, found, errors)
    result.update(started=started, seconds=time.perf_counter() - clock,
                  versions=steps.versions(), storage=storage)
    result["files"] = report.write_report(result, out_dir)
    return result


def reload_workers(options: CheckOptions, device: str) -> int:
    """The workers of the half-size reload; 0 when there is none: one worker, or a TPU slice,
    whose workers Ray reserves whole (half of them is not a group it places)."""
    return 0 if device == "tpu" else options.workers // 2


def no_retries():
    """Neither a worker failure nor a controller failure (a worker group that cannot start,
    which Ray Train V2 would otherwise retry without end) is retried."""
    from ray.train import FailureConfig

    try:
        return FailureConfig(max_failures=0, controller_failure_limit=0)  # Ray Train V2
    except TypeError:
        return FailureConfig(max_failures=0)  # V1 has no controller


def check_resources(device: str, options: CheckOptions) -> None:
    """Refuse, before any worker starts, a check the cluster has not the resources for (Ray
    would wait for them)."""
    import ray

    from ray_train_xla.tools.examples.cluster import NEURON_RESOURCE, TPU_RESOURCE

    have = ray.cluster_resources()
    per_worker = {"CPU": 1.0}
    if device in ("neuron", "tpu"):
        per_worker[NEURON_RESOURCE if device == "neuron" else TPU_RESOURCE] = \
            float(options.accelerators_per_worker)
    for name, amount in per_worker.items():
        if have.get(name, 0.0) < amount * options.workers:
            raise CheckUsageError(
                f"{options.workers} workers need {amount * options.workers:g} {name} in all; "
                f"the cluster has {have.get(name, 0.0):g}: give fewer --workers"
                + (" or --accelerators-per-worker" if name != "CPU" else ""))


# ---- judging -----------------------------------------------------------------------------------


def _by(found: list[dict], phase: str, step: str) -> list[dict]:
    return sorted((r for r in found if r["phase"] == phase and r["step"] == step),
                  key=lambda r: r["ray_rank"])


# What a rank's collective raises when a peer left it (a peer that failed first, its group
# destroyed): an effect, listed after the errors that may be the cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _failed_records(records: list[dict]) -> list[str]:
    """Each failed rank's error, those of ranks whose peers left them last."""
    failed = sorted((r for r in records if r.get("error")),
                    key=lambda r: any(text in r["error"] for text in PEER_LOST))
    return [f"rank {r['rank']}: {r['error']}" for r in failed]


def _step(name: str, records: list[dict], workers: int, failures: list[str], summary: str,
          **more) -> dict:
    """A judged step: ok when nothing failed and every worker reported."""
    return {"name": name, "ok": not failures and len(records) == workers, "summary": summary,
            "failures": failures, "seconds": max(r["seconds"] for r in records), **more}


def _not_run(name: str, why: str) -> dict:
    return {"name": name, "ok": None, "summary": f"not run: {why}", "failures": []}


def judge(options: CheckOptions, config, device: str, found: list[dict],
          errors: dict[str, str | None]) -> dict[str, Any]:
    """The result: one entry per step (``ok``: True, False, or None when it did not run)."""
    workers = options.workers
    world = _by(found, "main", "world")
    world_step, planned_env = judge_world(config, world, workers)
    out_steps = [world_step]
    for name, judge_step in (("correctness", judge_correctness), ("bandwidth", judge_bandwidth),
                             ("compute", judge_compute), ("training", judge_training)):
        records = _by(found, "main", name)
        out_steps.append(judge_step(records, workers, world) if records else
                         _missing(name, "main", errors, found))
    training = _by(found, "main", "training")
    out_steps += [judge_checkpoint(found, training, errors, workers, reload_workers(options, device)),
                  judge_restart(found, training, errors, device, options.config)]
    reported = [w for w in world if not w.get("error")]
    return {
        "ok": all(s.get("ok") is True for s in out_steps),
        "config": CONFIG_CLASSES[options.config], "device": device, "workers": workers,
        "nodes": len({w["facts"]["node_id"] for w in reported}), "steps": out_steps,
        "planned_env": planned_env,
        "failing_workers": [{"rank": r["rank"], "phase": r["phase"], "step": r["step"],
                             "error": r["error"], "log_tail": r.get("log_tail", "")}
                            for r in found if r.get("error")],
        "phase_errors": {p: e for p, e in errors.items() if e},
        "worker_versions": reported[0].get("versions", {}) if reported else {},
        "options": dict(vars(options)),
    }


def _missing(name: str, phase: str, errors: dict, found: list[dict]) -> dict:
    failed = [r for r in found if r["phase"] == phase and r.get("error")]
    if failed:
        return _not_run(name, f"step {failed[0]['step']!r} failed before it")
    if errors.get(phase):
        return {"name": name, "ok": False, "summary": f"the {phase} run failed: {errors[phase]}",
                "failures": [errors[phase]]}
    return _not_run(name, f"no worker reported it (the {phase} run did not start)")


def planned_for(config, world: list[dict]) -> list[dict[str, str]]:
    """Every worker's environment as ``ray-train-xla plan`` computes it from the facts the
    workers reported, with the values chosen at this start (ports, run id, clocks) taken from
    the workers (only their agreement can be checked)."""
    import dataclasses

    from ray_train_xla.planning.planner import Rendezvous, get_runtime, plan, resolve_device
    from ray_train_xla.planning.topology import Topology, WorkerFacts

    fields = {f.name for f in dataclasses.fields(WorkerFacts)}
    facts = [WorkerFacts(**{k: v for k, v in w["facts"].items() if k in fields}) for w in world]
    device = resolve_device(config.device, facts, config.runtime,
                            getattr(config, "native_device", "neuron"))
    runtime = get_runtime(device, config.runtime)
    topology = Topology.from_facts(facts, runtime.resource)
    master = runtime.master_worker(topology)
    env = world[master]["env"]
    extra = []
    if runtime.ports_needed(config):
        port = (env.get("NEURON_RT_ROOT_COMM_ID", "").rpartition(":")[2]
                or env.get("TORCH_TPU_INTERNAL_HANDSHAKE_PORT", ""))
        extra = [int(port)] if port.isdigit() else [0]
    rdzv = Rendezvous(
        master_addr=facts[master].node_ip, master_port=int(env.get("MASTER_PORT", "0") or 0),
        extra_ports=tuple(extra), run_id=env.get("TORCHELASTIC_RUN_ID", ""),
        started_at=float(env.get("RAY_TRAIN_XLA_GROUP_START", 0) or 0),
        run_started_at=float(env.get("RAY_TRAIN_XLA_RUN_START", 0) or 0))
    return [p.env for p in plan(topology, config, rdzv, device, facts)]


def judge_world(config, world: list[dict], workers: int) -> tuple[dict, list[dict]]:
    if not world:
        return {"name": "world", "ok": False, "summary": "no worker reported", "failures": []}, []
    failures = _failed_records(world)
    ok_records = [w for w in world if not w.get("error")]
    planned: list[dict] = []
    if len(ok_records) == len(world):
        try:
            planned = planned_for(config, world)
        except Exception as exc:  # noqa: BLE001 (the plan itself refused the workers' facts)
            failures.append(f"the plan refused the workers' facts: {type(exc).__name__}: {exc}")
        failures += report.compare_world([w["env"] for w in world], planned) if planned else []
    if len(world) != workers:
        failures.append(f"{len(world)} of {workers} workers reported")
    ranks = sorted(w["rank"] for w in ok_records)
    if ranks != list(range(len(ok_records))):
        failures.append(f"ranks {ranks}: expected 0..{len(ok_records) - 1}, each once")
    rows = [{k: w[k] for k in ("rank", "local_rank", "node_rank", "device", "hostname")}
            for w in ok_records]
    nodes = len({w["facts"]["node_id"] for w in ok_records})
    keys = sum(len(p) for p in planned)
    summary = (f"{len(ok_records)} workers on {nodes} node(s), devices "
               f"{', '.join(sorted({w['device'] for w in ok_records}))}; "
               + (f"{keys} planned variables as the plan says" if not failures else
                  f"{len(failures)} difference(s) from the plan"))
    return ({"name": "world", "ok": not failures, "summary": summary, "failures": failures,
             "workers": rows, "seconds": max((w["seconds"] for w in world), default=None)},
            planned)


def judge_correctness(records: list[dict], workers: int, world: list[dict]) -> dict:
    failures = _failed_records(records)
    checked = 0
    for r in records:
        for x in r.get("results", []):
            checked += 1
            if not x["ok"]:
                w = x["first_wrong"] or {}
                failures.append(
                    f"rank {r['rank']}: {x['op']} {x['dtype']}: {x['wrong_elements']} wrong "
                    f"element(s), the first at index {w.get('index')}: got {w.get('got')}, "
                    f"expected {w.get('expected')}")
    ops = sorted({x["op"] for r in records for x in r.get("results", [])})
    return _step("correctness", records, workers, failures,
                 f"{', '.join(ops)} in float32 and bfloat16: {checked} results exact"
                 if not failures else f"{len(failures)} wrong result(s)")


def _hardware(world: list[dict]) -> tuple[str, str]:
    """(instance type, TPU type) of the first worker that reported its world."""
    first = next((w for w in world if not w.get("error")), None)
    return ("", "") if first is None else (first.get("instance_type", ""),
                                           first["facts"].get("tpu_accelerator_type", ""))


def judge_bandwidth(records: list[dict], workers: int, world: list[dict]) -> dict:
    failures = _failed_records(records)
    times: dict[tuple, list[float]] = {}
    for r in records:
        for row in r.get("rows", []):
            # Nodes of different sizes time different groups: the group size is in the key.
            key = (row["scope"], row["op"], row["bytes"], row["ranks"])
            times.setdefault(key, []).append(row["seconds"])
    rows = []
    for (scope, op, size, ranks), seconds in times.items():
        slowest = max(seconds)  # a collective ends when its slowest rank does
        algbw, busbw = report.bus_bandwidth(op, size, slowest, ranks)
        rows.append({"scope": scope, "op": op, "bytes": size, "ranks": ranks,
                     "seconds": slowest, "algbw": algbw, "busbw": busbw})
    comparisons = []
    instance, tpu = _hardware(world)
    for scope in dict.fromkeys(r["scope"] for r in rows):
        peak = max((r for r in rows if r["scope"] == scope), key=lambda r: r["busbw"])
        figure = report.published_for(instance, tpu, scope)
        text = (f"{scope}: peak busbw {peak['busbw']:.3g} GB/s ({peak['op']}, {peak['bytes']} B)")
        if figure is None:
            text += (f"; no published figure for this hardware ({instance or tpu or 'cpu'})")
        else:
            text += (f", {100 * peak['busbw'] / figure.gb_s:.1f}% of {figure.gb_s:.4g} GB/s "
                     f"({figure.as_published}; {figure.source})")
        comparisons.append(text)
    largest = max((r["bytes"] for r in rows), default=0)
    return _step("bandwidth", records, workers, failures,
                 f"{len(rows)} timings, 8 B to {largest} B; " + "; ".join(comparisons)
                 if rows else "no timings",
                 rows=sorted(rows, key=lambda r: (r["scope"], r["op"], r["ranks"], r["bytes"])),
                 comparisons=comparisons)


def _peak_text(peak: float | None, source: str) -> str:
    return (f"the peak {peak:.3g} TFLOP/s ({source})" if peak else
            f"no peak known ({source}): give --peak-tflops")


def judge_compute(records: list[dict], workers: int, world: list[dict]) -> dict:
    """Each worker's matmul TFLOP/s beside the peak its MFU is taken against (reported, not
    judged: a share far from 100% says the peak or the device is not what was thought)."""
    failures = _failed_records(records)
    ok = [r for r in records if not r.get("error")]
    if not ok:
        return _step("compute", records, workers, failures, "no worker measured")
    rows = [{"rank": r["rank"], "tflops": r["tflops"], "peak_tflops": r["peak_tflops"],
             "share": r["tflops"] / r["peak_tflops"] if r["peak_tflops"] else None}
            for r in ok]
    r0, rates = ok[0], [r["tflops"] for r in ok]
    summary = (f"{r0['dtype']} matmuls of {r0['size']}x{r0['size']}: "
               f"{statistics.median(rates):.3g} TFLOP/s per device (median of {len(ok)}"
               + (f"; {min(rates):.3g} to {max(rates):.3g})" if len(ok) > 1 else ")"))
    shares = [row["share"] for row in rows if row["share"] is not None]
    peaks = [r["peak_tflops"] for r in ok if r["peak_tflops"]]
    if shares:
        summary += (f", {100 * statistics.median(shares):.0f}% of "
                    + _peak_text(statistics.median(peaks), r0["peak_source"]))
    else:
        summary += "; " + _peak_text(None, r0["peak_source"])
    return _step("compute", records, workers, failures, summary, rows=rows,
                 tflops=statistics.median(rates), dtype=r0["dtype"], size=r0["size"],
                 peak_tflops=statistics.median(peaks) if peaks else None,
                 peak_source=r0["peak_source"])


def judge_training(records: list[dict], workers: int, world: list[dict]) -> dict:
    failures = _failed_records(records)
    for r in records:
        for step, count in r.get("recompiled_at", []):
            failures.append(f"rank {r['rank']}: step {step} compiled {count} graph(s) after the "
                            f"{r['warmup_steps']} warm-up steps (every step after warm-up must "
                            "reuse its graphs)")
    ok = [r for r in records if not r.get("error")]
    if not ok:
        return _step("training", records, workers, failures, "no worker trained")
    r0 = ok[0]
    step_s = statistics.median(t for r in ok for t in r["step_seconds"][r["warmup_steps"]:])
    losses = r0["losses"]
    for r in ok:
        if not all(map(math.isfinite, r["losses"])):
            failures.append(f"rank {r['rank']}: a loss is not finite: {r['losses']}")
    tflops = [r["tflops_per_s"] for r in ok if r.get("tflops_per_s")]
    mfus = [r["mfu"] for r in ok if r.get("mfu") is not None]
    mfu = statistics.median(mfus) if mfus else None
    peaks = [r["peak_tflops"] for r in ok if r.get("peak_tflops")]
    compute = ""
    if tflops:
        compute = (f"; {r0['flops_per_step']:.3g} model FLOPs a step, "
                   f"{statistics.median(tflops):.3g} TFLOP/s per device, "
                   + (f"MFU {100 * mfu:.2f}% of "
                      + _peak_text(statistics.median(peaks), r0["peak_source"])
                      if mfu is not None and peaks else
                      "no MFU: " + _peak_text(None, r0["peak_source"])))
    return _step("training", records, workers, failures,
                 f"{r0['layout']}, {r0['train_steps']} steps: median step {step_s * 1e3:.1f} ms, "
                 f"{r0['tokens_per_s']:.0f} tokens/s, loss {losses[0]:.3f} -> "
                 f"{losses[-1]:.3f}, graphs compiled per step {r0['compiled_per_step']}" + compute,
                 first_step_s=r0["first_step_s"], tokens_per_s=r0["tokens_per_s"],
                 median_step_s=step_s, flops_per_step=r0.get("flops_per_step"),
                 tflops_per_s=statistics.median(tflops) if tflops else None, mfu=mfu,
                 mfu_by_rank={r["rank"]: r.get("mfu") for r in ok})


def _compare_digests(saved: dict, loaded: dict) -> list[str]:
    differ = sorted(k for k in saved if loaded.get(k) != saved[k])
    extra = sorted(set(loaded) - set(saved))
    out = []
    if differ:
        out.append(f"{len(differ)} of {len(saved)} tensors differ from the saved state: "
                   f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}")
    if extra:
        out.append(f"not in the saved state: {', '.join(extra[:6])}")
    return out


def judge_checkpoint(found: list[dict], training: list[dict], errors: dict, workers: int,
                     half: int | None = None) -> dict:
    """Every loaded state (each rank's own copy when replicated, the gathered full state when
    sharded) against the state saved (rank 0's digest at the save)."""
    saved = next((r.get("digest") for r in sorted(training, key=lambda r: r["rank"])
                  if r.get("digest")), None)
    if saved is None:
        return _missing("checkpoint", "main", errors, found) if not training else \
            _not_run("checkpoint", "the training step saved no checkpoint")
    half = workers // 2 if half is None else half
    failures, parts, seconds = [], [], []
    for phase, size in [("restart", workers)] + ([("reload", half)] if half else []):
        records = _by(found, phase, "checkpoint")
        failed = _failed_records(records)
        failures += failed
        loaded = [r for r in records if r.get("digest")]
        seconds += [r["seconds"] for r in records]
        if not loaded:
            if not failed:
                failures.append(f"at {size} worker(s): no state loaded"
                                + (f" ({errors[phase]})" if errors.get(phase) else ""))
            continue
        diff = [f"at {size} worker(s), rank {r['rank']}: {d}" for r in loaded
                for d in _compare_digests(saved, r["digest"])]
        failures += diff
        if not diff:
            parts.append(f"at {size} worker(s): equal bit for bit")
    if not half:
        parts.append("no half-size reload (one worker, or a TPU slice, which Ray reserves whole)")
    return {"name": "checkpoint", "ok": not failures,
            "summary": (f"{len(saved)} tensors and settings saved through Ray; "
                        + "; ".join(parts))
            if not failures else f"{len(failures)} problem(s) reloading the checkpoint",
            "failures": failures, "seconds": max(seconds, default=None)}


# Where a restarted worker group finds the graphs it compiled before: (device, config) -> what.
PERSISTENT_CACHE = {("tpu", "xla"): "torch_xla's persistent compile cache (XLA_PERSISTENT_CACHE_PATH)"}


def judge_restart(found: list[dict], training: list[dict], errors: dict, device: str,
                  config: str) -> dict:
    records = _by(found, "restart", "restart")
    if not records:
        return _missing("restart", "restart", errors, found) if training else \
            _not_run("restart", "the training step did not run")
    failures = _failed_records(records)
    ok = [r for r in records if not r.get("error")]
    if not ok or not training:
        return {"name": "restart", "ok": False, "summary": "no worker restarted",
                "failures": failures}
    cold = max(t["cold_compiles"] for t in training)
    warm = max(r["warm_compiles"] for r in ok)
    cold_s = max((t["first_step_s"] for t in training if t.get("first_step_s")), default=None)
    warm_s = max((r["first_step_s"] for r in ok if r.get("first_step_s")), default=None)
    cache = PERSISTENT_CACHE.get((device, config))
    if cache is not None and warm:
        failures.append(f"the restarted group compiled {warm} graph(s) that {cache} should "
                        f"have held (the cold start compiled {cold})")
    elif cache is None and warm > cold:
        failures.append(f"the restarted group compiled {warm} graph(s), more than the cold "
                        f"start's {cold}")
    where = (f"graphs from {cache}" if cache else
             "nothing compiled (eager)" if cold == 0 else
             f"no persistent compile cache on this device: the cold start's graphs compiled "
             f"again ({warm} of {cold})")
    timing = (f"time to first step: cold {cold_s:.1f} s, warm {warm_s:.1f} s"
              if cold_s is not None and warm_s is not None else "time to first step unknown")
    return {"name": "restart", "ok": not failures,
            "summary": f"{where}; {timing}", "failures": failures,
            "cold_first_step_s": cold_s, "warm_first_step_s": warm_s,
            "cold_compiles": cold, "warm_compiles": warm,
            "seconds": max(r["seconds"] for r in records)}


# ``ray-train-xla check``: its parser and its command.
def _size(text: str) -> int:
    """A byte count: digits with an optional K, M or G (powers of 2, with or without iB)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in ("K", "M", "G") else ""
    digits = body[:-1] if unit else body
    if not digits.isdigit() or int(digits) * units[unit] < 8:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of at least 8 bytes (e.g. 8, "
                                         "64K, 256MiB, 1G)")
    return int(digits) * units[unit]


def add_parser(sub) -> argparse.ArgumentParser:
    """``check``: prove a cluster trains, with a report to send back."""
    check = sub.add_parser(
        "check",
        help="run the cluster check: world, collectives, bandwidth, compute, training, "
        "checkpoint, restart; writes report.md, report.json and bandwidth.png",
        description="Start a TorchTrainer with the chosen config (TorchXLAConfig, "
        "TorchNeuronConfig or TorchTPUConfig) on an embedded local Ray (or the cluster at "
        "--address), every worker asking Ray for its accelerators, and run in order: world "
        "(every worker's rank, node, device and environment against the plan computed from "
        "its own facts), correctness (all_reduce, all_gather, reduce_scatter, broadcast in "
        "float32 and bfloat16, exact), bandwidth (all_reduce, all_gather, reduce_scatter from "
        "8 B to --max-bytes, capped at an eighth of device memory; algbw and busbw as "
        "nccl-tests define them, within a node and across nodes, against the hardware's "
        "published figure where known), compute (matmuls on each device, bfloat16 on "
        "accelerators and float32 on the CPU, in TFLOP/s against the device's peak: "
        "--peak-tflops, else the published figure, else on the CPU a probe), training (a small "
        "transformer, replicated under TorchXLAConfig, FSDP2 under the native configs: step "
        "time, tokens/s, TFLOP/s and MFU, no graph compiled after warm-up), checkpoint (saved "
        "through Ray, loaded on a fresh worker group of the same and of half the size, "
        "compared bit for bit) and restart (the "
        "graphs the restarted group compiles, cold and warm time to first step). Prints a "
        "table and writes report.md, report.json and bandwidth.png under --out. Exits 0 only "
        "when every step passes, 1 when one fails, 2 when the check cannot run as asked, "
        "refused before any worker starts (a wrong option, --config and --device that do not "
        "go together, a TPU slice without its topology, more workers than the cluster has).",
    )
    add_config_arg(check)
    check.add_argument("--workers", type=positive_int, default=2,
                       help="workers of the main run (default 2); the reload runs half of them")
    check.add_argument("--accelerators-per-worker", type=positive_int, default=1, metavar="N",
                       help="NeuronCores or TPU chips each worker asks Ray for (default 1)")
    check.add_argument("--out", default="ray-train-xla-check", metavar="DIR",
                       help="where report.md, report.json, bandwidth.png and (without "
                       "--storage-path) the checkpoints go (default ./ray-train-xla-check)")
    check.add_argument("--storage-path", default=None, metavar="PATH",
                       help="the runs' storage (RunConfig.storage_path): on several nodes a path "
                       "every node reaches (shared filesystem, s3://, gs://); default OUT/storage")
    check.add_argument("--max-bytes", type=_size, default=1 << 30, metavar="SIZE",
                       help="largest message of the bandwidth sweep (default 1GiB)")
    check.add_argument("--timeout", type=positive_seconds, default=300.0, metavar="SECONDS",
                       help="the config's timeout_s: bound on the process group's start, on "
                       "gloo's collectives (not the device's) and on each answer to the driver "
                       "(default 300)")
    check.add_argument("--peak-tflops", type=positive_float, default=None, metavar="TFLOPS",
                       help="the peak TFLOP/s of one device that matmuls and MFU are set "
                       "against, given to the workers as the config's peak_tflops (default: "
                       "the published bf16 figure of the TPU or Trainium the workers find, on "
                       "the CPU a float32 matmul probe)")
    check.add_argument("--json", action="store_true", help="print report.json's content")
    add_cluster_args(check, device_default="auto", device_of="the device of the --config "
                     "(TorchXLAConfig.device, TorchNeuronConfig.device or TorchTPUConfig.device)")
    return check


def cmd_check(args: argparse.Namespace) -> int:
    options = CheckOptions(
        config=args.config, device=args.device, workers=args.workers,
        accelerators_per_worker=args.accelerators_per_worker, address=args.address,
        tpu_topology=args.tpu_topology, accelerator_type=args.accelerator_type, out=args.out,
        storage_path=args.storage_path, max_bytes=args.max_bytes, timeout_s=args.timeout,
        peak_tflops=args.peak_tflops)
    try:
        options.validate()
        check_cluster(args.device, args.workers, args.tpu_topology, args.accelerator_type)
        if not args.json:
            print(f"ray-train-xla check: {CONFIG_CLASSES[args.config]}, {args.workers} workers, "
                  f"device={args.device}, on {where(args)}...", flush=True)
        result = run_check(options)
    except (CheckUsageError, ExampleUsageError) as exc:
        raise CommandError(str(exc)) from exc
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(report.to_table(result))
        for step in result["steps"]:
            for failure in step.get("failures", []):
                print(f"  {step['name']}: {failure}")
        print(f"\nreport: {', '.join(result['files'].values())}")
    return 0 if result["ok"] else 1
