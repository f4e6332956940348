"""What observes a run, apart from the training path (which tells it what happens through
``toolkit/events.py``): the step timeline, its Ray metrics, a run's goodput, the compile metrics
and causes, the profile windows (each module: ``docs/observability.md``, "Where it lives"). The
runtime (``toolkit/runtime.py``) holds their options and components;
``startup/train_function.py`` starts and ends them."""
