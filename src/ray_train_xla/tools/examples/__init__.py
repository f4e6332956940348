"""The example training programs, shipped with the package so that ``ray-train-xla demo
--train`` / ``--sharded`` run from a plain ``pip install``: ``train_mlp`` (a resumable MLP),
``train_lm`` (a sharded transformer LM with Ray Data batches), and ``cluster`` (how they and the
demo reach Ray and ask it for accelerators). ``examples/*.py`` in a source checkout run them."""
