"""``ray-train-xla consolidate``: its parser and its command. The work is consolidate.py's,
imported when the command runs (it imports torch)."""

from __future__ import annotations

import argparse
import json

from ray_train_xla.tools.args import CommandError, positive_seconds


def add_parser(sub) -> argparse.ArgumentParser:
    """``consolidate``: one file of the full model from a checkpoint."""
    consolidate = sub.add_parser(
        "consolidate",
        help="write the full model of a (sharded or replicated) checkpoint: one safetensors "
        "file, or with --hf a Hugging Face save_pretrained directory",
        description="Read a checkpoint written by save_checkpoint (sharded: every rank's "
        "torch.distributed.checkpoint files; or replicated: checkpoint.pt) on the CPU, without "
        "torch_xla, and write the model's full tensors to OUT as safetensors, under the unwrapped "
        "model's names (FSDPv2's _orig_module. prefix removed). Load it with "
        "safetensors.torch.load_file(OUT) and model.load_state_dict(...). "
        "With --hf (consolidate CHECKPOINT OUT_DIR --hf [--config MODEL_DIR] [--dtype DTYPE] "
        "[--max-shard-size SIZE]), OUT is a directory in the layout of Hugging Face Transformers' "
        "save_pretrained (config.json, generation_config.json, the tokenizer files of a "
        "--config directory, model.safetensors, or shards of at most --max-shard-size with "
        "model.safetensors.index.json; tied weights written once), for "
        "AutoModelForCausalLM.from_pretrained(OUT) (or the class config.json names): the "
        "model is built on the meta device from the config of --config, else from the "
        "checkpoint's 'hf_config' entry (save_checkpoint({..., 'hf_config': "
        "model.config.to_dict()})), the checkpoint's tensor names and shapes are checked "
        "against it, and a sharded checkpoint is streamed: one tensor at a time is read (all "
        "its shards, none of the optimizer state), converted to --dtype (default: the config's "
        "dtype, the pretrained model's) and written, so the model need not fit in this "
        "machine's memory. OUT is created if missing; OUT holding "
        "model files already (config.json, *.safetensors, ...) is refused, never overwritten; "
        "other files in it are kept. --hf needs transformers "
        "(pip install transformers, or pip install '.[hf]' in a checkout of ray-train-xla). "
        "Without --hf the whole model is held in memory. "
        "Exits 2 when CHECKPOINT does not exist, is not a "
        "checkpoint or has no model, OUT is a directory (with --hf: a file, or holds a model), "
        "or (--hf) the config is missing or does not fit the checkpoint; 1 when the "
        "checkpoint's storage cannot be read or OUT cannot be written. OUT is written whole or "
        "not at all.",
    )
    consolidate.add_argument("checkpoint", metavar="CHECKPOINT",
                             help="checkpoint directory (or a URI Ray Train can read, e.g. s3://...)")
    consolidate.add_argument("out", metavar="OUT",
                             help="safetensors file to write (with --hf: the directory)")
    consolidate.add_argument(
        "--model", metavar="ENTRY", default="model",
        help="the checkpoint's model to write: the entry it was saved under, e.g. ema for "
        "save_checkpoint({'model': model, 'ema': ema, ...}) (default model)",
    )
    consolidate.add_argument("--torch", dest="torch_file", metavar="FILE", default=None,
                             help="also write the same tensors with torch.save to FILE")
    consolidate.add_argument(
        "--hf", action="store_true",
        help="write a Hugging Face save_pretrained directory (config.json, safetensors) to OUT",
    )
    consolidate.add_argument(
        "--config", metavar="MODEL_DIR", default=None,
        help="--hf: the model's config, a directory holding config.json (a model directory or "
        "a saved config) or a config.json file (default: the checkpoint's 'hf_config' entry)",
    )
    consolidate.add_argument(
        "--max-shard-size", metavar="SIZE", default=None,
        help="--hf: the largest safetensors file, as transformers parses it: digits and TB, "
        "GB, MB or KB (powers of 10, the Hugging Face convention: 5GB is 5 x 10^9 bytes, 4.66 "
        "GiB), e.g. 2GB, 500MB (default 5GB); a larger tensor gets a file of its own",
    )
    consolidate.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default=None,
        help="--hf: the exported dtype (default: the one the model's config names, i.e. the "
        "pretrained model's stored dtype; else the checkpoint's)",
    )
    consolidate.add_argument(
        "--timeout", type=positive_seconds, default=60.0, metavar="SECONDS",
        help="bound on the first answer of a remote CHECKPOINT's storage (default 60)",
    )
    consolidate.add_argument("--json", action="store_true", help="print the summary as JSON")
    return consolidate


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ray_train_xla.tools import consolidate as tool

    if args.hf and args.torch_file is not None:
        raise CommandError("--torch does not go with --hf: the Hugging Face export is safetensors")
    if not args.hf and (args.config is not None or args.max_shard_size is not None
                        or args.dtype is not None):
        raise CommandError("--config, --max-shard-size and --dtype go with --hf (a Hugging Face "
                           "export)")
    try:
        if args.hf:
            summary = tool.consolidate_hf(
                args.checkpoint, args.out, config=args.config,
                max_shard_size=(tool.DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None
                                else args.max_shard_size),
                timeout_s=args.timeout, dtype=args.dtype, model=args.model)
        else:
            summary = tool.consolidate(args.checkpoint, args.out, torch_file=args.torch_file,
                                       timeout_s=args.timeout, model=args.model)
    except tool.ConsolidateError as exc:
        raise CommandError(str(exc), exc.exit_code) from exc
    kind = "sharded" if summary["sharded"] else "replicated"
    if args.json:
        print(json.dumps(summary))
    elif args.hf:
        tied = f", tied: {', '.join(summary['tied'])}" if summary["tied"] else ""
        print(f"{summary['out_dir']}: {summary['architecture']} ({summary['dtype']}), "
              f"{summary['tensors']} tensors, {summary['parameters']} parameters, "
              f"{summary['bytes']} bytes in {summary['shards']} safetensors "
              f"file{'s' if summary['shards'] > 1 else ''}{tied} (from a {kind} checkpoint, "
              f"config from {summary['config']}); load it with "
              f"transformers.AutoModelForCausalLM.from_pretrained({summary['out_dir']!r})")
    else:
        print(f"{summary['out']}: {summary['tensors']} tensors, {summary['parameters']} parameters, "
              f"{summary['bytes']} bytes (from a {kind} checkpoint)")
    return 0
