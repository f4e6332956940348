"""The checks of the native torch-neuronx test double, as pure functions (no torch, no side
effects), so tests apply them to planned environments as well (``doubles/torch_neuronx``)."""

from __future__ import annotations

VISIBLE = "NEURON_RT_VISIBLE_CORES"
ROOT = "NEURON_RT_ROOT_COMM_ID"
CACHE = "TORCH_NEURONX_NEFF_CACHE_DIR"
CACHE_DEFAULT = "/tmp/neff_cache"
EFA_VARS = ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE")
ONE_DEVICE = "Attempted to have more than one device per process in distributed setup"
NOT_BEFORE = "Neuron runtime should not be initialized before the init_process_group."


def parse_cores(text: str) -> list[str]:
    cores: list[str] = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        first, sep, last = part.partition("-")
        if sep and first.isdigit() and last.isdigit():
            cores.extend(str(i) for i in range(int(first), int(last) + 1))
        else:
            cores.append(part)
    return cores


def runtime_view(env, rank: int, node: str, host_ranks, root_port: int) -> dict:
    """What ``_neuron_runtime_setup`` makes of ``env`` on ``rank`` (pure: ``env`` is copied).
    ``host_ranks``: the ranks whose host IP equals this rank's (the store fallback's grouping);
    ``root_port``: the port rank 0 would choose."""
    env = dict(env)
    if env.get("LOCAL_RANK") is not None and env.get("LOCAL_WORLD_SIZE") is not None:
        local_rank, lws, source = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]), "env"
    else:
        ranks = sorted(host_ranks)
        local_rank, lws, source = ranks.index(rank), len(ranks), "hostname"
    if not env.get(VISIBLE):
        env[VISIBLE] = str(local_rank)
    preset = env.get(ROOT) is not None
    if not preset:
        env[ROOT] = f"{env.get('MASTER_ADDR', 'localhost')}:{root_port}"
    return {
        "rank": rank,
        "node": node,
        "local_rank": local_rank,
        "local_world_size": lws,
        "local_rank_source": source,
        "visible_cores": parse_cores(env[VISIBLE]),
        "visible_cores_text": env[VISIBLE],
        "root_comm_id": env[ROOT],
        "root_comm_preset": preset,
        "cache_dir": env.get(CACHE) or CACHE_DEFAULT,
        "cache_dir_set": bool(env.get(CACHE)),
        "accelerate_device": env.get("ACCELERATE_TORCH_DEVICE"),
        "efa": {k: env[k] for k in EFA_VARS if k in env},
    }


def process_error(view: dict) -> str | None:
    """The error this process's init raises (None: it initialises)."""
    if len(view["visible_cores"]) != 1:
        return f"AssertionError: {ONE_DEVICE}"
    return None


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def world_problems(views) -> list[str]:
    """Every precondition of a working native multi-process run that ``views`` break."""
    problems: list[str] = []
    views = sorted(views, key=lambda v: v["rank"])
    nodes: dict[str, list[dict]] = {}
    for v in views:
        nodes.setdefault(v["node"], []).append(v)
        if v["local_rank_source"] != "env":
            problems.append(f"rank {v['rank']}: LOCAL_RANK/LOCAL_WORLD_SIZE missing at init "
                            "(ranks grouped by host IP)")
        error = process_error(v)
        if error:
            problems.append(f"rank {v['rank']}: {error} ({VISIBLE}={v['visible_cores_text']!r})")
        device = v["accelerate_device"] or ""
        if not device.startswith("neuron"):
            problems.append(f"rank {v['rank']}: ACCELERATE_TORCH_DEVICE={device!r} is not a "
                            "neuron device")
        elif device != f"neuron:{v['local_rank']}":
            problems.append(f"rank {v['rank']}: ACCELERATE_TORCH_DEVICE={device!r} is not "
                            f"neuron:{v['local_rank']}")
    for node, members in nodes.items():
        cores = [c for v in members for c in v["visible_cores"]]
        if len(cores) != len(set(cores)):
            problems.append(f"node {node}: NeuronCores claimed by several processes ({cores})")
        local = sorted(v["local_rank"] for v in members)
        if local != list(range(len(members))) or {v["local_world_size"] for v in members} != {
                len(members)}:
            problems.append(f"node {node}: local ranks {local} do not number its {len(members)} "
                            "processes")
    roots = {v["root_comm_id"] for v in views}
    if len(roots) != 1:
        problems.append(f"{ROOT} differs between ranks: {sorted(roots)}")
    presets = {v["root_comm_preset"] for v in views}
    if len(presets) != 1:
        problems.append(f"{ROOT} preset on some ranks only: the others block on the store")
    if len(nodes) > 1:
        for root in sorted(roots):
            if _is_loopback(root.rsplit(":", 1)[0]):
                problems.append(f"{ROOT}={root} is a loopback address on {len(nodes)} nodes")
        caches = {v["cache_dir"] for v in views}
        if len(caches) != 1 or not all(v["cache_dir_set"] for v in views):
            problems.append(f"{CACHE} is not one shared directory on {len(nodes)} nodes "
                            f"({sorted(caches)}; the default {CACHE_DEFAULT} is per node)")
    return problems
