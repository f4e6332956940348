"""The driver side: the config classes users pass to ``TorchTrainer`` and Ray's ``Backend``
classes that gather, plan and apply. What runs on the workers is in ``startup/``."""
