"""A small decoder-only transformer language model, trained sharded with Ray Data batches,
resumable: FSDPv2 over virtual XLA CPU devices, Trainium or TPU (``--config xla``), or FSDP2 over
workers (``--config neuron`` / ``tpu``), on an embedded local Ray or a cluster (``--address``).

The code ships with the package (``ray_train_xla/tools/examples/train_lm.py``, also run by
``ray-train-xla demo --sharded``); this script runs it. ``--help`` lists the flags.

    python examples/train_lm.py --devices 4 --steps 40              # 4 virtual XLA CPU devices
    python examples/train_lm.py --devices 4 --steps 40 --crash-at 25  # crash once, resume
    python examples/train_lm.py --config tpu --workers 2 --steps 40   # FSDP2, TorchTPUConfig's twin
    python examples/train_lm.py --address auto --device tpu --workers 4 --devices 4 \\
        --tpu-topology 4x4 --accelerator-type TPU-V6E --storage-path gs://bucket/runs
"""

from ray_train_xla.tools.examples.train_lm import (  # noqa: F401 (the example's parts)
    build_trainer,
    lm_config,
    main,
    make_model,
    train_loop,
)

if __name__ == "__main__":
    main()
