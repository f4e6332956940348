"""The ``ray-train-xla`` command and what it runs: ``plan`` (the planner's output, no Ray),
``doctor`` (checks a cluster), ``demo`` (a real run on an embedded local Ray) and
``consolidate`` (one model file, or a Hugging Face ``save_pretrained`` directory, from a
checkpoint)."""
