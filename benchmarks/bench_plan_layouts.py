"""The layout ``ray-train-xla plan --model`` picks for Llama 3 70B and 405B, and the memory per
device, on trn2.48xlarge nodes and on TPU v6e and v5p slices. No timing: the plan's outputs.

Each case runs ``plan --model`` as a user would (``ray_train_xla.tools.cli.main``, ``--json``)
at 1 x 4096 tokens a device, three ways: the defaults (fp32 parameters and AdamW state, bf16
compute, no activation checkpointing), with ``--activation-checkpointing --sequence-parallel``,
and with bf16 state too. A plan that fits gives the layout it picked and its figures; a refused
one, its first remedy (planned again before it is offered). Writes ``plan_layouts.json`` and
``plan_layouts.md``.

    python benchmarks/bench_plan_layouts.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

GIB = 1 << 30
MODELS = {  # the configs of meta-llama/Meta-Llama-3-70B and Llama-3.1-405B
    "Llama-3-70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64},
    "Llama-3.1-405B": {"hidden_size": 16384, "intermediate_size": 53248,
                       "num_hidden_layers": 126, "num_attention_heads": 128},
}
COMMON = {"model_type": "llama", "vocab_size": 128256, "num_key_value_heads": 8,
          "tie_word_embeddings": False}
TRN2 = ["--device", "neuron", "--runtime", "native", "--accelerator-type", "trn2.48xlarge",
        "--workers-per-node", "64"]
CLUSTERS = {  # label -> plan's flags (one worker per NeuronCore or TPU chip)
    "trn2.48xlarge x 1": TRN2 + ["--nodes", "1"],
    "trn2.48xlarge x 2": TRN2 + ["--nodes", "2"],
    "trn2.48xlarge x 8": TRN2 + ["--nodes", "8"],
    "v6e-256": ["--device", "tpu", "--runtime", "native", "--accelerator-type", "v6e-256",
                "--nodes", "64", "--workers-per-node", "4"],
    "v5p-128": ["--device", "tpu", "--runtime", "native", "--accelerator-type", "v5p-128",
                "--nodes", "16", "--workers-per-node", "4"],
}
SETTINGS = {
    "defaults": [],
    "AC + SP": ["--activation-checkpointing", "--sequence-parallel"],
    "AC + SP, bf16": ["--activation-checkpointing", "--sequence-parallel", "--param-dtype",
                      "bf16"],
}


def run_plan(args: list[str]) -> tuple[int, str, str]:
    from ray_train_xla.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    return code, out.getvalue(), err.getvalue()


def case(model: str, config: str, cluster: str, setting: str) -> dict:
    args = CLUSTERS[cluster] + ["--model", config] + SETTINGS[setting]
    code, out, err = run_plan(args + ["--json"])
    row = {"model": model, "cluster": cluster, "setting": setting,
           "command": "ray-train-xla plan " + " ".join(CLUSTERS[cluster] + SETTINGS[setting])
           + f" --model {model}"}
    if code == 0:
        plan = json.loads(out)
        d = plan["per_device"]
        row.update(fits=True, layout=plan["layout"]["describe"], devices=plan["layout"]["devices"],
                   per_device_gib=round(d["total"] / GIB, 2),
                   device_gib=round(plan["device_memory"]["bytes"] / GIB, 2),
                   activations_gib=round((d["activations"] + d["logits"]) / GIB, 2),
                   host_peak_gib=round(plan["per_host"]["peak"] / GIB, 2),
                   tried={t["tp"]: round(t["total"] / GIB, 2)
                          for t in plan.get("picked", {}).get("tried", [])},
                   warnings=plan["warnings"])
    else:
        device = re.search(r"needs ([\d.]+) GiB per device", err)
        host = re.search(r"needs up to ([\d.]+) GiB per host", err)
        first = re.search(r": use (.*?\(([^:()]*): ([\d.]+) GiB per device[^)]*\))", err)
        row.update(fits=False, per_device_gib=float(device.group(1)) if device else None,
                   host_peak_gib=float(host.group(1)) if host else None,
                   refusal=err.strip().removeprefix("ray-train-xla plan: error: "),
                   first_remedy=first.group(1) if first else None)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, sizes in MODELS.items():
            config = os.path.join(tmp, f"{model}.json")
            with open(config, "w") as f:
                json.dump({**COMMON, **sizes}, f)
            for cluster in CLUSTERS:
                for setting in SETTINGS:
                    rows.append(case(model, config, cluster, setting))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_layouts.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    lines = [
        "# The layout `plan --model` picks (Llama 3 70B and 405B)", "",
        "1 x 4096 tokens a device (`--seq-len`, `--micro-batch` defaults), one worker per "
        "NeuronCore (LNC=2, 24 GiB) or TPU chip (v6e 32 GiB, v5p 95 GiB). Settings: *defaults* "
        "(fp32 parameters, gradients and AdamW state, bf16 compute, no activation "
        "checkpointing); *AC + SP*: `--activation-checkpointing --sequence-parallel`; *bf16*: "
        "`--param-dtype bf16`. Refused: the figure is TP 1's, then the first remedy offered "
        "(planned again before it is offered), and what was too much. Written by "
        "`benchmarks/bench_plan_layouts.py`.",
        "", "| model | cluster | setting | layout picked | GiB per device | of which activations "
        "+ logits | tried (TP: GiB) | host peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["fits"]:
            tried = ", ".join(f"{t}: {g:.2f}" for t, g in r["tried"].items())
            lines.append(f"| {r['model']} | {r['cluster']} | {r['setting']} | {r['layout']} "
                         f"({r['devices']} devices) | {r['per_device_gib']:.2f} of "
                         f"{r['device_gib']:.2f}{' (warning)' if r['warnings'] else ''} | "
                         f"{r['activations_gib']:.2f} | {tried} | {r['host_peak_gib']:.2f} |")
        else:
            fix = r["first_remedy"] or r["refusal"]
            device = "fits" if r["per_device_gib"] is None else \
                f"{r['per_device_gib']:.2f} (TP 1, too much)"
            host = "" if r["host_peak_gib"] is None else f"{r['host_peak_gib']:.2f} (too much)"
            lines.append(f"| {r['model']} | {r['cluster']} | {r['setting']} | refused; offers "
                         f"{fix} | {device} | | | {host} |")
    with open(os.path.join(args.out, "plan_layouts.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
