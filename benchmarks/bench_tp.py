"""Tensor parallelism against FSDP on the CPU twins: each worker's peak host memory, loading and
training the same model as FSDP 4 and as TP 2 x FSDP 2, and the step time of the two layouts,
with a control (the same FSDP 4 run twice).

Ray Train fits of 4 workers x 1 CPU under ``TorchNeuronConfig(device="cpu")`` (gloo, one torch
thread a worker: Ray sets ``OMP_NUM_THREADS`` to a worker's CPUs), in this order each round
(``--rounds``): FSDP 4 (no ``parallelism``), TP 2 x FSDP 2 (``parallelism={"tp": 2}``), FSDP 4
again (the control). Each fit loads the same Llama (hidden 256, 8 heads, 4 KV heads, 4 layers,
MLP 768, vocabulary 2048; saved by ``save_pretrained`` in fp32) with ``rtx.load_pretrained`` on
a model built on the meta device (each decoder layer an FSDP2 unit; under TP the model's own
Hugging Face plan), then trains ``--warmup`` untimed and ``--steps`` timed AdamW steps with
``rtx.clip_grad_norm_``, on a global batch of 16 rows of 128 tokens a step: 4 rows a
data-parallel rank under FSDP 4, 8 under TP 2 x FSDP 2 (the same rows, split by
``rtx.data_parallel()``).

Per worker: ``VmRSS`` just before the load, where the peak is reset (``/proc/self/clear_refs``),
then ``VmHWM`` after the load and after the training (``/proc/<pid>/status``: the peak since the
reset), and the bytes of the shards it holds (parameters and AdamW state). Step time: each
step's time on the slower rank (from one step's end to the next), the median over the timed
steps with the 90% bootstrap interval of the median (``figures.interval``); the ratio TP / FSDP
of the medians beside the control's FSDP / FSDP, each with the 90% bootstrap interval of the
ratio of medians. The loss of each step (the mean over the data-parallel ranks) too: both
layouts train the same model on the same rows, so the losses agree to rounding.

Writes ``tp.json`` and ``tp.md`` under ``--out`` (``--markdown``: ``tp.md`` again from
``tp.json``, measuring nothing). It starts Ray: run it alone (``flock /tmp/ray-tests.lock``).

    python benchmarks/bench_tp.py [--rounds 2] [--steps 30] [--warmup 5] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MB = 2**20

WORKERS = 4
MODEL = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
         "num_hidden_layers": 4, "intermediate_size": 768, "vocab_size": 2048}
SEQ, GLOBAL_BATCH, LR = 128, 16, 1e-3
# name -> the config's parallelism; "control" is FSDP 4 again.
LAYOUTS = {"fsdp": None, "tp": {"tp": 2}, "control": None}
LABELS = {"fsdp": "FSDP 4", "tp": "TP 2 x FSDP 2", "control": "FSDP 4 (control)"}


def status(field: str) -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def reset_peak() -> None:
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")


def save_model(path: str) -> int:
    """The Llama of ``MODEL``, random (seeded), saved in fp32; its bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL, max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rows(step: int, dp_rank: int, dp: int):
    """This data-parallel rank's rows of the global batch of ``step`` (the same in every
    layout)."""
    import torch

    ids = torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ),
                        generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // dp
    return ids[dp_rank * per:(dp_rank + 1) * per]


def local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local")
               else t.numel() * t.element_size() for t in tensors)


def worker(config: dict) -> None:
    """One fit's worker: the load and the training, measured."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - imported before the memory is measured
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import ray_train_xla as rtx

    rank = rtx.rank()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config["model"]))
    dist.barrier()
    reset_peak()
    record = {"rank": rank, "layout": rtx.get_layout().to_text(), "rss_before_load": status("VmRSS"),
              "threads": torch.get_num_threads()}
    t0 = time.perf_counter()
    model = rtx.load_pretrained(model, config["model"], auto_wrap_policy={LlamaDecoderLayer})
    record["load_s"] = time.perf_counter() - t0
    record["hwm_after_load"] = status("VmHWM")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dp_rank, dp = rtx.data_parallel()
    losses, ends = [], []
    for step in range(config["warmup"] + config["steps"]):
        if step == config["warmup"]:
            dist.barrier()
            ends.append(time.perf_counter())
        opt.zero_grad()
        ids = rows(step, dp_rank, dp)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        rtx.clip_grad_norm_(model, 1.0)
        opt.step()
        if step >= config["warmup"]:
            ends.append(time.perf_counter())
        # A float, not the tensor: under TP a step's loss.detach() kept across steps holds
        # about the step's logits alive (measured, torch 2.9 and 2.14), which the peak would count.
        losses.append(float(loss))
    record["hwm_after_train"] = status("VmHWM")
    # The loss of each step, the mean over the data-parallel ranks (tensor-parallel peers hold
    # the same one: the mean over every worker is the mean over the data-parallel ranks).
    mean = torch.tensor(losses)
    dist.all_reduce(mean)
    record["losses"] = (mean / dist.get_world_size()).tolist()
    record["step_s"] = [b - a for a, b in zip(ends, ends[1:])]
    record["param_bytes"] = local_bytes(model.parameters())
    record["optimizer_bytes"] = local_bytes(v for s in opt.state.values() for v in s.values()
                                            if torch.is_tensor(v) and v.dim() > 0)
    with open(os.path.join(config["out_dir"], f"{config['name']}-rank{rank}.json"), "w") as f:
        json.dump(record, f)


def fit(name: str, parallelism, config: dict) -> list[dict]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_train_xla import TorchNeuronConfig

    TorchTrainer(
        worker, train_loop_config={**config, "name": name},
        torch_config=TorchNeuronConfig(device="cpu", timeout_s=600, parallelism=parallelism),
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="bench-tp-runs-"), name=name),
    ).fit()
    out = config["out_dir"]
    return sorted((json.load(open(os.path.join(out, f), encoding="utf-8"))
                   for f in os.listdir(out) if f.startswith(f"{name}-rank")),
                  key=lambda r: r["rank"])


def measure(args: argparse.Namespace) -> dict:
    import ray
    import torch

    tmp = tempfile.mkdtemp(prefix="bench-tp-")
    model_dir, out_dir = os.path.join(tmp, "model"), os.path.join(tmp, "out")
    os.makedirs(out_dir)
    model_bytes = save_model(model_dir)
    path = os.pathsep.join([HERE, os.path.join(ROOT, "src")] +
                           [p for p in [os.environ.get("PYTHONPATH")] if p])
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "command": " ".join(args.argv),
                 "versions": {"torch": torch.__version__, "ray": ray.__version__},
                 "load_at_start": [round(x, 2) for x in os.getloadavg()],
                 "model": {**MODEL, "seq": SEQ, "global_batch": GLOBAL_BATCH, "bytes": model_bytes,
                           "dtype": "float32"},
                 "workers": WORKERS, "steps": args.steps, "warmup": args.warmup,
                 "rounds": []}
    ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        for r in range(args.rounds):
            fits = {}
            for name, parallelism in LAYOUTS.items():
                print(f"round {r + 1}/{args.rounds}: {LABELS[name]} ...", flush=True)
                fits[name] = fit(f"{name}-{r}", parallelism,
                                 {"model": model_dir, "out_dir": out_dir, "steps": args.steps,
                                  "warmup": args.warmup})
            res["rounds"].append(fits)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["summary"] = summarise(res)
    return res


def ratio_interval(num: list[float], den: list[float], level: float = 0.9,
                   resamples: int = 2000) -> list[float]:
    """The bootstrap interval of median(num) / median(den), each resampled on its own, seeded."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(num, k=len(num)))
                    / statistics.median(rng.choices(den, k=len(den))) for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return [ratios[cut], ratios[-cut - 1]]


def slower_rank_steps(ranks: list[dict]) -> list[float]:
    """Each timed step's time on the slower rank."""
    return [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]


def summarise(res: dict) -> dict:
    from figures import interval

    out: dict = {"layouts": {}}
    steps: dict[str, list[float]] = {}
    for name in LAYOUTS:
        ranks = [r for fits in res["rounds"] for r in fits[name]]
        steps[name] = [s for fits in res["rounds"] for s in slower_rank_steps(fits[name])]
        mem = {}
        for key in ("rss_before_load", "hwm_after_load", "hwm_after_train"):
            mem[key] = [r[key] for r in ranks]
        mem["load_growth"] = [r["hwm_after_load"] - r["rss_before_load"] for r in ranks]
        mem["train_growth"] = [r["hwm_after_train"] - r["rss_before_load"] for r in ranks]
        mem["shards"] = [r["param_bytes"] + r["optimizer_bytes"] for r in ranks]
        out["layouts"][name] = {
            "layout": sorted({r["layout"] for r in ranks}), "memory": mem,
            "step_s_median": statistics.median(steps[name]),
            "step_s_interval": interval(steps[name]),
            "load_s_median": statistics.median(r["load_s"] for r in ranks)}
    for key, (num, den) in {"tp_over_fsdp": ("tp", "fsdp"),
                            "control_over_fsdp": ("control", "fsdp")}.items():
        out[key] = {"ratio": statistics.median(steps[num]) / statistics.median(steps[den]),
                    "interval": ratio_interval(steps[num], steps[den])}
    low, high = out["control_over_fsdp"]["interval"]
    out["tp_outside_control"] = not low <= out["tp_over_fsdp"]["ratio"] <= high
    out["loss_max_diff"] = max(
        abs(a - b) for fits in res["rounds"] for other in ("tp", "control")
        for a, b in zip(fits["fsdp"][0]["losses"], fits[other][0]["losses"]))
    return out


def _mb(values: list[int]) -> str:
    """Median [min-max] in MiB."""
    return (f"{statistics.median(values) / MB:.0f} [{min(values) / MB:.0f}-"
            f"{max(values) / MB:.0f}]")


def markdown(res: dict) -> str:
    s, m = res["summary"], res["model"]
    threads = sorted({r["threads"] for fits in res["rounds"] for ranks in fits.values()
                      for r in ranks})
    verdict = (": the layouts differ by more than this machine moves between two fits"
               if s["tp_outside_control"] else
               ": no difference shows beyond what this machine moves between two fits")
    lines = [
        "# Tensor parallelism against FSDP on the CPU twins: host memory and step time", "",
        f"{res['date']}, {res['machine']['cpus']} CPUs, Python {res['machine']['python']}, "
        f"torch {res['versions']['torch']}, ray {res['versions']['ray']}; load average at the "
        f"start {' '.join(map(str, res['load_at_start']))}, at the end "
        f"{' '.join(map(str, res['load_at_end']))} (1, 5, 15 min).", "",
        f"Command: `python benchmarks/bench_tp.py {res['command']}`.", "",
        f"{res['workers']} Ray Train workers x 1 CPU under `TorchNeuronConfig(device=\"cpu\")` "
        f"(torch threads a worker: {threads}). "
        f"A Llama of hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
        f"{m['num_key_value_heads']} KV heads, {m['num_hidden_layers']} layers, MLP "
        f"{m['intermediate_size']}, vocabulary {m['vocab_size']} ({m['bytes'] / MB:.1f} MiB in "
        f"{m['dtype']}), loaded with `rtx.load_pretrained` and trained {res['warmup']} + "
        f"{res['steps']} AdamW steps (the second number timed) on {m['global_batch']} rows of "
        f"{m['seq']} tokens a step, split by data-parallel rank; {len(res['rounds'])} round(s) "
        "of three fits: FSDP 4, TP 2 x FSDP 2, FSDP 4 again (the control).", "",
        "## Peak host memory per worker", "",
        "MiB, median [min-max] over the workers (and rounds). The peak is reset just before the "
        "load; growth is the peak above the resident memory there.", "",
        "| layout | resident before the load | VmHWM after the load | load growth | VmHWM after "
        "training | growth to the end of training | own shards (parameters + AdamW) |",
        "|---|---|---|---|---|---|---|"]
    for name, v in s["layouts"].items():
        mem = v["memory"]
        lines.append(f"| {LABELS[name]} | {_mb(mem['rss_before_load'])} | "
                     f"{_mb(mem['hwm_after_load'])} | {_mb(mem['load_growth'])} | "
                     f"{_mb(mem['hwm_after_train'])} | {_mb(mem['train_growth'])} | "
                     f"{statistics.median(mem['shards']) / MB:.1f} |")
    growth = {k: statistics.median(v["memory"]["train_growth"]) for k, v in s["layouts"].items()}
    lines += [
        "", f"To the end of training TP 2 x FSDP 2 grew {(growth['tp'] - growth['fsdp']) / MB:+.0f} "
        f"MiB against FSDP 4 (the control {(growth['control'] - growth['fsdp']) / MB:+.0f} MiB), "
        "the median worker. Both hold a quarter of the parameters and AdamW state. Under TP 2 x "
        "FSDP 2 a worker computes its data-parallel rank's rows, twice FSDP 4's, split with its "
        "peer in the attention and the MLP only: the embedding's output, the norms, the "
        "residual stream and the logits are whole on both peers (no sequence or loss "
        "parallelism here)."]
    tp, control = s["tp_over_fsdp"], s["control_over_fsdp"]
    lines += [
        "", "## Step time", "",
        "Seconds a step on the slower rank, median over the timed steps [90% bootstrap interval "
        "of the median]; ratios of the medians [90% bootstrap interval].", "",
        "| layout | step (s) | load (s, median worker) |", "|---|---|---|"]
    for name, v in s["layouts"].items():
        low, high = v["step_s_interval"]
        lines.append(f"| {LABELS[name]} | {v['step_s_median']:.3f} [{low:.3f}-{high:.3f}] | "
                     f"{v['load_s_median']:.2f} |")
    lines += [
        "", "| ratio | value |", "|---|---|",
        f"| **TP 2 x FSDP 2 / FSDP 4** | **{tp['ratio']:.3f}** [{tp['interval'][0]:.3f}-"
        f"{tp['interval'][1]:.3f}] |",
        f"| control: FSDP 4 / FSDP 4 | {control['ratio']:.3f} [{control['interval'][0]:.3f}-"
        f"{control['interval'][1]:.3f}] |", "",
        f"The TP ratio lies {'outside' if s['tp_outside_control'] else 'inside'} the control's "
        f"interval{verdict}. "
        "The step-time ratio is no target on the CPU: TP trades FSDP's all-gathers of whole "
        "layers for all-reduces of activations, which a CPU's gloo and shared cores price "
        "differently from NeuronLink or ICI.", "",
        f"Largest difference between the losses of FSDP 4 and of the other fits, any step: "
        f"{s['loss_max_diff']:.2e} (the same model trained on the same rows).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from figures import add_output_arguments, write

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three fits")
    parser.add_argument("--steps", type=int, default=30, help="timed steps a fit")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return write(args, "tp", measure, markdown)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import bench_tp  # the workers import the training function by this name

    sys.exit(bench_tp.main())
