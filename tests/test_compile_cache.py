"""torch_xla's persistent compilation cache, as planned.

- TPU: every worker's plan sets what ``torch_xla.runtime.initialize_cache(path, readonly)``
  would set in that worker (checked against torch_xla's own function in a fresh process):
  ``compile_cache`` or the per-host default, local rank 0 writing, the others reading.
- CPU: not planned, because torch_xla 2.9's CPU client cannot load a cached executable: a
  second process finds the cached graph and compiles it again anyway. If a torch_xla release
  makes this test fail, the cache works on CPU and should be planned there too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ray_train_xla import TorchXLAConfig, XLAConfigError
from ray_train_xla.planning import Rendezvous, plan
from ray_train_xla.planning.runtimes.tpu import DEFAULT_XLA_CACHE_DIR
from ray_train_xla.planning.topology import Topology, WorkerFacts

CACHE_VARS = ("XLA_PERSISTENT_CACHE_PATH", "XLA_PERSISTENT_CACHE_READ_ONLY")


def tpu_plan(workers_per_host: int, hosts: int, **config) -> list[dict]:
    chips = 4 // workers_per_host
    facts = [WorkerFacts(node_id=f"n{h}", node_ip=f"10.0.0.{h + 1}", pid=100 + w,
                         accelerator_ids={"TPU": tuple(str(w * chips + c) for c in range(chips))},
                         tpu_worker_id=h)
             for h in range(hosts) for w in range(workers_per_host)]
    rdzv = Rendezvous(master_addr="10.0.0.1", master_port=1234, run_id="r")
    cfg = TorchXLAConfig(device="tpu", **config)
    return [p.env for p in plan(Topology.from_facts(facts, "TPU"), cfg, rdzv, "tpu", facts)]


def initialize_cache_envs(cases: list[tuple[str, bool]]) -> list[dict]:
    """What torch_xla's initialize_cache(path, readonly) sets for each case, in one fresh
    process (no computation runs in it, so the function may be called again)."""
    code = (f"import json, os, torch_xla.runtime as xr\nout = []\n"
            f"for path, ro in {cases!r}:\n"
            f"    xr.initialize_cache(path, readonly=ro)\n"
            f"    out.append({{k: os.environ.get(k) for k in {CACHE_VARS!r}}})\n"
            f"print(json.dumps(out))")
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PJRT_DEVICE": "CPU"},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def initialize_cache_sets() -> dict:
    cases = [(path, ro) for path in (DEFAULT_XLA_CACHE_DIR, "/fsx/xla-cache") for ro in (False, True)]
    return dict(zip(cases, initialize_cache_envs(cases)))


@pytest.mark.parametrize("compile_cache", [None, "/fsx/xla-cache"])
def test_tpu_plans_set_what_initialize_cache_sets(compile_cache, initialize_cache_sets):
    envs = tpu_plan(workers_per_host=4, hosts=2, compile_cache=compile_cache)
    path = compile_cache or DEFAULT_XLA_CACHE_DIR
    expected = {lr: initialize_cache_sets[(path, lr != 0)] for lr in (0, 1)}
    for env in envs:
        got = {k: env[k] for k in CACHE_VARS}
        assert got == expected[min(int(env["LOCAL_RANK"]), 1)], env["RANK"]
    spmd = tpu_plan(workers_per_host=1, hosts=2, spmd=True, compile_cache=compile_cache)
    assert all({k: env[k] for k in CACHE_VARS} == expected[0] for env in spmd)


def test_tpu_cache_url_is_refused_before_start():
    with pytest.raises(XLAConfigError, match="compile_cache.*directory path"):
        tpu_plan(workers_per_host=1, hosts=1, compile_cache="s3://bucket/cache")


def test_cpu_plans_no_cache_because_the_cpu_client_cannot_load_one(tmp_path):
    cpu = plan(Topology.uniform([2]), TorchXLAConfig(device="cpu"),
               Rendezvous(master_addr="127.0.0.1", master_port=1234, run_id="r"), "cpu")
    assert not any(k in p.env for p in cpu for k in CACHE_VARS)
    code = (
        "import json, torch, torch_xla, torch_xla.debug.metrics as met\n"
        "x = torch.ones(64, 64, device=torch_xla.device())\n"
        "(x @ x + 1).sum().item()\n"
        "print(json.dumps({n: met.counter_value(n) for n in met.counter_names()"
        " if n.startswith('Persistent')} | {'compiles': met.metric_data('CompileTime')[0]}))\n")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_PERSISTENT_CACHE_PATH": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold.get("PersistentCacheMiss", 0) >= 1 and os.listdir(tmp_path)  # it was written
    # ... and found, but not loadable: the second process compiles the same graph again
    assert warm.get("PersistentCacheDeserializeFailure", 0) >= 1, warm
    assert warm["compiles"] == cold["compiles"] >= 1
