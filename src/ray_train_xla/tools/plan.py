"""``ray-train-xla plan``: every worker's environment for a described topology, or with
``--model`` the memory of a model sharded over it, without Ray or hardware. The topology and the
configuration are checked as the backend would check them (``cmd_plan``), then
``plan_environment`` or ``plan_memory`` prints the plan."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Sequence

from ray_train_xla.tools.args import CommandError, positive_float, positive_int

PORT_MAX = 65535
# `plan` describes at most this many workers (and accelerator ids): enough for any cluster,
# and bounded so that a typo (--nodes 99999999999) is refused rather than exhausting memory.
PLAN_MAX_WORKERS = 100_000
PLAN_MAX_ACCELERATORS = 1_000_000


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


def _dp_shard(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, or -1 for every device the "
                                         f"others leave, got {text!r}")
    return value


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_parser(sub) -> argparse.ArgumentParser:
    """``plan``: every worker's environment for a described topology."""
    from ray_train_xla.planning.memory import DEFAULT_MICRO_BATCH, DEFAULT_SEQ_LEN

    plan = sub.add_parser(
        "plan",
        help="print the environment each worker would get",
        description="Plan every worker's environment for a described topology, exactly as the "
        "backend would, without Ray or hardware. Rendezvous values (MASTER_PORT, run id) are "
        "examples: the backend takes free ports and a fresh id at every fit(). With --model, "
        "plan memory instead of the environment: the topology is checked the same way, then "
        "the model's parameters, gradients and AdamW state laid out over the devices (one per "
        "worker; with --spmd every device of each worker), tensor parallelism inside a node "
        "and FSDP over the rest, the layers FSDP gathers, the activations at --seq-len and "
        "--micro-batch and the logits, and what each host holds at load and at a checkpoint "
        "(the staging pool's sets, the memory tier's copies), in GiB (2^30 bytes). Without "
        "--tp it picks the smallest TP that fits a device with 10% left. A plan that does not "
        "fit the device's memory (--accelerator-type or --device-memory) or the host's (a "
        "Trainium instance type, or --host-memory) is refused with exit status 2, naming only "
        "changes that were planned again and fit; one above 90% of either is a warning.",
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
        "--nodes", type=positive_int, default=None,
        help="nodes (default: as many as --workers-per-node lists, else 1)",
    )
    plan.add_argument(
        "--workers-per-node", type=_workers_per_node, default=[1], metavar="N[,N...]",
        help="workers on each node: one count for all nodes, or one per node (the list gives "
        "the number of nodes; default 1)",
    )
    plan.add_argument(
        "--accelerators-per-worker", type=positive_int, default=None,
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
        "--cpu-devices-per-worker", type=positive_int, default=None, metavar="N",
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
        help="the config's compile_cache, a directory every node shares: TorchXLAConfig's "
        "(Neuron: or an s3:// URL); with --runtime native, TorchNeuronConfig's "
        "(TORCH_NEURONX_NEFF_CACHE_DIR) or TorchTPUConfig's (TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT, "
        "or a gs:// URL)",
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
        help="TPU (both runtimes): the slice's accelerator type as the hosts report it "
        "(TPU_ACCELERATOR_TYPE: v4, v5p, v5litepod or v5e, v6e, tpu7x or v7x, e.g. v6e-16); "
        "without --tpu-topology it gives that type's standard topology (v6e-16: 4x4, 4 hosts "
        "of 4 chips), and the hosts and workers per host must fill the slice; an unknown type "
        "or a size that is not a slice of its generation is refused. TPU v7x: one worker per "
        "device (2 per chip, --workers-per-node 8 on a host of 4 chips), or --spmd. Neuron "
        "(every runtime): a Trainium instance type or generation (trn1.2xlarge, trn1.32xlarge, "
        "trn1n.32xlarge, trn2.3xlarge, trn2.48xlarge, trn2u.48xlarge, trn3; trn1, trn2: their "
        "largest instance): each node's workers x --accelerators-per-worker are checked against "
        "its logical NeuronCores at NEURON_LOGICAL_NC_CONFIG (--env; default 2 on trn2 and "
        "trn3); it also gives the MFU peak and with --model the device memory",
    )
    plan.add_argument(
        "--tpu-process-bounds", default=None, metavar="X,Y,Z",
        help="TorchXLAConfig.tpu_process_bounds (TPU): TPU_PROCESS_BOUNDS (and TPU_HOST_BOUNDS) "
        "when the slice's topology is unknown; with a known one it must equal the derived grid",
    )
    plan.add_argument(
        "--tpu-slices", type=positive_int, default=1, metavar="N",
        help="--device tpu --runtime native: split the nodes into N TPU slices (multislice)",
    )
    plan.add_argument(
        "--peak-tflops", type=positive_float, default=None, metavar="TFLOPS",
        help="the config's peak_tflops: the peak TFLOP/s of one device that MFU is taken "
        "against (RAY_TRAIN_XLA_PEAK_TFLOPS); without it the table's last line says the "
        "published peak of --accelerator-type, where given",
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
        "--tp", type=positive_int, default=None, metavar="N",
        help="the config's parallelism: N devices per tensor-parallel group (parallelism={'tp': "
        "N}), inside a node; the environment plan shows RAY_TRAIN_XLA_LAYOUT and each worker's "
        "coordinates. With --model: plan this TP (default: the smallest that fits, within a "
        "node). TorchXLAConfig only with --spmd",
    )
    plan.add_argument(
        "--dp-replicate", type=positive_int, default=None, metavar="N",
        help="the config's parallelism: N data-parallel replicas (HSDP), each sharding the "
        "model over its devices (default 1)",
    )
    plan.add_argument(
        "--dp-shard", type=_dp_shard, default=None, metavar="N",
        help="the config's parallelism: N devices per replica's FSDP group (default -1: every "
        "device --tp and --dp-replicate leave)",
    )
    plan.add_argument(
        "--model", default=None, metavar="PATH_OR_HUB_ID",
        help="plan memory for this Hugging Face decoder instead of the environment: a model "
        "directory holding config.json, a config.json, or a Hugging Face Hub id "
        "org/name[@revision] that is no existing path, whose config.json alone is fetched into "
        "the Hugging Face cache (HF_HUB_CACHE; HF_HUB_OFFLINE and HF_TOKEN apply) (model_type "
        "llama, mistral, qwen2, qwen3, gemma, gemma2 or gemma3_text); with --runtime native, or "
        "--spmd (a config that shards)",
    )
    plan.add_argument(
        "--sharding", default="fsdp", choices=["fsdp", "hsdp"],
        help="with --model: fsdp shards over every device the TP groups leave (default); hsdp "
        "shards within a node and replicates across nodes (get_sharded_mesh('hsdp'), as "
        "--dp-replicate <nodes>)",
    )
    plan.add_argument(
        "--seq-len", type=positive_int, default=None, metavar="TOKENS",
        help=f"with --model: tokens a sequence, for the activations (default {DEFAULT_SEQ_LEN})",
    )
    plan.add_argument(
        "--micro-batch", type=positive_int, default=None, metavar="N",
        help=f"with --model: sequences each device computes at once, for the activations "
        f"(default {DEFAULT_MICRO_BATCH})",
    )
    plan.add_argument(
        "--activation-checkpointing", action="store_true",
        help="with --model: each decoder layer recomputed in backward "
        "(prepare_sharded_model(..., activation_checkpointing=True)): a layer keeps its input",
    )
    plan.add_argument(
        "--sequence-parallel", action="store_true",
        help="with --model and a TP above 1: the norms and the residual stream split on the "
        "sequence over the tensor-parallel group (sequence parallelism)",
    )
    plan.add_argument(
        "--loss-parallel", action="store_true",
        help="with --model and a TP above 1: the logits stay split on the vocabulary for the "
        "loss (torch's loss_parallel) instead of gathered whole",
    )
    plan.add_argument(
        "--param-dtype", default="fp32", choices=["fp32", "bf16"],
        help="with --model: the sharded parameters and their gradients. fp32 (default): "
        "load_pretrained(model, path, dtype=torch.float32, mixed_precision='bf16') or "
        "prepare_sharded_model(model, mixed_precision='bf16') over a model in fp32, then "
        "torch.optim.AdamW(model.parameters()): FSDP2 computes in bf16 and reduces gradients "
        "in fp32 (with --spmd, FSDPv2 has no mixed precision: it computes in fp32). bf16: "
        "load_pretrained(model, path, dtype=torch.bfloat16), or a model built in bf16, then "
        "torch.optim.AdamW",
    )
    plan.add_argument(
        "--optimizer-dtype", default=None, choices=["fp32", "bf16"],
        help="with --model: AdamW's two states (default: --param-dtype's, as "
        "torch.optim.AdamW keeps them; the other dtype needs an optimizer of your own)",
    )
    plan.add_argument(
        "--device-memory", type=_memory_size, default=None, metavar="SIZE",
        help="with --model: memory per device; GiB (and G) are 2^30 bytes, GB 10^9 (24GiB, "
        "95G, 16GB = 14.90 GiB; TiB/TB, MiB/MB likewise) or bytes; default: the published "
        "figure of --accelerator-type",
    )
    plan.add_argument(
        "--host-memory", type=_memory_size, default=None, metavar="SIZE",
        help="with --model: memory per host (node), as --device-memory reads it; default: the "
        "published figure of a Trainium instance type (--accelerator-type trn2.48xlarge: "
        "2048GiB)",
    )
    plan.add_argument(
        "--max-in-flight", type=positive_int, default=2, metavar="N",
        help="with --model: rtx.configure_reports(max_in_flight=N), checkpoints that may wait "
        "for Ray at once (default 2): the staging pool keeps up to N + 1 host copies",
    )
    plan.add_argument(
        "--memory-every", type=positive_int, default=None, metavar="N",
        help="the config's memory_every: the memory tier keeps every N-th step in host memory "
        "(RAY_TRAIN_XLA_MEMORY_EVERY); with --model, its copies are counted per host "
        "(default: off, as the config)",
    )
    plan.add_argument("--json", action="store_true",
                      help="print a JSON list, one object a worker (with --model: one JSON "
                      "object, the memory plan)")
    return plan


def _memory_size(text: str) -> int:
    from ray_train_xla.planning.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_plan(args: argparse.Namespace) -> int:
    """Check the described topology and configuration as the backend would, then plan memory
    (--model) or every worker's environment."""
    # The planning core only: neither Ray nor torch is imported. Its XLAConfigError (a
    # configuration the backend would refuse) is reported by main() as a usage error.
    from ray_train_xla.planning.options import XLAOptions
    from ray_train_xla.planning.planner import get_runtime

    with plan_flags():
        config = _native_options(args) if args.runtime == "native" else XLAOptions(
            device=args.device,
            runtime=args.runtime,
            env=dict(args.env),
            compile_cache=args.compile_cache,
            neuron_parallel_compile=args.parallel_compile,
            spmd=args.spmd,
            cpu_devices_per_worker=args.cpu_devices_per_worker,
            tpu_process_bounds=args.tpu_process_bounds,
            peak_tflops=args.peak_tflops,
            memory_every=args.memory_every,
            parallelism=parallelism(args),
        )
    topology, facts = _describe_topology(args)
    runtime = get_runtime(args.device, args.runtime)
    if args.tpu_slices > 1 and not (args.runtime == "native" and args.device == "tpu"):
        raise CommandError("--tpu-slices describes TorchTPUConfig's hosts: use it with "
                           "--device tpu --runtime native")
    with plan_flags():
        runtime.check(config, topology)
    if args.model is not None:
        return plan_memory(args, config, topology)
    return plan_environment(args, config, runtime, topology, facts)


def parallelism(args: argparse.Namespace):
    """The config's ``parallelism`` as ``--tp``, ``--dp-replicate`` and ``--dp-shard`` give it;
    None when none is given."""
    from ray_train_xla.planning.layout import REST, Parallelism

    if args.tp is None and args.dp_replicate is None and args.dp_shard is None:
        return None
    return Parallelism(tp=args.tp or 1, dp_replicate=args.dp_replicate or 1,
                       dp_shard=REST if args.dp_shard is None else args.dp_shard)


@contextlib.contextmanager
def plan_flags():
    """The backend's checks say what to change in the Python API's words (``ScalingConfig``,
    the config's fields); ``plan`` prints the same message in its own flags."""
    from ray_train_xla.errors import XLAConfigError

    try:
        yield
    except XLAConfigError as exc:
        raise XLAConfigError(exc.for_plan()) from None


def check_trainium_nodes(args: argparse.Namespace, counts: list[int], per_worker: int) -> None:
    """``--device neuron --accelerator-type``: a known Trainium instance, whose logical
    NeuronCores (at ``--env NEURON_LOGICAL_NC_CONFIG``, else the generation's default) hold
    every node's workers x ``per_worker`` cores."""
    from ray_train_xla.planning.hardware import (
        LNC_VAR,
        TRAINIUM_GENERATIONS,
        trainium_instance,
        trainium_lnc,
    )

    try:
        instance = trainium_instance(args.accelerator_type)
        lnc = trainium_lnc(instance, dict(args.env).get(LNC_VAR))
    except ValueError as exc:
        raise CommandError(f"--accelerator-type {args.accelerator_type}: {exc}") from None
    gen = TRAINIUM_GENERATIONS[instance.generation]
    cores = instance.devices(lnc)
    if max(counts) * per_worker <= cores:
        return
    given = (f"--accelerators-per-worker {per_worker}" if args.spmd else
             f"--workers-per-node {','.join(map(str, counts)) if len(set(counts)) > 1 else counts[0]}"
             + (f" x --accelerators-per-worker {per_worker}" if per_worker > 1 else ""))
    others = [f"{instance.devices(v)} at {LNC_VAR}={v}" for v in gen.lnc if v != lnc]
    raise CommandError(
        f"{given} is not valid with --accelerator-type {args.accelerator_type}: a "
        f"{instance.name} node has {cores} NeuronCores at {LNC_VAR}={lnc} ({instance.chips} "
        f"{gen.chip} x {gen.cores_per_chip} {gen.core} / {lnc}), one per worker"
        f"{' (one process owning them with --spmd)' if args.spmd else ''}, and a node here "
        f"asks for {max(counts) * per_worker}: at most "
        + (f"--accelerators-per-worker {cores}" if args.spmd else
           f"--workers-per-node {cores // per_worker}")
        + (f" ({', '.join(others)}, set with --env)" if others else "")
        + ". docs/trainium.md, 'Workers per node', lists every instance.")


def _describe_topology(args: argparse.Namespace):
    """(Topology, facts) for the cluster the flags describe."""
    from ray_train_xla.planning.hardware import tpu_generation
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
    cores = args.accelerators_per_worker or (0 if args.device == "cpu" else 1)
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
        if args.device != "neuron":
            raise CommandError(f"--accelerator-type {tpu_type} names a Trainium instance: use "
                               "it with --device neuron")
        check_trainium_nodes(args, counts, max(cores, 1))
        tpu_type = ""  # the hosts report no such fact
    elif tpu_type and args.device == "neuron" and not tpu_generation(tpu_type):
        check_trainium_nodes(args, counts, max(cores, 1))  # refuses it, naming the known ones
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
        facts = describe_slices(facts, tpu_type, args.tpu_topology, args.tpu_slices)
    # The workers own accelerator ids only when they were described with some (not on cpu).
    return Topology.from_facts(facts, DESCRIBED_RESOURCE if cores else None), facts


def _native_options(args: argparse.Namespace):
    """TorchNeuronConfig's (or with --device tpu, TorchTPUConfig's) options from the plan flags
    (XLA-only flags are refused)."""
    from ray_train_xla.errors import config_error
    from ray_train_xla.planning.options import NEURON_OWNER, TPU_OWNER, NeuronOptions, TPUOptions

    owner, cls = (TPU_OWNER, TPUOptions) if args.device == "tpu" else (NEURON_OWNER, NeuronOptions)
    for flag, value in (("spmd", args.spmd), ("neuron_parallel_compile", args.parallel_compile),
                        ("cpu_devices_per_worker", args.cpu_devices_per_worker),
                        ("tpu_process_bounds", args.tpu_process_bounds),
                        ("efa", args.efa and args.device == "tpu")):
        if value:
            raise config_error(flag, value, "no value: it is a TorchXLAConfig option", owner=owner)
    return cls(device=args.device, env=dict(args.env), compile_cache=args.compile_cache,
               peak_tflops=args.peak_tflops, memory_every=args.memory_every,
               parallelism=parallelism(args))


def plan_environment(args: argparse.Namespace, config, runtime, topology, facts) -> int:
    """``plan``: every worker's environment, a table or (--json) one JSON object a worker; the
    memory plan's flags are refused."""
    from ray_train_xla.planning.planner import Rendezvous, plan, worker_layouts

    for flag, given in (("--sharding", args.sharding != "fsdp"),
                        ("--param-dtype", args.param_dtype != "fp32"),
                        ("--optimizer-dtype", args.optimizer_dtype is not None),
                        ("--device-memory", args.device_memory is not None),
                        ("--host-memory", args.host_memory is not None),
                        ("--max-in-flight", args.max_in_flight != 2),
                        ("--seq-len", args.seq_len is not None),
                        ("--micro-batch", args.micro_batch is not None),
                        ("--activation-checkpointing", args.activation_checkpointing),
                        ("--sequence-parallel", args.sequence_parallel),
                        ("--loss-parallel", args.loss_parallel)):
        if given:
            raise CommandError(f"{flag} plans memory: use it with --model PATH_OR_HUB_ID")
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
    with plan_flags():
        plans = plan(topology, config, rdzv, args.device, facts)
    rows = [p.to_json() for p in plans]
    for row, place in zip(rows, worker_layouts(config, plans) or ()):
        row["layout"] = place  # the worker's coordinates (under SPMD: its devices)
    if args.json:
        # One worker per line: readable, greppable, and fast at thousands of workers.
        sys.stdout.write("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
        return 0
    print(format_plan_table(rows))
    peak = planned_peak(args)
    if peak:
        print(peak)
    return 0


def planned_peak(args: argparse.Namespace) -> str:
    """The line that says the peak MFU is taken against, where the command line tells it: the
    config's (--peak-tflops), else the published figure of --accelerator-type (Neuron at
    --env NEURON_LOGICAL_NC_CONFIG); "" where the workers find it themselves."""
    from ray_train_xla.planning.peaks import LNC_VAR, device_peak

    if args.peak_tflops:
        return f"MFU peak: {args.peak_tflops:g} TFLOP/s per device (--peak-tflops)"
    if args.device not in ("neuron", "tpu") or not args.accelerator_type:
        return ""
    lnc = dict(args.env).get(LNC_VAR, "").strip()
    found = device_peak(args.accelerator_type, 1 if lnc == "1" else None)
    if found is None:
        return f"MFU peak: none published for {args.accelerator_type}: give --peak-tflops"
    return (f"MFU peak: {found.bf16:g} TFLOP/s per device, the published bf16 peak of a "
            f"{found.device} ({found.source})")


def format_plan_table(rows: Sequence[dict]) -> str:
    """Variables shared by all workers once, then one row per worker with the rest; with a
    layout, the layout's line and each worker's coordinates and data-parallel rank (under
    SPMD, the ranks of its devices in the layout)."""
    from ray_train_xla.planning.contract import LAYOUT_VAR
    from ray_train_xla.planning.layout import Layout

    keys = sorted({k for r in rows for k in r["env"]})
    shared = [k for k in keys if len({r["env"].get(k) for r in rows}) == 1
              and all(k in r["env"] for r in rows)]
    varying = [k for k in keys if k not in shared]
    lines = [f"{len(rows)} workers. Shared by every worker:"]
    lines += [f"  {k}={rows[0]['env'][k]}" for k in shared]
    places = [r["layout"] for r in rows if "layout" in r]
    columns: list[str] = []
    if places:
        columns = ["devices"] if "devices" in places[0] else [*places[0]]
        lines.append(f"Layout: {Layout.from_text(rows[0]['env'][LAYOUT_VAR]).describe()} "
                     f"({LAYOUT_VAR}; " + (
                         "each worker holds several devices: their ranks in the layout"
                         if columns == ["devices"] else "each worker's coordinates, from its "
                         "RANK") + ", row-major, tp innermost)")

    def place(r: dict) -> list[str]:
        at = r.get("layout", {})
        if columns == ["devices"]:
            return [f"{at['first_device']}-{at['first_device'] + at['devices'] - 1}"]
        return [str(at.get(c, "-")) for c in columns]

    header = ["rank", "local", "node", *columns, *varying]
    table = [header] + [
        [str(r["rank"]), str(r["local_rank"]), str(r["node_rank"]), *place(r),
         *(r["env"].get(k, "-") for k in varying)]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines.append("Per worker:")
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines)


def plan_memory(args: argparse.Namespace, config, topology) -> int:
    """``plan --model``: the memory table (or JSON) of the described topology, at the layout
    ``--tp`` / ``--dp-replicate`` / ``--dp-shard`` give, or with the smallest TP that fits
    (``memory.pick_tp``); a plan that does not fit the device's or the host's memory raises
    XLAConfigError (exit status 2)."""
    import functools

    from ray_train_xla.errors import XLAConfigError
    from ray_train_xla.planning import memory
    from ray_train_xla.planning.layout import REST, Parallelism
    from ray_train_xla.planning.planner import layout_owner, resolve_layout
    from ray_train_xla.planning.runtimes.tpu import devices_per_chip

    if args.runtime != "native" and not args.spmd:
        raise CommandError(
            f"--model plans a sharded model, but TorchXLAConfig(runtime={args.runtime!r}) without "
            "spmd=True does not shard: prepare_sharded_model refuses there (it needs SPMD), and "
            "each worker would hold the whole model. Plan FSDPv2 with --spmd "
            "(TorchXLAConfig(spmd=True), one worker per node owning its devices"
            + (": give --accelerators-per-worker <chips per host>" if args.device == "tpu" else "")
            + "), or FSDP2 with --runtime native ("
            + ("TorchTPUConfig" if args.device == "tpu" else "TorchNeuronConfig") + ")")
    if args.sharding == "hsdp" and args.dp_replicate is not None:
        raise CommandError("--sharding hsdp makes a replica of each node: give it or "
                           "--dp-replicate, not both")
    per_worker = 1
    if args.spmd:  # one worker owns every device of its host
        per_worker = args.accelerators_per_worker or args.cpu_devices_per_worker or 1
        if args.device == "tpu":
            per_worker *= devices_per_chip(args.accelerator_type)
    node_of_device = [w.node_id for w in topology.workers for _ in range(per_worker)]
    per_node = Counter(node_of_device)
    if args.sharding == "hsdp" and len(set(per_node.values())) > 1:
        raise CommandError(f"--sharding hsdp shards within a node, so every node needs the same "
                           f"number of workers, not {','.join(map(str, per_node.values()))}")
    lnc = dict(args.env).get("NEURON_LOGICAL_NC_CONFIG")
    found = memory.device_memory(args.accelerator_type, int(lnc) if lnc in ("1", "2") else None)
    if args.device_memory is not None:
        found = memory.DeviceMemory(
            found.name if found else "given", args.device_memory,
            found.device if found else "device", "--device-memory")
    host = memory.host_memory(args.accelerator_type)
    if args.host_memory is not None:
        host = memory.HostMemory(host.name if host else "host", args.host_memory,
                                 "--host-memory")
    shape = memory.model_shape(memory.load_model_config(args.model))
    devices, per_host = len(node_of_device), max(per_node.values())
    sizes = {"dp_replicate": args.dp_replicate or 1,
             "dp_shard": REST if args.dp_shard is None else args.dp_shard}
    owner = layout_owner(config)
    if args.tp is not None:
        with plan_flags():
            layout = resolve_layout(Parallelism(tp=args.tp, **sizes), node_of_device, owner)
            layout.check_model(**shape.tp_sizes(), owner=owner)
        choices = [args.tp]
    else:  # the TP degrees these nodes and this model allow, smallest first
        choices = []
        for tp in memory.Cluster(devices, per_host).tp_choices(shape):
            try:
                resolve_layout(Parallelism(tp=tp, **sizes), node_of_device, owner)
            except XLAConfigError:
                continue
            choices.append(tp)
        if not choices:  # even TP 1 is refused: say why
            with plan_flags():
                resolve_layout(Parallelism(**sizes), node_of_device, owner)
    options = dict(
        sharding=args.sharding, **sizes, param_dtype=args.param_dtype,
        optimizer_dtype=args.optimizer_dtype,
        stack="fsdp2" if args.runtime == "native" else "fsdpv2",
        seq_len=args.seq_len or memory.DEFAULT_SEQ_LEN,
        micro_batch=args.micro_batch or memory.DEFAULT_MICRO_BATCH,
        activation_checkpointing=args.activation_checkpointing,
        sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel,
        memory=found, host=host, max_in_flight=args.max_in_flight,
        memory_every=args.memory_every)
    with plan_flags():
        plan, tried = memory.pick_tp(shape, devices=devices, devices_per_host=per_host,
                                     choices=choices, **options)
    if args.tp is not None:
        tried = []
    plan.check(functools.partial(memory.larger_clusters, accelerator_type=args.accelerator_type,
                                 spmd=args.spmd), tried)
    if args.json:
        out = plan.to_json()
        if tried:
            out["picked"] = {"tp": plan.layout.tp, "choices": choices, "tried": [
                {"tp": p.layout.tp, "total": p.total, "fits": p.fits, "roomy": p.roomy}
                for p in tried]}
        print(json.dumps(out))
    else:
        print(memory.format_memory_table(plan, tried))
    return 0
