"""The double of TorchTPU's launch module: only its chip-coordinate query,
``python -m torch_tpu._internal.distributed.distributed --print_local_device_coords``, which
prints ``TORCH_TPU_LOCAL_DEVICE_COORDS=<json list>``. The coordinates come from
``$RTX_TEST_TPU_COORDS`` (JSON: raylet pid -> coordinates, so each node of a test cluster
answers its own); every query is recorded in ``$RTX_TEST_RECORD_DIR/coords-queries``; with
``$RTX_TEST_TPU_COORDS_HANG`` it never answers."""

import json
import os
import sys
import time

if __name__ == "__main__" and sys.argv[1:] == ["--print_local_device_coords"]:
    table = json.loads(os.environ.get("RTX_TEST_TPU_COORDS", "{}"))
    coords = table.get(os.environ.get("RAY_RAYLET_PID", ""))
    record = os.environ.get("RTX_TEST_RECORD_DIR")
    if record:
        folder = os.path.join(record, "coords-queries")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{os.getpid()}-{time.time_ns()}"), "w") as f:
            f.write(os.environ.get("RAY_RAYLET_PID", ""))
    if os.environ.get("RTX_TEST_TPU_COORDS_HANG"):
        time.sleep(600)  # a PJRT client that never answers
    if coords is None:
        sys.exit("no TPU devices")
    print("TORCH_TPU_LOCAL_DEVICE_COORDS=" + json.dumps(coords))
