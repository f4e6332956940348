"""The ``ray-train-xla`` command (``cli.py``, which lists its commands) and the modules that
run them."""
