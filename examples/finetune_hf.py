"""Fine-tune a Hugging Face causal LM, sharded, with one training function for every backend.

The same ``train_loop`` runs torch_xla FSDPv2 under ``TorchXLAConfig(spmd=True)`` (one worker per
host owning its devices; on the CPU, one worker with ``--devices`` virtual XLA devices) and FSDP2
under ``TorchNeuronConfig`` / ``TorchTPUConfig`` (one worker per NeuronCore or chip; on the CPU,
``--workers`` gloo workers); ``--config xla|neuron|tpu`` picks the config object, nothing else
changes. Each decoder layer (``LlamaDecoderLayer``, or the model's ``_no_split_modules``) is
sharded on its own.

Model: ``--model PATH`` (a local directory; a hub name works only where the hub is reachable),
else a small ``LlamaConfig`` built here with random weights and a byte-level tokenizer, so the
default run needs no download. Text: ``--data FILE`` (one text per line) or a generated corpus.
It is tokenized by Ray Data (``map_batches``) and padded to a few bucket lengths (32/64/128,
labels -100 on padding), so XLA compiles one graph per bucket, not one per length; a held-out
split gives ``eval_loss`` every ``--eval-every`` steps. AdamW with linear warm-up
(``--warmup``), gradient accumulation (``--accum``), clipping by the global norm. bf16 on
Neuron and TPU (FSDP2's ``mixed_precision="bf16"``; the model cast under FSDPv2); fp32 on the CPU,
where bf16 matmuls are emulated on most CPUs (slower than fp32) and a CPU run is a check of the
script. Reports carry loss, tokens/s and compile counts; checkpoints (sharded, every
``--checkpoint-every`` steps) the step, the data position and the model's ``hf_config``, so a
failed run resumes where it stopped (``--crash-at STEP`` fails once to show it), and the driver
writes a Hugging Face model directory from the last one (``--export DIR``; ``--no-export``).

    python examples/finetune_hf.py --config xla --devices 4 --steps 40      # FSDPv2, XLA CPU
    python examples/finetune_hf.py --config neuron --workers 2 --steps 40   # FSDP2, CPU workers
    python examples/finetune_hf.py --config tpu --workers 2 --crash-at 20   # fail once, resume
    python examples/finetune_hf.py --config neuron --device neuron --workers 32 \\
        --accelerators-per-worker 1 --address auto --storage-path /fsx/runs --model /fsx/llama
    python examples/finetune_hf.py --config tpu --device tpu --workers 16 \\
        --tpu-topology 4x4 --accelerator-type TPU-V6E --address auto --storage-path gs://b/runs
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

BUCKETS = (32, 64, 128)
# The byte-level tokenizer: 0 padding, 1 begin, 2 end, then the 256 byte values; the vocabulary
# is rounded up to a multiple of 8 so that FSDPv2 splits the embedding evenly over 8 devices.
PAD, BOS, EOS, BYTE0 = 0, 1, 2, 3
BYTE_VOCAB = 264
CONFIGS = ("xla", "neuron", "tpu")
EVAL_FRACTION = 0.1  # of the texts, held out (the last ones)


def ft_config(**overrides) -> dict:
    """Model, data and training settings (the training function's config)."""
    config = {
        "model": None,  # a local path (or hub name) for from_pretrained; None: the small Llama
        "hidden": 64, "layers": 2, "heads": 4, "ff": 128,
        "buckets": list(BUCKETS), "batch_size": 8, "accum": 1,
        "lr": 3e-3, "warmup": 5, "steps": 40, "max_grad_norm": 1.0,
        "eval_every": 10, "checkpoint_every": 10,
        "precision": "auto",  # auto: bf16 on Neuron/TPU devices, fp32 on the CPU
        "crash_at": None, "marker_dir": None, "out_dir": None, "seed": 0,
    }
    config.update(overrides)
    return config


# ---------------------------------------------------------------------------------------- data


def builtin_corpus(lines: int = 600, seed: int = 0) -> list[str]:
    """Generated English-like text, 1 to 4 clauses a line (about 20 to 120 bytes: every bucket)."""
    import random

    rng = random.Random(seed)
    adjectives = ["quick", "lazy", "small", "bright", "quiet", "old", "red", "happy"]
    nouns = ["fox", "dog", "cat", "bird", "river", "tree", "child", "ship"]
    verbs = ["sees", "follows", "finds", "likes", "passes", "watches"]
    out = []
    for _ in range(lines):
        clauses = [f"the {rng.choice(adjectives)} {rng.choice(nouns)} {rng.choice(verbs)} "
                   f"the {rng.choice(nouns)}" for _ in range(rng.randint(1, 4))]
        out.append(", and ".join(clauses) + ".")
    return out


def read_texts(path: str | None, lines: int = 600) -> list[str]:
    if path is None:
        return builtin_corpus(lines)
    with open(path, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise SystemExit(f"--data {path}: no non-empty lines")
    return texts


_TOKENIZERS: dict = {}


def hf_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained(name)``, once per process."""
    if name not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(name)
    return _TOKENIZERS[name]


def encode(texts: list[str], model: str | None, max_len: int) -> tuple[list[list[int]], int]:
    """Token ids of each text (begin/end tokens included, cut to ``max_len``) and the pad id."""
    if model is None:
        return [([BOS] + [BYTE0 + b for b in t.encode("utf-8")] + [EOS])[:max_len]
                for t in texts], PAD
    tok = hf_tokenizer(model)
    ids = tok(list(texts), truncation=True, max_length=max_len)["input_ids"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ids, 0 if pad is None else pad


def bucket_of(length: int, buckets: list[int]) -> int:
    return next(b for b in buckets if length <= b)


def tokenize_batch(batch: dict, model: str | None, buckets: list[int]) -> dict:
    """Ray Data ``map_batches``: texts -> ``input_ids`` and ``labels`` padded to the largest
    bucket (labels -100 on padding) and each row's ``bucket``, the smallest bucket it fits. A
    training batch is cut to the largest bucket among its rows (``cut_to_bucket``)."""
    import numpy as np

    buckets = sorted(buckets)
    width = buckets[-1]
    ids, pad = encode([str(t) for t in batch["text"]], model, width)
    n = len(ids)
    input_ids = np.full((n, width), pad, dtype=np.int64)
    labels = np.full((n, width), -100, dtype=np.int64)
    bucket = np.zeros(n, dtype=np.int64)
    for i, row in enumerate(ids):
        input_ids[i, :len(row)] = row
        labels[i, :len(row)] = row
        bucket[i] = bucket_of(max(len(row), 1), buckets)
    return {"input_ids": input_ids, "labels": labels, "bucket": bucket}


def cut_to_bucket(batch: dict) -> tuple:
    """(input_ids, labels) of a CPU batch, cut to the largest bucket among its rows: right
    padding under a causal mask, so no real token attends to padding and no mask is needed."""
    width = int(batch["bucket"].max())
    return batch["input_ids"][:, :width], batch["labels"][:, :width]


def make_datasets(texts: list[str], config: dict, eval_fraction: float = EVAL_FRACTION) -> dict:
    """{"train", "eval"}: Ray Data datasets of tokenized rows; the last ``eval_fraction`` of the
    texts is held out."""
    import ray.data

    n_eval = max(1, int(len(texts) * eval_fraction))
    if len(texts) - n_eval < 1:
        raise SystemExit(f"{len(texts)} texts: too few to hold out {n_eval} for eval")
    kwargs = {"fn_kwargs": {"model": config["model"], "buckets": config["buckets"]},
              "batch_size": 64}
    return {
        "train": ray.data.from_items([{"text": t} for t in texts[:-n_eval]])
        .map_batches(tokenize_batch, **kwargs),
        "eval": ray.data.from_items([{"text": t} for t in texts[-n_eval:]])
        .map_batches(tokenize_batch, **kwargs),
    }


# --------------------------------------------------------------------------------------- model


def make_model(config: dict):
    """The causal LM (CPU, fp32): ``from_pretrained(config["model"])`` or a small random Llama."""
    import torch

    if config["model"]:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=BYTE_VOCAB, hidden_size=config["hidden"], intermediate_size=config["ff"],
        num_hidden_layers=config["layers"], num_attention_heads=config["heads"],
        num_key_value_heads=config["heads"], max_position_embeddings=max(config["buckets"]),
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(config["seed"])
    return LlamaForCausalLM(hf_config)


def block_classes(model) -> set:
    """The decoder layer classes, sharded one by one: the model's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); cannot shard it block by block")
    return classes


def xla_shard_output(output, mesh) -> None:
    """FSDPv2's output sharding for a decoder layer (a tensor) and for the whole model (a
    ``CausalLMOutputWithPast``: its logits), split on dim 0 like the batch."""
    import torch
    import torch_xla.distributed.spmd as xs

    t = output if isinstance(output, torch.Tensor) else output.logits
    xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))


def lm_loss(model, input_ids, labels):
    """Next-token cross entropy over the tokens that are not padding."""
    import torch

    logits = model(input_ids=input_ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
        ignore_index=-100)


def lr_at(step: int, config: dict) -> float:
    """Linear warm-up over ``warmup`` steps, then constant. ``step`` is 0-based."""
    warmup = config["warmup"]
    return config["lr"] * min(1.0, (step + 1) / warmup) if warmup > 0 else config["lr"]


def use_bf16(config: dict, on_cpu: bool) -> bool:
    if config["precision"] == "auto":
        return not on_cpu
    return config["precision"] == "bf16"


# ------------------------------------------------------------------------------------ training


def train_loop(config: dict) -> None:
    """The training function, the same for FSDPv2 (XLA SPMD) and FSDP2 (native configs)."""
    import json

    import ray.train
    import torch

    import ray_train_xla as rtx

    device = rtx.get_device()
    spmd = device.type == "xla"  # TorchXLAConfig(spmd=True): FSDPv2; else FSDP2
    on_cpu = device.type == "cpu" or (spmd and os.environ.get("PJRT_DEVICE", "").upper() == "CPU")
    bf16 = use_bf16(config, on_cpu)
    # (On the native configs the plan sets USE_TORCH_XLA=0: transformers, imported below,
    # keeps off torch_xla where it is installed.)
    model = make_model(config)
    blocks = block_classes(model)
    if spmd:
        mesh = rtx.get_sharded_mesh()
        if config["batch_size"] % mesh.size():
            raise ValueError(f"batch_size {config['batch_size']} is split over {mesh.size()} "
                             "devices under FSDPv2: make it a multiple of the device count")
        if bf16:
            model = model.to(torch.bfloat16)  # FSDPv2 has no mixed precision: all bf16
        model = rtx.prepare_sharded_model(model, mesh, auto_wrap_policy=blocks,
                                          shard_output=xla_shard_output)
    else:
        mesh = None
        model = rtx.prepare_sharded_model(model, auto_wrap_policy=blocks,
                                          mixed_precision="bf16" if bf16 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.0)

    def to_device(t):
        return rtx.shard_batch(t, mesh) if spmd else t.to(device)

    state = rtx.load_checkpoint(model, optimizer)  # this rank's shards; None on a fresh start
    step = state["step"] if state else 0
    epoch, position = (state["epoch"], state["position"]) if state else (0, 0)
    rank, out_dir = rtx.rank(), config.get("out_dir")

    def log(record: dict) -> None:  # for tests: what this rank did, one JSON line each
        if out_dir:
            with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    log({"event": "start", "resumed_from": step if state else None, "epoch": epoch,
         "position": position})
    train_shard = ray.train.get_dataset_shard("train")
    eval_shard = ray.train.get_dataset_shard("eval")
    batch_size, accum = config["batch_size"], config["accum"]

    def train_batches():
        """CPU batches across epochs; ``epoch`` and ``position`` (batches read in it) follow
        them. After a restart the batches of the epoch already trained on are skipped."""
        nonlocal epoch, position
        while True:
            seen = 0
            # CPU batches: cut to their bucket, then put on the device (sharded under SPMD).
            for i, batch in enumerate(rtx.iter_xla_batches(train_shard, batch_size,
                                                           to_device=False)):
                seen += 1
                if i < position:
                    continue
                position = i + 1
                yield batch
            if seen == 0:
                raise ValueError(f"rank {rank}: the train split has fewer than batch_size="
                                 f"{batch_size} rows per worker")
            epoch, position = epoch + 1, 0

    def evaluate() -> float:
        model.eval()
        total = torch.zeros((), device=device)
        count = 0
        with torch.no_grad():
            for batch in rtx.iter_xla_batches(eval_shard, batch_size, to_device=False):
                ids, labels = cut_to_bucket(batch)
                n = int((labels[:, 1:] != -100).sum())
                total = total + lm_loss(model, to_device(ids), to_device(labels)).float() * n
                count += n
                rtx.sync()
        model.train()
        both = torch.stack([total.detach().float().cpu(), torch.tensor(float(count))])
        if rtx.world_size() > 1 and not spmd:
            both = rtx.all_reduce(both.to(device)).cpu()
        return float(both[0] / both[1]) if both[1] else float("nan")

    # Warm-up: until the first eval has compiled its graphs. A bucket first seen later is one
    # more graph, counted in xla/compiles_after_warmup.
    monitor = rtx.CompileMonitor(warmup_steps=min(config["eval_every"], config["steps"]))
    batches = train_batches()
    tokens, interval_start = 0, time.perf_counter()
    crash_marker = os.path.join(config.get("marker_dir") or tempfile.gettempdir(),
                                f"finetune_hf_crashed_rank{rank}")
    model.train()
    while step < config["steps"]:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        optimizer.zero_grad()
        step_loss = torch.zeros((), device=device)
        for _ in range(accum):
            ids, labels = cut_to_bucket(next(batches))
            tokens += int((labels[:, 1:] != -100).sum())
            loss = lm_loss(model, to_device(ids), to_device(labels)) / accum
            loss.backward()
            step_loss = step_loss + loss.detach()
            if accum > 1:
                rtx.sync()  # one graph per bucket, not one per mix of buckets
        grad_norm = rtx.clip_grad_norm_(model, config["max_grad_norm"])
        optimizer.step()
        rtx.sync()
        step += 1
        log({"event": "step", "step": step, "epoch": epoch, "position": position})
        last = step >= config["steps"]
        do_eval = step % config["eval_every"] == 0 or last
        do_ckpt = step % config["checkpoint_every"] == 0 or last
        if do_eval or do_ckpt:
            seconds = time.perf_counter() - interval_start
            # This step's loss (the mean over the workers) and the tokens of every worker.
            summed = torch.stack([step_loss.detach().float().cpu(), torch.tensor(float(tokens))])
            if rtx.world_size() > 1 and not spmd:
                summed = rtx.all_reduce(summed.to(device)).cpu()
            report = {"step": step, "epoch": epoch,
                      "loss": float(summed[0]) / (1 if spmd else rtx.world_size()),
                      "grad_norm": float(grad_norm.float().cpu()), "lr": lr_at(step - 1, config),
                      "tokens_per_s": float(summed[1]) / seconds, "bf16": bf16}
            if do_eval:
                report["eval_loss"] = evaluate()
            report.update(monitor.metrics(step))  # after the eval: its graphs count here
            if rank == 0:
                log({"event": "report", **report})
            if do_ckpt:
                rtx.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step, "epoch": epoch, "position": position,
                     "hf_config": model.config.to_dict()},
                    report)
            else:
                rtx.report(report)
            tokens, interval_start = 0, time.perf_counter()
        if config["crash_at"] and step == config["crash_at"] and not os.path.exists(crash_marker):
            open(crash_marker, "w").close()
            # Let Ray take the checkpoint of this step before failing: Ray Train V2 registers a
            # report when its controller next polls the workers.
            rtx.flush_reports()
            time.sleep(2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")))
            raise RuntimeError(f"finetune_hf: simulated crash after step {step}")
    if out_dir:
        probe = probe_ids(model.config.vocab_size)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=to_device(probe)).logits.float().cpu()
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, "probe_logits.pt"))


def probe_ids(vocab: int):
    """A fixed batch of token ids (4 x 16) to compare the trained model with its export."""
    import torch

    return (torch.arange(64).reshape(4, 16) * 7 + 3) % vocab


# -------------------------------------------------------------------------------------- driver


def torch_config(name: str, device: str, devices: int | None = None):
    """The config object: the only thing that differs between backends."""
    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig, TorchXLAConfig

    if name == "xla":
        if device == "cpu":
            return TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=devices or 4,
                                  timeout_s=300)
        return TorchXLAConfig(device=device, spmd=True)
    if name == "neuron":
        return TorchNeuronConfig(device=device, timeout_s=300)
    return TorchTPUConfig(device=device, timeout_s=300)


def scaling_config(name: str, device: str, workers: int, per_worker: int = 1,
                   tpu_topology: str | None = None, accelerator_type: str | None = None):
    """Workers and the accelerators each one asks Ray for."""
    from ray.train import ScalingConfig

    if device == "cpu":
        return ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})
    if device == "neuron":
        return ScalingConfig(num_workers=workers, resources_per_worker={"neuron_cores": per_worker})
    kwargs = {}
    if tpu_topology:
        kwargs["topology"] = tpu_topology
    if accelerator_type:
        kwargs["accelerator_type"] = accelerator_type
    return ScalingConfig(num_workers=workers, use_tpu=True,
                         resources_per_worker={"TPU": per_worker}, **kwargs)


def build_trainer(config: dict, torch_cfg, scaling, storage_path: str, name: str,
                  texts: list[str] | None = None, max_failures: int = 1, keep: int | None = 2):
    """A TorchTrainer for ``train_loop`` with the tokenized train and eval datasets."""
    from ray.data import ExecutionOptions
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop,
        train_loop_config=config,
        torch_config=torch_cfg,
        scaling_config=scaling,
        datasets=make_datasets(texts if texts is not None else builtin_corpus(), config),
        # The same batches in the same order every epoch (per worker, as Ray Data splits them).
        dataset_config=DataConfig(datasets_to_split=["train", "eval"],
                                  execution_options=ExecutionOptions(preserve_order=True)),
        run_config=RunConfig(storage_path=storage_path, name=name,
                             checkpoint_config=CheckpointConfig(num_to_keep=keep),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )


def export_hf(checkpoint_path: str, out_dir: str) -> dict:
    """Write a Hugging Face model directory (config + safetensors) from a sharded checkpoint;
    ``from_pretrained(out_dir)`` loads it."""
    from ray_train_xla.tools.consolidate import consolidate_hf

    return consolidate_hf(checkpoint_path, out_dir)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse every flag that does not apply, with the reason, instead of ignoring it."""
    devices = {"xla": ("cpu", "neuron", "tpu"), "neuron": ("cpu", "neuron"), "tpu": ("cpu", "tpu")}
    if args.device not in devices[args.config]:
        parser.error(f"--device {args.device} with --config {args.config}: use one of "
                     f"{', '.join(devices[args.config])}")
    if args.devices is not None and not (args.config == "xla" and args.device == "cpu"):
        parser.error("--devices sets the virtual XLA CPU devices of --config xla --device cpu; "
                     "on accelerators each worker gets --accelerators-per-worker, and FSDP2 "
                     "(neuron, tpu) has one device per worker")
    if args.config == "xla" and args.device == "cpu" and args.workers != 1:
        parser.error("--config xla --device cpu runs one SPMD worker (its --devices are the "
                     "mesh; torch_xla's CPU client has no collectives across processes): "
                     "--workers 1")
    if args.device == "cpu" and args.accelerators_per_worker is not None:
        parser.error("--accelerators-per-worker is for --device neuron or tpu")
    if (args.tpu_topology or args.accelerator_type) and args.device != "tpu":
        parser.error("--tpu-topology/--accelerator-type are for --device tpu")
    for flag in ("steps", "workers", "batch_size", "accum", "eval_every", "checkpoint_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.accelerators_per_worker is not None and args.accelerators_per_worker < 1:
        parser.error("--accelerators-per-worker must be at least 1")
    if args.config == "xla" and args.device == "cpu" and args.batch_size % (args.devices or 4):
        parser.error(f"--batch-size {args.batch_size} is split over the {args.devices or 4} "
                     "devices of the SPMD worker: give a multiple of --devices")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.crash_at is not None and not 1 <= args.crash_at < args.steps:
        parser.error(f"--crash-at {args.crash_at}: give a step in 1..{args.steps - 1}")
    if args.crash_at is not None and args.crash_at % args.checkpoint_every:
        parser.error(f"--crash-at {args.crash_at} is not a checkpoint step (a multiple of "
                     f"--checkpoint-every {args.checkpoint_every}): the restart would go back "
                     "to the checkpoint before it")
    if args.export and args.no_export:
        parser.error("--export and --no-export together")
    if not (args.export or args.no_export) and "://" in args.storage_path:
        parser.error(f"--storage-path {args.storage_path} is remote: give --export DIR (a local "
                     "directory for the Hugging Face model) or --no-export")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=CONFIGS, default="xla",
                        help="xla: TorchXLAConfig(spmd=True), FSDPv2; neuron: TorchNeuronConfig, "
                        "FSDP2; tpu: TorchTPUConfig, FSDP2 (default xla)")
    parser.add_argument("--device", choices=("cpu", "neuron", "tpu"), default="cpu",
                        help="cpu (default: the CPU twin of the config) or the accelerator")
    parser.add_argument("--workers", type=int, default=None,
                        help="training workers (default 1 for xla on the CPU, 2 otherwise)")
    parser.add_argument("--devices", type=int, default=None,
                        help="virtual XLA CPU devices of the SPMD worker (--config xla --device "
                        "cpu only; default 4)")
    parser.add_argument("--accelerators-per-worker", type=int, default=None, metavar="N",
                        help="NeuronCores (neuron) or TPU chips (tpu) each worker asks Ray for "
                        "(default 1; SPMD: all of a host's, e.g. 4)")
    parser.add_argument("--tpu-topology", default=None, help="TPU slice topology, e.g. 4x4 "
                        "(ScalingConfig(use_tpu=True, topology=...); needed for several workers)")
    parser.add_argument("--accelerator-type", default=None, help="e.g. TPU-V6E "
                        "(ScalingConfig(accelerator_type=...); needed for several workers)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (e.g. auto); default: an embedded local Ray")
    parser.add_argument("--model", default=None,
                        help="from_pretrained path (a hub name needs network); default: a small "
                        "random Llama and a byte-level tokenizer")
    parser.add_argument("--data", default=None, help="text file, one text per line; default: "
                        "a generated corpus")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="rows per worker per micro-batch (SPMD: split over its devices)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5, help="linear LR warm-up steps")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=10, metavar="N")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="N")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 on neuron/tpu, fp32 on the CPU")
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--crash-at", type=int, default=None, help="fail once after this step")
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "finetune_hf"),
                        help="run storage (shared by every node on a cluster: NFS, s3://, gs://)")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="Hugging Face model directory to write (default <storage>/<run>/hf)")
    parser.add_argument("--no-export", action="store_true", help="do not write the HF model")
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = 1 if (args.config == "xla" and args.device == "cpu") else 2
    check_args(parser, args)

    if not args.no_export:
        try:  # fail now, not after training
            from ray_train_xla.tools.consolidate import consolidate_hf  # noqa: F401
        except ImportError:
            parser.error("this ray_train_xla has no tools.consolidate.consolidate_hf to write "
                         "the Hugging Face model: pass --no-export")
    texts = read_texts(args.data)
    n_eval = max(1, int(len(texts) * EVAL_FRACTION))
    if (len(texts) - n_eval) // args.workers < args.batch_size or n_eval // args.workers < args.batch_size:
        parser.error(f"{len(texts)} texts ({n_eval} held out for eval) give some of the "
                     f"{args.workers} workers fewer than --batch-size {args.batch_size} rows")
    config = ft_config(model=args.model, steps=args.steps, batch_size=args.batch_size,
                       accum=args.accum, lr=args.lr, warmup=args.warmup,
                       max_grad_norm=args.max_grad_norm, eval_every=args.eval_every,
                       checkpoint_every=args.checkpoint_every, precision=args.precision,
                       crash_at=args.crash_at, marker_dir=tempfile.mkdtemp(prefix="finetune_hf-"))
    name = time.strftime(f"finetune_hf-{args.config}-%Y%m%d-%H%M%S")
    import ray

    if args.address:
        ray.init(address=args.address)
    else:
        # Logical CPUs for the workers and for Ray Data's tokenizing tasks, even on a small machine.
        ray.init(address="local", include_dashboard=False,
                 num_cpus=max(os.cpu_count() or 1, args.workers + 2))
    try:
        trainer = build_trainer(
            config, torch_config(args.config, args.device, args.devices),
            scaling_config(args.config, args.device, args.workers,
                           args.accelerators_per_worker or 1, args.tpu_topology,
                           args.accelerator_type),
            args.storage_path, name, texts, max_failures=args.max_failures)
        result = trainer.fit()
    finally:
        ray.shutdown()
    m = result.metrics or {}
    print(f"step {m.get('step')}: loss {m.get('loss'):.4f}, eval_loss {m.get('eval_loss'):.4f}, "
          f"{m.get('tokens_per_s', 0):.0f} tokens/s, {m.get('xla/compiles')} graphs compiled "
          f"({m.get('xla/compiles_after_warmup')} after warm-up); checkpoint {result.checkpoint}")
    if not args.no_export:
        out = args.export or os.path.join(args.storage_path, name, "hf")
        export_hf(result.checkpoint.path, out)
        print(f"Hugging Face model written to {out}: AutoModelForCausalLM.from_pretrained({out!r})")


if __name__ == "__main__":
    main()
