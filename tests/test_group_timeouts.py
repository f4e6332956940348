"""Every process group the package creates besides the default one is bounded by the config's
``timeout_s``: the toolkit's host groups (checkpoint writes, FSDP2's start-up, sharded loads)
and the CPU development mode's groups. Two processes (gloo, no Ray): the default group waits
60 s, ``timeout_s`` is 3 s; rank 1 withholds a collective on each helper group, and rank 0's
must fail within the 3 s (plus the time to notice), not after the default group's 60 s or
torch's 30-minute default for a new group."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import pytest

TIMEOUT_S = 3


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RAY_TRAIN_XLA_TIMEOUT_S=str(TIMEOUT_S),
                      TORCHELASTIC_RUN_ID=f"timeouts-{port}")
    import torch
    import torch.distributed as dist

    from ray_train_xla.startup import devmode
    from ray_train_xla.toolkit.collectives import host_group

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    groups = {"host_group": host_group("checkpoint"),
              "devmode": devmode._new_group(backend="gloo")}  # noqa: SLF001 - the group it makes
    result = {}
    if rank == 1:  # withholds the collectives; waits until rank 0 has given up on both
        time.sleep(2 * TIMEOUT_S + 6)
        os._exit(0)
    for name, group in groups.items():
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            result[name] = {"error": None}
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            result[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        result[name]["seconds"] = time.monotonic() - start
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # the groups are broken: no collective teardown


def test_a_withheld_collective_on_a_helper_group_fails_within_timeout_s(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.json")
    mp.spawn(_worker, args=(port, out), nprocs=2)
    with open(out) as f:
        result = json.load(f)
    for name in ("host_group", "devmode"):
        assert result[name]["error"], (name, result)
        assert result[name]["seconds"] < TIMEOUT_S + 4, (name, result)


if __name__ == "__main__":
    pytest.main([__file__])
