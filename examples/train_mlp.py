"""A small MLP on synthetic regression data with Ray Train, under any config: resumable, on the
CPU, Trainium or TPU, on an embedded local Ray or a cluster (``--address``).

The code ships with the package (``ray_train_xla/tools/examples/train_mlp.py``, also run by
``ray-train-xla demo --train``); this script runs it. ``--help`` lists the flags.

    python examples/train_mlp.py --workers 2 --steps 2000
    python examples/train_mlp.py --resume --name train_mlp-... --steps 1000
    python examples/train_mlp.py --config neuron --workers 2      # TorchNeuronConfig's CPU twin
    python examples/train_mlp.py --address auto --config neuron --device neuron --workers 32 \\
        --storage-path s3://bucket/runs
"""

from ray_train_xla.tools.examples.train_mlp import (  # noqa: F401 (the example's parts)
    build_trainer,
    default_config,
    main,
    train_loop,
)

if __name__ == "__main__":
    main()
