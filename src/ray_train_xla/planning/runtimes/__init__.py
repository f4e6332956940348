"""One module per device runtime: what it plans for each worker (pure, no Ray, no torch)."""
