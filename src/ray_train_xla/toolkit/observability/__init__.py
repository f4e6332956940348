"""What observes a run, apart from the training path (which tells it what happens through
``toolkit/events.py``): ``timeline`` (the step timeline and the goodput events it writes),
``ray_metrics`` (the timeline as Ray metrics), ``goodput`` (a whole run added up), ``metrics``
(compile and execution metrics, the recompilation warning), ``counters`` (the one reader of the
compile counters), ``compile_causes`` (why graphs compiled, the ranks' graph check) and
``profiling`` (profile windows on every rank). The runtime (``toolkit/runtime.py``) holds their
options and components; ``startup/train_function.py`` starts and ends them."""
