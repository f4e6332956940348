"""What torch_xla's XRT initialisation (torch-neuronx 1.x) reads and sets, for the XRT contract.

torch_xla 1.13 cannot be installed next to torch_xla 2.9, so this is a line-by-line model of the
environment logic of ``init_xrt_context`` (pytorch/xla v2.0.0
``torch_xla/_internal/xrt_init.py``, the mechanism the ``xla`` process group runs under torchrun
when ``TORCHELASTIC_RUN_ID`` is set), on Neuron, with the
TCPStore replaced by a dict shared by all workers. Ports and host names it would take are
placeholders. Reading a variable the original reads with ``os.environ[...]`` raises KeyError
exactly where the original would.
"""

from __future__ import annotations

READ = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT")


def publish(env: dict, store: dict) -> None:
    """What each node's local rank 0 puts in the store before the others read it."""
    if int(env["LOCAL_RANK"]) == 0:
        store[f"worker_{int(env['GROUP_RANK'])}_address"] = f"host{env['GROUP_RANK']}:9000"


def init_xrt_context(env: dict, store: dict) -> dict:
    """The environment one worker ends with, plus ``_starts_server`` (local rank 0 launches
    ``_xrt_run_server``). Call ``publish`` for every worker first."""
    env = dict(env)
    if "TORCHELASTIC_RUN_ID" not in env:
        raise RuntimeError("ProcessGroupXla runs init_xrt_context only under TORCHELASTIC_RUN_ID")
    rank = int(env["RANK"])
    local_rank = int(env["LOCAL_RANK"])
    world_size = int(env["WORLD_SIZE"])
    group_rank = int(env["GROUP_RANK"])
    local_world_size = int(env["LOCAL_WORLD_SIZE"])
    env["MASTER_ADDR"], env["MASTER_PORT"]  # noqa: B018 (read, as the original does)
    for var in ("XRT_TPU_CONFIG", "TPU_NUM_DEVICES", "GPU_NUM_DEVICES"):
        env.pop(var, None)
    # _set_tpu_xrt_envs
    total_nodes = world_size // local_world_size
    config = []
    for i in range(total_nodes):
        address = store[f"worker_{i}_address"]
        config.append(f"{'localservice' if total_nodes == 1 else 'c_localservice'};{i};{address}")
    if rank == 0:
        env["XRT_TPU_CONFIG"] = "|".join(config)
        env["TPU_NUM_DEVICES"] = str(local_world_size)
    env["XRT_LOCAL_WORKER"] = (f"localservice:{group_rank}" if total_nodes == 1
                               else f"c_localservice:{group_rank}")
    env["XRT_SHARD_WORLD_SIZE"] = str(world_size)
    env["XRT_HOST_WORLD_SIZE"] = str(total_nodes)
    env["XRT_SHARD_ORDINAL"] = str(rank)
    env["XRT_SHARD_LOCAL_ORDINAL"] = str(local_rank)
    env["XRT_MULTI_PROCESSING_DEVICE"] = f"TPU:{rank}"
    env["XRT_START_LOCAL_SERVER"] = "0"
    # _setup_nccl_service and _set_neuron_envs
    env["NEURON_RT_ROOT_COMM_ID"] = store.setdefault("nccl_info", "host0:9100")
    env["NEURON_USE_LOAD_COLLECTIVES"] = "1"
    env["NEURON_GLOBAL_DEVICE_ID"] = str(rank)
    env["NEURON_GLOBAL_DEVICE_COUNT"] = str(world_size)
    if not env.get("NEURON_RT_VISIBLE_CORES"):
        env["NEURON_RT_VISIBLE_CORES"] = ",".join(str(i) for i in range(local_world_size))
    env["_starts_server"] = str(local_rank == 0)
    return env
