"""Test double: libneuronxla.neuron_parallel_compile.parallel_compile records its calls."""

import json
import os
import stat
import time


def parallel_compile(work_dir, cache_url, num_parallel=8, **kwargs):
    import ray

    record = {
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "rank": os.environ.get("RANK"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        "work_dir": work_dir,
        "work_dir_exists": os.path.isdir(work_dir),
        "work_dir_mode": oct(stat.S_IMODE(os.stat(work_dir).st_mode)),
        "cache_url": str(cache_url),
        "cache_url_type": type(cache_url).__name__,
    }
    out_dir = os.environ["RTX_TEST_RECORD_DIR"]
    with open(os.path.join(out_dir, f"compile-{os.getpid()}-{time.time_ns()}.json"), "w") as f:
        json.dump(record, f)
    # Hold the work dir a moment, so concurrent trainers on one node overlap.
    time.sleep(float(os.environ.get("RTX_TEST_COMPILE_SECONDS", "0")))
    if os.environ.get("RTX_TEST_COMPILE_FAIL"):
        raise RuntimeError("neuronx-cc: error: compilation of graph MODULE_42 failed (test)")
    return 0
