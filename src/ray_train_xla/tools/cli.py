"""``ray-train-xla``: demo, check, plan, doctor, consolidate, goodput, profile from the command
line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence

EXIT_FAILED = 1  # the command ran and failed
EXIT_USAGE = 2  # the command line is wrong
PORT_MAX = 65535
# `plan` describes at most this many workers (and accelerator ids): enough for any cluster,
# and bounded so that a typo (--nodes 99999999999) is refused rather than exhausting memory.
PLAN_MAX_WORKERS = 100_000
PLAN_MAX_ACCELERATORS = 1_000_000
TIMEOUT_MAX_S = 86_400.0

EXIT_STATUS_HELP = (
    "Exit status: 0 success; 1 the command ran and failed (doctor found a FAIL, the demo failed, "
    "a step of check failed, "
    "consolidate could not read the checkpoint's storage or write OUT, goodput could not read the "
    "run's storage or write the PNG, profile could not write its request or --wait ran out); "
    "2 the command line is "
    "wrong (an unknown or invalid option, a configuration the backend would refuse, a CHECKPOINT "
    "that does not exist or holds no model, an OUT that is a directory, a --hf config that is "
    "missing or does not fit the checkpoint, a RUN_PATH without goodput events). Every error is "
    "one line on stderr."
)


class CommandError(Exception):
    """An error the user can fix, printed as one line; ``exit_code``: EXIT_USAGE (the command
    line is wrong) or EXIT_FAILED (the command ran and failed)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line: what is wrong and where the usage is. The top
    parser's ``command_parsers`` maps each command to its parser."""

    command_parsers: dict[str, argparse.ArgumentParser]

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} "
                              f"(see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= TIMEOUT_MAX_S:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive number of seconds (at most {TIMEOUT_MAX_S:g})")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= PORT_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1 to {PORT_MAX})")
    return value


def _workers_per_node(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a count or a comma-separated count per node, got {text!r}"
        ) from None
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"every node needs at least one worker, got {text!r}")
    return counts


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    import ray_train_xla

    parser = Parser(
        prog="ray-train-xla",
        description="PyTorch/XLA (Trainium, TPU, CPU) backend for Ray Train: demo, check, plan, "
        "doctor, consolidate, goodput, profile. Without a command, prints this help.",
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {ray_train_xla.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.command_parsers = {name: add(sub) for name, add in COMMANDS}
    return parser


def _add_demo(sub) -> argparse.ArgumentParser:
    """``demo``: the seed check, or a training run (--train, --sharded), on Ray."""
    from ray_train_xla.tools.examples.cluster import add_cluster_args

    demo = sub.add_parser(
        "demo",
        help="run the seed check (or, with --train, a training run) on an embedded local Ray "
        "or a cluster",
        description="Run TorchTrainer with TorchXLAConfig on an embedded local Ray (or the "
        "cluster at --address), and have every worker all-reduce torch.ones(2, 3) on its XLA "
        "device N times, checking the result equals ones * world_size. With --train, train "
        "the packaged MLP example (examples/train_mlp.py) instead and print the loss and XLA "
        "compile counts as it goes down. With --sharded, train the packaged transformer LM "
        "example (examples/train_lm.py) sharded (FSDPv2) over --devices devices of each SPMD "
        "worker (virtual XLA CPU devices of one worker on the CPU), with Ray Data batches and "
        "sharded checkpoints, and print loss, compile counts and checkpoint sizes (about 40 s "
        "on the CPU). With --device neuron or tpu every worker asks Ray for its NeuronCores or "
        "TPU chips. Exits non-zero on failure.",
    )
    mode = demo.add_mutually_exclusive_group()
    mode.add_argument(
        "--train", action="store_true",
        help="train the example MLP (ray_train_xla.tools.examples.train_mlp) instead",
    )
    mode.add_argument(
        "--sharded", action="store_true",
        help="train the example transformer LM sharded (ray_train_xla.tools.examples.train_lm) "
        "instead",
    )
    demo.add_argument(
        "--workers", type=_positive_int, default=None,
        help="workers (default 2; with --sharded: SPMD workers, one per node, default 1, and 1 "
        "on the CPU)")
    demo.add_argument(
        "--iterations", type=_positive_int, default=None,
        help="all-reduces per worker of the seed check (default 10; not with --train or --sharded)"
    )
    demo.add_argument(
        "--devices", type=_positive_int, default=None,
        help="with --sharded: each SPMD worker's devices, virtual XLA CPU devices on the CPU, "
        "else NeuronCores / TPU chips asked of Ray (default 4)",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=None,
        help="training steps with --train or --sharded (default 40)",
    )
    demo.add_argument(
        "--storage-path", default=None, metavar="PATH",
        help="with --train or --sharded: where checkpoints go (default: a temporary directory, "
        "deleted after); on a cluster of several nodes a path every node reaches (shared "
        "filesystem, s3://, gs://)",
    )
    add_cluster_args(demo)
    return demo


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


def _add_check(sub) -> argparse.ArgumentParser:
    """``check``: prove a cluster trains, with a report to send back."""
    from ray_train_xla.tools.examples.cluster import add_cluster_args

    check = sub.add_parser(
        "check",
        help="run the cluster check: world, collectives, bandwidth, training, checkpoint, "
        "restart; writes report.md, report.json and bandwidth.png",
        description="Start a TorchTrainer with the chosen config (TorchXLAConfig, "
        "TorchNeuronConfig or TorchTPUConfig) on an embedded local Ray (or the cluster at "
        "--address), every worker asking Ray for its accelerators, and run in order: world "
        "(every worker's rank, node, device and environment against the plan computed from "
        "its own facts), correctness (all_reduce, all_gather, reduce_scatter, broadcast in "
        "float32 and bfloat16, exact), bandwidth (all_reduce, all_gather, reduce_scatter from "
        "8 B to --max-bytes, capped at an eighth of device memory; algbw and busbw as "
        "nccl-tests define them, within a node and across nodes, against the hardware's "
        "published figure where known), training (a small transformer, replicated under "
        "TorchXLAConfig, FSDP2 under the native configs: step time, tokens/s, no graph "
        "compiled after warm-up), checkpoint (saved through Ray, loaded on a fresh worker "
        "group of the same and of half the size, compared bit for bit) and restart (the "
        "graphs the restarted group compiles, cold and warm time to first step). Prints a "
        "table and writes report.md, report.json and bandwidth.png under --out. Exits 0 only "
        "when every step passes, 1 when one fails.",
    )
    check.add_argument("--config", default="xla", choices=["xla", "neuron", "tpu"],
                       help="xla: TorchXLAConfig; neuron: TorchNeuronConfig (native TorchNeuron); "
                       "tpu: TorchTPUConfig (native TorchTPU); default xla. Each runs on its "
                       "device or the CPU")
    check.add_argument("--workers", type=_positive_int, default=2,
                       help="workers of the main run (default 2); the reload runs half of them")
    check.add_argument("--accelerators-per-worker", type=_positive_int, default=1, metavar="N",
                       help="NeuronCores or TPU chips each worker asks Ray for (default 1)")
    check.add_argument("--out", default="ray-train-xla-check", metavar="DIR",
                       help="where report.md, report.json, bandwidth.png and (without "
                       "--storage-path) the checkpoints go (default ./ray-train-xla-check)")
    check.add_argument("--storage-path", default=None, metavar="PATH",
                       help="the runs' storage (RunConfig.storage_path): on several nodes a path "
                       "every node reaches (shared filesystem, s3://, gs://); default OUT/storage")
    check.add_argument("--max-bytes", type=_size, default=1 << 30, metavar="SIZE",
                       help="largest message of the bandwidth sweep (default 1GiB)")
    check.add_argument("--timeout", type=_positive_seconds, default=300.0, metavar="SECONDS",
                       help="the config's timeout_s: bound on the process group's start, on "
                       "gloo's collectives (not the device's) and on each answer to the driver "
                       "(default 300)")
    check.add_argument("--json", action="store_true", help="print report.json's content")
    add_cluster_args(check, device_default="auto", device_of="the device of the --config "
                     "(TorchXLAConfig.device, TorchNeuronConfig.device or TorchTPUConfig.device)")
    return check


def _add_plan(sub) -> argparse.ArgumentParser:
    """``plan``: every worker's environment for a described topology."""
    plan = sub.add_parser(
        "plan",
        help="print the environment each worker would get",
        description="Plan every worker's environment for a described topology, exactly as the "
        "backend would, without Ray or hardware. Rendezvous values (MASTER_PORT, run id) are "
        "examples: the backend takes free ports and a fresh id at every fit(). With --model, "
        "plan memory instead of the environment: the topology is checked the same way, then "
        "the model's parameters, gradients and AdamW state sharded over the devices (one per "
        "worker; with --spmd every device of each worker), the layers FSDP gathers, and what "
        "each host holds at load and at a checkpoint, in GiB; a layout that does not fit the "
        "device's memory (--accelerator-type or --device-memory) is refused with exit status 2. "
        "Activations are not counted.",
    )
    plan.add_argument(
        "--device", default="cpu", choices=["cpu", "neuron", "tpu"], help="device (default cpu)"
    )
    plan.add_argument(
        "--runtime", default="pjrt", choices=["pjrt", "xrt", "native"],
        help="default pjrt; native: TorchNeuronConfig (native TorchNeuron, Neuron SDK 2.30+) "
        "with --device neuron or cpu, TorchTPUConfig (native TorchTPU, torch-tpu) with --device tpu",
    )
    plan.add_argument(
        "--nodes", type=_positive_int, default=None,
        help="nodes (default: as many as --workers-per-node lists, else 1)",
    )
    plan.add_argument(
        "--workers-per-node", type=_workers_per_node, default=[1], metavar="N[,N...]",
        help="workers on each node: one count for all nodes, or one per node (the list gives "
        "the number of nodes; default 1)",
    )
    plan.add_argument(
        "--accelerators-per-worker", type=_positive_int, default=None,
        help="accelerator ids (NeuronCores, TPU chips) Ray assigns each worker "
        "(default: 1 on neuron/tpu, none on cpu). TPU: --nodes is the hosts, and "
        "--workers-per-node x --accelerators-per-worker the chips per host",
    )
    plan.add_argument(
        "--spmd", action="store_true",
        help="SPMD: one worker per node owning all its devices (TorchXLAConfig.spmd); for TPU "
        "pass --accelerators-per-worker <chips per host>",
    )
    plan.add_argument(
        "--cpu-devices-per-worker", type=_positive_int, default=None, metavar="N",
        help="XLA CPU devices per worker, CPU_NUM_DEVICES (TorchXLAConfig.cpu_devices_per_worker)",
    )
    plan.add_argument(
        "--efa", action="store_true",
        help="describe nodes with EFA devices (Neuron: plans the FI_* variables)",
    )
    plan.add_argument(
        "--interface", default="", metavar="NAME",
        help="network interface carrying the node IP, as workers detect it (Neuron: "
        "CCOM_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)",
    )
    plan.add_argument(
        "--compile-cache", default=None, metavar="URL",
        help="TorchXLAConfig.compile_cache (Neuron): a shared path or s3:// URL; with "
        "--runtime native, TorchNeuronConfig.compile_cache (TORCH_NEURONX_NEFF_CACHE_DIR)",
    )
    plan.add_argument(
        "--parallel-compile", action="store_true",
        help="TorchXLAConfig.neuron_parallel_compile=True (graph-extraction run)",
    )
    plan.add_argument(
        "--tpu-topology", default=None, metavar="AxB[xC]",
        help="TPU: the slice's chip topology as the hosts report it (TPU_TOPOLOGY, e.g. 2x4x4 "
        "for a v4-64, 4x4 for a v5litepod-16); TPU_PROCESS_BOUNDS follows from it. With "
        "--runtime native, each slice's topology (default: one host's chip grid, else "
        "2x2x<hosts per slice>); host n of a slice is described at its n-th position",
    )
    plan.add_argument(
        "--accelerator-type", default="", metavar="TYPE",
        help="TPU: the slice's accelerator type as the hosts report it (TPU_ACCELERATOR_TYPE, "
        "e.g. v4-64, v5p-128, v5litepod-16, v6e-256, tpu7x-32 or v7x-32); without "
        "--tpu-topology, that type's standard topology. TPU v7x: one worker per device (2 per "
        "chip, --workers-per-node 8 on a host of 4 chips), or --spmd. Neuron, with --model: "
        "trn1 or trn2 (or an instance type, trn2.48xlarge), for the device memory",
    )
    plan.add_argument(
        "--tpu-process-bounds", default=None, metavar="X,Y,Z",
        help="TorchXLAConfig.tpu_process_bounds (TPU): TPU_PROCESS_BOUNDS (and TPU_HOST_BOUNDS) "
        "when the slice's topology is unknown; with a known one it must equal the derived grid",
    )
    plan.add_argument(
        "--tpu-slices", type=_positive_int, default=1, metavar="N",
        help="--device tpu --runtime native: split the nodes into N TPU slices (multislice)",
    )
    plan.add_argument(
        "--master-port", type=_port, default=29500, metavar="PORT",
        help="example MASTER_PORT (default 29500); Neuron also uses the next port, "
        "for NEURON_RT_ROOT_COMM_ID",
    )
    plan.add_argument(
        "--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE",
        help="extra variable for every worker (TorchXLAConfig.env); repeatable",
    )
    plan.add_argument(
        "--model", default=None, metavar="PATH_OR_CONFIG_JSON",
        help="plan memory for this Hugging Face decoder instead of the environment: a model "
        "directory holding config.json, or a config.json (model_type llama, mistral, qwen2, "
        "qwen3, gemma or gemma2)",
    )
    plan.add_argument(
        "--sharding", default="fsdp", choices=["fsdp", "hsdp"],
        help="with --model: fsdp shards over every device (default); hsdp shards within a node "
        "and replicates across nodes (get_sharded_mesh('hsdp'))",
    )
    plan.add_argument(
        "--param-dtype", default="bf16", choices=["bf16", "fp32"],
        help="with --model: the sharded parameters and gradients (default bf16; fp32: master "
        "weights, computing in bf16 with mixed_precision='bf16')",
    )
    plan.add_argument(
        "--optimizer-dtype", default="fp32", choices=["fp32", "bf16"],
        help="with --model: AdamW's two states (default fp32, 8 bytes a parameter; "
        "torch.optim.AdamW over bf16 parameters keeps bf16 state)",
    )
    plan.add_argument(
        "--device-memory", type=_device_memory, default=None, metavar="SIZE",
        help="with --model: memory per device, e.g. 24GiB, 16GB, 95G or bytes (K, M, G, T are "
        "powers of 2, with or without iB); default: the published figure of --accelerator-type",
    )
    plan.add_argument("--json", action="store_true",
                      help="print a JSON list, one object a worker (with --model: one JSON "
                      "object, the memory plan)")
    return plan


def _device_memory(text: str) -> int:
    from ray_train_xla.planning.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_doctor(sub) -> argparse.ArgumentParser:
    """``doctor``: checks of this machine or of every node of a Ray cluster."""
    doctor = sub.add_parser(
        "doctor",
        help="check this machine (or every node of a Ray cluster) for PyTorch/XLA training",
        description="Check package versions (torch_xla built for the installed torch), "
        "PJRT_DEVICE and what device='auto' resolves to, Neuron devices against Ray's "
        "neuron_cores, NEURON_RT_VISIBLE_CORES, EFA, TPU chips against Ray's TPU resource, "
        "compile cache writability and free ports. Prints one row per check (OK, WARN, FAIL) "
        "with a one-line fix for every non-OK row; exits 1 when any check FAILs.",
    )
    doctor.add_argument(
        "--cluster", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help="also connect to a running Ray cluster (default address: auto, i.e. RAY_ADDRESS "
        "or the local cluster started with `ray start`) and run the checks on every alive node",
    )
    doctor.add_argument(
        "--timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
        help="bound on connecting, on each node's answer and on the torch_xla import "
        "(default 60)",
    )
    doctor.add_argument(
        "--no-load-check", dest="load_check", action="store_false",
        help="skip importing torch_xla in a subprocess (faster; versions are still checked)",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON: ok, checks[]")
    return doctor


def _add_consolidate(sub) -> argparse.ArgumentParser:
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
        "GB, MB or KB (powers of 10), e.g. 2GB, 500MB (default 5GB); a larger tensor gets a "
        "file of its own",
    )
    consolidate.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default=None,
        help="--hf: the exported dtype (default: the one the model's config names, i.e. the "
        "pretrained model's stored dtype; else the checkpoint's)",
    )
    consolidate.add_argument(
        "--timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
        help="bound on the first answer of a remote CHECKPOINT's storage (default 60)",
    )
    consolidate.add_argument("--json", action="store_true", help="print the summary as JSON")
    return consolidate


def _add_goodput(sub) -> argparse.ArgumentParser:
    """``goodput``: where a run's time went, from its storage."""
    goodput = sub.add_parser(
        "goodput",
        help="print a run's goodput (productive step time over wall-clock time) and where the "
        "rest went; --png draws it",
        description="Read the goodput events every worker's step timeline wrote into the run's "
        "storage (RUN_PATH/goodput/, written by runs of this package's backend) and print the "
        "run's wall-clock time by bucket: productive, start-up, compilation, data wait, "
        "checkpoint stall, lost to failures, restart, other; then one line per worker group "
        "(restarts and elastic resizes start a new one). The wall clock starts when the first "
        "worker group started. Exits 2 when RUN_PATH holds no goodput events, 1 when its "
        "storage cannot be read or FILE cannot be written.",
    )
    goodput.add_argument("run_path", metavar="RUN_PATH",
                         help="the run's directory: RunConfig(storage_path=...)/<name>, a local "
                         "path or a URI (s3://..., gs://...)")
    goodput.add_argument("--png", metavar="FILE", default=None,
                         help="also draw the run: one lane per worker, steps in their buckets, "
                         "compilations, checkpoints, failures and restarts (needs matplotlib)")
    goodput.add_argument("--json", action="store_true", help="print the figures as JSON")
    return goodput


def _add_profile(sub) -> argparse.ArgumentParser:
    """``profile``: ask a running run for a profile of every rank."""
    profile = sub.add_parser(
        "profile",
        help="ask a running run for a profile of the next N steps on every rank",
        description="Write a profile request into the run's storage (RUN: the run's directory, "
        "RunConfig(storage_path=...)/name, a local path or a URI such as s3://bucket/runs/x). "
        "Rank 0 of the run looks for requests every 2 s, picks the first step a few seconds of "
        "steps ahead and every rank captures those steps with its stack's profiler (torch_xla's "
        "profiler; torch.profiler on native TorchNeuron, TorchTPU and CPU), into "
        "RUN/profiles/<first step>/rank-<r>/. A run that is not going takes the request when it "
        "(re)starts. With --wait, waits for the traces of every rank and prints where they are. "
        "Exits 1 when --wait runs out or the storage cannot be written.",
    )
    profile.add_argument("run", metavar="RUN", help="the run's directory (a path or a URI)")
    profile.add_argument("--steps", type=_positive_int, required=True, metavar="N",
                         help="how many steps to capture")
    profile.add_argument("--wait", type=_positive_seconds, default=None, metavar="SECONDS",
                         help="wait up to SECONDS for every rank's trace")
    profile.add_argument("--json", action="store_true", help="print the outcome as JSON")
    return profile


# Each command and the function adding its parser, in the order --help lists them.
COMMANDS = (("demo", _add_demo), ("check", _add_check), ("plan", _add_plan), ("doctor", _add_doctor),
            ("consolidate", _add_consolidate), ("goodput", _add_goodput),
            ("profile", _add_profile))


def _describe_topology(args: argparse.Namespace):
    """(Topology, facts) for the cluster the flags describe."""
    from ray_train_xla.planning.topology import DESCRIBED_RESOURCE, Topology, described_facts

    counts = args.workers_per_node
    if len(counts) > 1:
        if args.nodes is not None and args.nodes != len(counts):
            raise CommandError(
                f"--workers-per-node {','.join(map(str, counts))} lists {len(counts)} nodes but "
                f"--nodes is {args.nodes}: give one count per node, or one count for all nodes"
            )
    else:
        nodes = 1 if args.nodes is None else args.nodes
        if counts[0] * nodes > PLAN_MAX_WORKERS:
            raise CommandError(
                f"--nodes {nodes} x --workers-per-node {counts[0]} is {counts[0] * nodes} "
                f"workers: plan describes at most {PLAN_MAX_WORKERS}"
            )
        counts = counts * nodes
    cores = args.accelerators_per_worker
    if cores is None:
        cores = 0 if args.device == "cpu" else 1
    workers = sum(counts)
    if workers > PLAN_MAX_WORKERS:
        raise CommandError(f"--workers-per-node gives {workers} workers: plan describes at most "
                           f"{PLAN_MAX_WORKERS}")
    if workers * cores > PLAN_MAX_ACCELERATORS:
        raise CommandError(
            f"--accelerators-per-worker {cores} for {workers} worker{'s' if workers > 1 else ''} is "
            f"{workers * cores} accelerator ids: plan describes at most {PLAN_MAX_ACCELERATORS}"
        )
    facts = described_facts(counts, cores, has_efa=args.efa, network_interface=args.interface)
    tpu_type, tpu_topology = args.accelerator_type, args.tpu_topology or ""
    if tpu_type.strip().lower().startswith("trn"):
        if args.device != "neuron" or args.model is None:
            raise CommandError(f"--accelerator-type {tpu_type} names a Neuron device for the memory "
                               "plan: use it with --device neuron --model ...")
        tpu_type = ""  # the memory plan's; the hosts report no such fact
    if tpu_type or tpu_topology:
        if args.device != "tpu":
            flag = "--accelerator-type" if tpu_type else "--tpu-topology"
            raise CommandError(f"{flag} describes a TPU slice: use it with --device tpu")
        # What every TPU host reports (Ray reads it from GKE's variables or the GCE metadata).
        facts = [dataclasses.replace(f, tpu_accelerator_type=tpu_type, tpu_topology=tpu_topology)
                 for f in facts]
    if args.runtime == "native" and args.device == "tpu":
        from ray_train_xla.planning.runtimes.native_tpu import describe_slices

        # TorchTPUConfig's hosts: slices, each host at its place in its slice's chip grid.
        facts = describe_slices(facts, args.tpu_topology, args.tpu_slices)
    # The workers own accelerator ids only when they were described with some (not on cpu).
    return Topology.from_facts(facts, DESCRIBED_RESOURCE if cores else None), facts


def cmd_plan(args: argparse.Namespace) -> int:
    # The planning core only: neither Ray nor torch is imported. Its XLAConfigError (a
    # configuration the backend would refuse) is reported by main() as a usage error.
    from ray_train_xla.planning.options import XLAOptions
    from ray_train_xla.planning.planner import Rendezvous, get_runtime, plan

    config = _native_options(args) if args.runtime == "native" else XLAOptions(
        device=args.device,
        runtime=args.runtime,
        env=dict(args.env),
        compile_cache=args.compile_cache,
        neuron_parallel_compile=args.parallel_compile,
        spmd=args.spmd,
        cpu_devices_per_worker=args.cpu_devices_per_worker,
        tpu_process_bounds=args.tpu_process_bounds,
    )
    topology, facts = _describe_topology(args)
    runtime = get_runtime(args.device, args.runtime)
    if args.tpu_slices > 1 and not (args.runtime == "native" and args.device == "tpu"):
        raise CommandError("--tpu-slices describes TorchTPUConfig's hosts: use it with "
                           "--device tpu --runtime native")
    runtime.check(config, topology)
    if args.model is not None:
        return _plan_memory(args, topology)
    for flag, given in (("--sharding", args.sharding != "fsdp"),
                        ("--param-dtype", args.param_dtype != "bf16"),
                        ("--optimizer-dtype", args.optimizer_dtype != "fp32"),
                        ("--device-memory", args.device_memory is not None)):
        if given:
            raise CommandError(f"{flag} plans memory: use it with --model PATH_OR_CONFIG_JSON")
    master = topology.workers[runtime.master_worker(topology)]
    needed = runtime.ports_needed(config)
    if args.master_port + needed > PORT_MAX:
        raise CommandError(
            f"--master-port {args.master_port} is too high: this plan also takes the "
            f"{'next port' if needed == 1 else f'next {needed} ports'} (--device {args.device}), "
            f"so it must be at most {PORT_MAX - needed}"
        )
    rdzv = Rendezvous(
        master_addr=master.node_ip,
        master_port=args.master_port,
        extra_ports=tuple(args.master_port + 1 + i for i in range(needed)),
        run_id="example-run-id",
    )
    plans = plan(topology, config, rdzv, args.device, facts)
    if args.json:
        # One worker per line: readable, greppable, and fast at thousands of workers.
        sys.stdout.write("[\n" + ",\n".join(json.dumps(p.to_json()) for p in plans) + "\n]\n")
        return 0
    print(format_plan_table([p.to_json() for p in plans]))
    return 0


def _plan_memory(args: argparse.Namespace, topology) -> int:
    """``plan --model``: the memory table (or JSON) of the described topology; a layout that does
    not fit the device's memory raises XLAConfigError (exit status 2)."""
    from ray_train_xla.planning import memory
    from ray_train_xla.planning.runtimes.tpu import devices_per_chip

    per_worker = 1
    if args.spmd:  # one worker owns every device of its host
        per_worker = args.accelerators_per_worker or args.cpu_devices_per_worker or 1
        if args.device == "tpu":
            per_worker *= devices_per_chip(args.accelerator_type)
    per_node: dict[str, int] = {}
    for w in topology.workers:
        per_node[w.node_id] = per_node.get(w.node_id, 0) + per_worker
    if args.sharding == "hsdp" and len(set(per_node.values())) > 1:
        raise CommandError(f"--sharding hsdp shards within a node, so every node needs the same "
                           f"number of workers, not {','.join(map(str, per_node.values()))}")
    lnc = dict(args.env).get("NEURON_LOGICAL_NC_CONFIG")
    found = memory.device_memory(args.accelerator_type, int(lnc) if lnc in ("1", "2") else None)
    if args.device_memory is not None:
        found = memory.DeviceMemory(
            found.name if found else "given", args.device_memory,
            found.device if found else "device", "--device-memory")
    plan = memory.plan_memory(
        memory.model_shape(memory.load_model_config(args.model)),
        devices=sum(per_node.values()), devices_per_host=max(per_node.values()),
        sharding=args.sharding, param_dtype=args.param_dtype,
        optimizer_dtype=args.optimizer_dtype, memory=found)
    plan.check()
    if args.json:
        print(json.dumps(plan.to_json()))
    else:
        print(memory.format_memory_table(plan))
    return 0


def _native_options(args: argparse.Namespace):
    """TorchNeuronConfig's (or with --device tpu, TorchTPUConfig's) options from the plan flags
    (XLA-only flags are refused)."""
    from ray_train_xla.errors import config_error
    from ray_train_xla.planning.options import NEURON_OWNER, TPU_OWNER, NeuronOptions, TPUOptions

    owner = TPU_OWNER if args.device == "tpu" else NEURON_OWNER
    for flag, value in (("spmd", args.spmd), ("neuron_parallel_compile", args.parallel_compile),
                        ("cpu_devices_per_worker", args.cpu_devices_per_worker),
                        ("tpu_process_bounds", args.tpu_process_bounds),
                        ("efa", args.efa and args.device == "tpu")):
        if value:
            raise config_error(flag, value, "no value: it is a TorchXLAConfig option", owner=owner)
    if args.device == "tpu":
        return TPUOptions(device="tpu", env=dict(args.env), compile_cache=args.compile_cache)
    return NeuronOptions(device=args.device, env=dict(args.env), compile_cache=args.compile_cache)


def format_plan_table(rows: Sequence[dict]) -> str:
    """Variables shared by all workers once, then one row per worker with the rest."""
    keys = sorted({k for r in rows for k in r["env"]})
    shared = [k for k in keys if len({r["env"].get(k) for r in rows}) == 1
              and all(k in r["env"] for r in rows)]
    varying = [k for k in keys if k not in shared]
    lines = [f"{len(rows)} workers. Shared by every worker:"]
    lines += [f"  {k}={rows[0]['env'][k]}" for k in shared]
    header = ["rank", "local", "node", *varying]
    table = [header] + [
        [str(r["rank"]), str(r["local_rank"]), str(r["node_rank"]),
         *(r["env"].get(k, "-") for k in varying)]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines.append("Per worker:")
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines)


def _run_job(banner: str, job, **kwargs):
    """Print what runs, run it; a training failure is printed as one FAILED line (None
    returned). A configuration refused before the run starts is a usage error."""
    from ray_train_xla.errors import XLAConfigError, run_failure
    from ray_train_xla.tools.examples.cluster import ExampleUsageError

    print(banner, flush=True)
    try:
        return job(**kwargs)
    except ExampleUsageError as exc:
        raise CommandError(str(exc)) from exc
    except XLAConfigError:
        raise
    except Exception as exc:  # any training failure is a failed demo, not a traceback
        print(f"FAILED: {run_failure(exc)}", file=sys.stderr)
        return None


# demo: which flags each mode takes, and their defaults there (None: refused in that mode).
DEMO_DEFAULTS = {
    "seed check": {"workers": 2, "iterations": 10, "steps": None, "devices": None,
                   "storage_path": None},
    "--train": {"workers": 2, "iterations": None, "steps": 40, "devices": None,
                "storage_path": ""},
    "--sharded": {"workers": 1, "iterations": None, "steps": 40, "devices": 4,
                  "storage_path": ""},
}


def _demo_flags(args: argparse.Namespace) -> str:
    """Fill in the demo's defaults for its mode; refuse a flag the mode does not take. Returns
    the mode."""
    mode = "--sharded" if args.sharded else "--train" if args.train else "seed check"
    for name, default in DEMO_DEFAULTS[mode].items():
        given = getattr(args, name)
        if default is None and given is not None:
            flag = "--" + name.replace("_", "-")
            takes = [m for m, d in DEMO_DEFAULTS.items() if d[name] is not None]
            raise CommandError(f"{flag} goes with {' or '.join(takes)}, not the {mode}"
                               if mode == "seed check" else
                               f"{flag} does not go with {mode} (it goes with "
                               f"{' or '.join(takes)})")
        if given is None:
            setattr(args, name, default or None)
    from ray_train_xla.tools.examples.cluster import ExampleUsageError, check_cluster
    from ray_train_xla.tools.examples.train_lm import check_workers

    try:  # refused before Ray starts
        if mode == "--sharded":
            check_workers(args.device, args.workers)
        check_cluster(args.device, args.workers, args.tpu_topology, args.accelerator_type)
    except ExampleUsageError as exc:
        raise CommandError(str(exc)) from exc
    return mode


def _where(args: argparse.Namespace) -> str:
    return f"the Ray cluster at {args.address}" if args.address else "an embedded local Ray"


def _cluster_kwargs(args: argparse.Namespace) -> dict:
    return {"device": args.device, "address": args.address, "tpu_topology": args.tpu_topology,
            "accelerator_type": args.accelerator_type}


def cmd_train_demo(args: argparse.Namespace) -> int:
    from ray_train_xla.tools.demo import run_train_demo

    summary = _run_job(
        f"ray-train-xla demo --train: {args.workers} workers, device={args.device}, "
        f"{args.steps} steps of the example MLP (train_mlp) on {_where(args)}...",
        run_train_demo, workers=args.workers, steps=args.steps, storage_path=args.storage_path,
        **_cluster_kwargs(args))
    if summary is None:
        return 1
    print(f"{'step':>6}  {'loss':>10}  {'compiles':>8}  {'after warm-up':>13}  {'compile s':>9}")
    for m in summary.history:
        print(f"{m['step']:>6}  {m['loss']:>10.5f}  {m['xla/compiles']:>8}  "
              f"{m['xla/compiles_after_warmup']:>13}  {m['xla/compile_time_s']:>9.2f}")
    status = "OK" if summary.ok else "FAILED"
    first, last = (summary.history[0], summary.history[-1]) if summary.history else ({}, {})
    print(f"{status}: loss {first.get('loss', float('nan')):.5f} -> "
          f"{last.get('loss', float('nan')):.5f} in {summary.steps} steps, "
          f"{len(summary.history)} checkpoints reported, time={summary.seconds:.1f}s")
    return 0 if summary.ok else 1


def cmd_sharded_demo(args: argparse.Namespace) -> int:
    from ray_train_xla.tools.demo import run_sharded_demo

    what = (f"1 SPMD worker, {args.devices} virtual XLA CPU devices" if args.device == "cpu" else
            f"{args.workers} SPMD worker{'s' if args.workers > 1 else ''}, {args.devices} "
            f"devices each, device={args.device}")
    summary = _run_job(
        f"ray-train-xla demo --sharded: {what}, {args.steps} steps of the example transformer "
        f"LM (train_lm) on {_where(args)}...",
        run_sharded_demo, devices=args.devices, steps=args.steps, workers=args.workers,
        storage_path=args.storage_path, **_cluster_kwargs(args))
    if summary is None:
        return 1
    print(f"{'step':>6}  {'loss':>8}  {'compiles':>8}  {'after warm-up':>13}  {'checkpoint':>22}")
    for m in summary.history:
        size = f"{m['checkpoint_bytes'] / 1e6:.2f} MB in {m['checkpoint_files']} files"
        print(f"{m['step']:>6}  {m['loss']:>8.4f}  {m['xla/compiles']:>8}  "
              f"{m['xla/compiles_after_warmup']:>13}  {size:>22}")
    status = "OK" if summary.ok else "FAILED"
    first, last = (summary.history[0], summary.history[-1]) if summary.history else ({}, {})
    print(f"{status}: loss {first.get('loss', float('nan')):.4f} -> {last.get('loss', float('nan')):.4f} "
          f"in {summary.steps} steps; {summary.parameters} parameters sharded over {args.devices} "
          f"devices per worker; time={summary.seconds:.1f}s")
    return 0 if summary.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from ray_train_xla.tools.demo import run_demo

    mode = _demo_flags(args)
    if mode == "--sharded":
        return cmd_sharded_demo(args)
    if mode == "--train":
        return cmd_train_demo(args)

    summary = _run_job(
        f"ray-train-xla demo: {args.workers} workers, device={args.device}, "
        f"{args.iterations} all-reduces each, on {_where(args)}...",
        run_demo, workers=args.workers, iterations=args.iterations, **_cluster_kwargs(args))
    if summary is None:
        return 1
    status = "OK" if summary.ok else "FAILED"
    print(
        f"{status}: workers={summary.workers} device={summary.device} "
        f"(PJRT_DEVICE={summary.pjrt_device}, process group={summary.process_group}) "
        f"iterations={summary.iterations} all_reduce(ones(2,3)) == ones*{summary.workers} "
        f"time={summary.seconds:.1f}s"
    )
    return 0 if summary.ok else 1


def cmd_check(args: argparse.Namespace) -> int:
    from ray_train_xla.tools import check as tool
    from ray_train_xla.tools.examples.cluster import ExampleUsageError, check_cluster

    options = tool.CheckOptions(
        config=args.config, device=args.device, workers=args.workers,
        accelerators_per_worker=args.accelerators_per_worker, address=args.address,
        tpu_topology=args.tpu_topology, accelerator_type=args.accelerator_type, out=args.out,
        storage_path=args.storage_path, max_bytes=args.max_bytes, timeout_s=args.timeout)
    try:
        options.validate()
        check_cluster(args.device, args.workers, args.tpu_topology, args.accelerator_type)
    except (tool.CheckUsageError, ExampleUsageError) as exc:
        raise CommandError(str(exc)) from exc
    if not args.json:
        print(f"ray-train-xla check: {tool.CONFIG_CLASSES[args.config]}, {args.workers} workers, "
              f"device={args.device}, on {_where(args)}...", flush=True)
    try:
        result = tool.run_check(options)
    except (tool.CheckUsageError, ExampleUsageError) as exc:
        raise CommandError(str(exc)) from exc
    if args.json:
        print(json.dumps(result, default=str))
    else:
        from ray_train_xla.tools.check_report import to_table

        print(to_table(result))
        for step in result["steps"]:
            for failure in step.get("failures", []):
                print(f"  {step['name']}: {failure}")
        print(f"\nreport: {', '.join(result['files'].values())}")
    return 0 if result["ok"] else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from ray_train_xla.tools import doctor

    if args.cluster is None:
        rows = doctor.run_local(load_check=args.load_check, timeout_s=args.timeout)
    else:
        if not args.json:
            print(f"ray-train-xla doctor: connecting to Ray at {args.cluster}...", flush=True)
        rows = doctor.run_cluster(args.cluster, load_check=args.load_check, timeout_s=args.timeout)
    if args.json:
        json.dump(doctor.to_json(rows), sys.stdout, indent=2)
        print()
    else:
        print(doctor.format_table(rows))
    return 1 if doctor.failed(rows) else 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from ray_train_xla.tools import consolidate as tool

    if args.hf:
        return _consolidate_hf(args)
    if args.config is not None or args.max_shard_size is not None or args.dtype is not None:
        raise CommandError("--config, --max-shard-size and --dtype go with --hf (a Hugging Face "
                           "export)")
    try:
        summary = tool.consolidate(args.checkpoint, args.out, torch_file=args.torch_file,
                                   timeout_s=args.timeout)
    except tool.ConsolidateError as exc:
        raise CommandError(str(exc), exc.exit_code) from exc
    if args.json:
        print(json.dumps(summary))
    else:
        kind = "sharded" if summary["sharded"] else "replicated"
        print(f"{summary['out']}: {summary['tensors']} tensors, {summary['parameters']} parameters, "
              f"{summary['bytes']} bytes (from a {kind} checkpoint)")
    return 0


def _consolidate_hf(args: argparse.Namespace) -> int:
    from ray_train_xla.tools import consolidate as tool

    if args.torch_file is not None:
        raise CommandError("--torch does not go with --hf: the Hugging Face export is safetensors")
    try:
        summary = tool.consolidate_hf(
            args.checkpoint, args.out, config=args.config,
            max_shard_size=(tool.DEFAULT_MAX_SHARD_SIZE if args.max_shard_size is None
                            else args.max_shard_size),
            timeout_s=args.timeout, dtype=args.dtype)
    except tool.ConsolidateError as exc:
        raise CommandError(str(exc), exc.exit_code) from exc
    if args.json:
        print(json.dumps(summary))
    else:
        kind = "sharded" if summary["sharded"] else "replicated"
        tied = f", tied: {', '.join(summary['tied'])}" if summary["tied"] else ""
        print(f"{summary['out_dir']}: {summary['architecture']} ({summary['dtype']}), "
              f"{summary['tensors']} tensors, {summary['parameters']} parameters, "
              f"{summary['bytes']} bytes in {summary['shards']} safetensors "
              f"file{'s' if summary['shards'] > 1 else ''}{tied} (from a {kind} checkpoint, "
              f"config from {summary['config']}); load it with "
              f"transformers.AutoModelForCausalLM.from_pretrained({summary['out_dir']!r})")
    return 0


def cmd_goodput(args: argparse.Namespace) -> int:
    from ray_train_xla.tools import goodput as tool

    try:
        result = tool.goodput_of(args.run_path)
    except tool.GoodputError as exc:
        raise CommandError(f"{args.run_path}: {exc}") from exc
    except OSError as exc:
        raise CommandError(f"{args.run_path}: cannot read the run's storage: {exc}",
                           EXIT_FAILED) from exc
    if args.png is not None:
        try:
            tool.draw(result, args.png)
        except ImportError as exc:
            raise CommandError(f"--png needs matplotlib (pip install matplotlib): {exc}",
                               EXIT_FAILED) from exc
        except OSError as exc:
            raise CommandError(f"cannot write {args.png}: {exc}", EXIT_FAILED) from exc
    if args.json:
        out = result.to_json()
        if args.png is not None:
            out["png"] = args.png
        print(json.dumps(out))
    else:
        print(tool.format_table(result))
        if args.png is not None:
            print(f"\nwrote {args.png}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from ray_train_xla.toolkit import profiling
    from ray_train_xla.toolkit.run_storage import RunStorage

    try:
        storage = RunStorage.at(args.run)
        request_id = profiling.write_request(storage, args.steps)
    except Exception as exc:  # noqa: BLE001 (storage errors are the user's to fix)
        raise CommandError(f"could not write a profile request under {args.run}: "
                           f"{type(exc).__name__}: {exc}", EXIT_FAILED) from exc
    out = {"id": request_id, "run": storage.path, "steps": args.steps}
    if args.wait is not None:
        out.update(profiling.wait_for_profile(storage, request_id, args.wait))
    if args.json:
        print(json.dumps(out))
    elif args.wait is None:
        print(f"profile request {request_id} ({args.steps} steps) written under "
              f"{storage.full(profiling.REQUESTS)}; the traces will be under "
              f"{storage.full(profiling.PROFILES)}/<first step>/rank-<r>/")
    elif out.get("complete"):
        missed = sorted(r for r, state in out["ranks"].items() if state == "missed")
        print(f"steps {out['start']}-{out['start'] + out['count'] - 1} of "
              f"{out['world_size'] - len(missed)} of {out['world_size']} ranks: "
              f"{storage.full(out['directory'])}"
              + (f" (missed by ranks {missed}: they learned of it too late)" if missed else ""))
    if args.wait is not None and not out.get("complete"):
        raise CommandError(f"profile request {request_id}: {out.get('state')} after "
                           f"{args.wait:g} s", EXIT_FAILED)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: sys.argv[1:]); returns the exit status.

    Every error a user can cause is one line on stderr, ``ray-train-xla COMMAND: error: ...``:
    usage and configuration errors (argparse's, XLAConfigError, CommandError) exit 2, a command
    that ran and failed exits 1. Anything else is a bug and keeps its traceback."""
    from ray_train_xla.errors import XLAConfigError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_help()
        return 0
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command's parser, which argparse would leave to the top one
            parser.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE if exc.code else 0
    commands = {"plan": cmd_plan, "demo": cmd_demo, "check": cmd_check, "doctor": cmd_doctor,
                "consolidate": cmd_consolidate, "goodput": cmd_goodput, "profile": cmd_profile}
    prog = f"{parser.prog} {args.command}"
    try:
        code = commands[args.command](args)
        sys.stdout.flush()
    except XLAConfigError as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ray-train-xla plan --json | head`): stop quietly, as Unix
        # tools do, without a traceback when Python flushes stdout at exit.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
