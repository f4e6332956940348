"""One runtime per worker (``toolkit/runtime.py``): no other module-level state, the options
blocks (a conflicting second setting raises, naming both values), a fresh runtime per training
function, and the traps it closes (``metrics(warmup_steps=...)`` after the first call, two
callers of ``metrics()``, ``check_graphs_every`` before the check starts and with one worker).
No Ray: the training function's context is entered as Ray Train enters it."""

from __future__ import annotations

import ast
import logging
import os

import pytest

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "ray_train_xla")
MUTATORS = {"append", "appendleft", "extend", "add", "update", "clear", "pop", "popitem",
            "setdefault", "remove", "discard", "insert", "popleft"}
# The module-level state there is, each with why it is there.
ALLOWED = {
    "toolkit/runtime.py": {"_current": "this worker's runtime", "_lock": "a lock",
                           "_world": "this process's world: its ranks, generation and store"},
    "__init__.py": {"<globals()>": "the lazy export cache (a name, once imported)"},
    "planning/contract.py": {"_cached": "the plan as the environment says it (a cache of the "
                                        "environment, keyed by it: it never says otherwise)"},
    # The worker's set-up, from the backend's on_start to its on_shutdown (outside the training
    # function, whose runtime is the toolkit's): what shutdown undoes.
    "startup/devmode.py": {"_state": "the development mode's patches of torch_xla"},
    "startup/ray_helpers.py": {"_watchers": "Ray's helpers patched once their modules import"},
    "startup/netinfo.py": {"_held": "a port held for a store that starts later"},
    "startup/xrt.py": {"_watcher_stop": "the XRT servers' watcher"},
}


def module_state(src: str = SRC) -> dict[str, set[str]]:
    """Each module (path under ``src``) -> its module-level names that are rebound in a function
    (``global``) or changed in place (an item or attribute set, a mutating method called), and
    ``<globals()>`` where it writes its own globals by name."""
    found: dict[str, set[str]] = {}
    for folder, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            top = set()
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AnnAssign) else []
                top.update(t.id for t in targets if isinstance(t, ast.Name))
            state = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Global):
                    state.update(n for n in node.names if n in top)
                elif isinstance(node, (ast.Subscript, ast.Attribute)) and \
                        isinstance(node.ctx, (ast.Store, ast.Del)) and \
                        isinstance(node.value, ast.Name) and node.value.id in top:
                    state.add(node.value.id)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name) and \
                        node.func.value.id in top:
                    state.add(node.func.value.id)
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                        isinstance(node.value, ast.Call) and \
                        getattr(node.value.func, "id", "") == "globals":
                    state.add("<globals()>")
            if state:
                found[os.path.relpath(path, src)] = state
    return found


def test_no_module_holds_state_but_the_runtime_handle_locks_and_caches():
    found = module_state()
    extra = {path: sorted(names - set(ALLOWED.get(path, {}))) for path, names in found.items()}
    extra = {path: names for path, names in extra.items() if names}
    assert not extra, f"module-level state outside the runtime: {extra}"


def test_the_scan_finds_rebound_and_changed_names(tmp_path):
    (tmp_path / "m.py").write_text(
        "A = {}\nB = []\nC = 0\nD = (1, 2)\nE = None\n"
        "def f():\n    global C\n    C += 1\n    A['x'] = 1\n    B.append(2)\n    return D\n"
        "def g():\n    globals()['h'] = 1\n    E2 = E\n    return E2\n")
    assert module_state(str(tmp_path)) == {"m.py": {"A", "B", "C", "<globals()>"}}


def test_a_conflicting_second_setting_raises_naming_both_values():
    from ray_train_xla.toolkit import runtime as rt_mod
    from ray_train_xla.toolkit.observability.timeline import configure_timeline
    from ray_train_xla.toolkit.reporting import configure_reports, report_options

    rt_mod.begin()
    try:
        configure_reports(max_in_flight=4)
        configure_reports(max_in_flight=4, writer_process=False)  # the same, and another field
        with pytest.raises(ValueError, match=r"configure_reports: max_in_flight=3 conflicts with "
                                             r"max_in_flight=4, which was set before"):
            configure_reports(max_in_flight=3)
        assert report_options() == rt_mod.ReportOptions(max_in_flight=4, writer_process=False)
        configure_timeline(tokens_per_step=512)
        with pytest.raises(ValueError, match="tokens_per_step=1024.0 conflicts with "
                                             "tokens_per_step=512.0"):
            configure_timeline(tokens_per_step=1024)
        # A value a component took when it started: set later, it is refused, not ignored.
        rt = rt_mod.runtime()
        assert rt.options(rt_mod.MetricsOptions, capture=True).warmup_steps == 3
        with pytest.raises(ValueError, match="in effect already"):
            rt.configure(rt_mod.MetricsOptions, warmup_steps=5)
    finally:
        rt_mod.end()
    # The next training function starts afresh.
    rt_mod.begin()
    try:
        configure_reports(max_in_flight=3)
        assert report_options().max_in_flight == 3
    finally:
        rt_mod.end()


def test_each_training_function_has_its_own_runtime_and_leaves_no_hook():
    """As Ray Train enters ``train_func_context``: a runtime for the function, closed at its
    end (torch's global optimizer hooks it added are gone), whether it returns or raises."""
    import torch

    from ray_train_xla.startup.train_function import training_function
    from ray_train_xla.toolkit import runtime as rt_mod
    from ray_train_xla.toolkit import steps
    from ray_train_xla.toolkit.checkpoint.staging import snapshots

    seen = []
    for fail in (False, True):
        try:
            with training_function():
                rt = rt_mod.runtime()
                seen.append(rt)
                snapshots()._install()  # what an overlapped snapshot installs
                p = torch.nn.Parameter(torch.ones(2))
                opt = torch.optim.SGD([p], lr=0.1)
                p.grad = torch.ones(2)
                opt.step()
                assert steps.steps_done() == 1 and rt.steps.handle is not None
                if fail:
                    raise RuntimeError("injected (test)")
        except RuntimeError:
            assert fail
        assert rt.steps.handle is None and rt.snapshots._hook is None
        assert rt_mod.runtime() is not rt
    assert seen[0] is not seen[1]


def test_metrics_callers_each_have_their_window_and_warmup_is_checked(monkeypatch):
    """Two places that call ``metrics()`` each get the steps since their own previous call; a
    ``warmup_steps`` that differs from the one in effect raises instead of being ignored."""
    from conftest import HAS_TORCH_XLA

    if not HAS_TORCH_XLA:  # torch 2.13 (`make test-native`): a native worker's counters
        from ray_train_xla.planning import contract

        monkeypatch.setattr(contract, "_cached", None)  # the plan read again, then as it was
        monkeypatch.setenv("RAY_TRAIN_XLA_RUNTIME", "native")
    from ray_train_xla.toolkit import runtime as rt_mod
    from ray_train_xla.toolkit import steps
    from ray_train_xla.toolkit.observability import timeline
    from ray_train_xla.toolkit.observability.metrics import metrics

    def every_step():
        return metrics().get("timeline/steps")

    def every_third():
        return metrics().get("timeline/steps")

    rt_mod.begin()
    timeline.begin()
    try:
        seen = []
        for i in range(1, 7):
            steps.step_done()
            seen.append(every_step())
            if i % 3 == 0:
                seen.append(("third", every_third()))
        assert seen == [1, 1, 1, ("third", 3), 1, 1, 1, ("third", 3)]
        metrics(warmup_steps=3)  # the value in effect: fine
        with pytest.raises(ValueError, match="metrics: warmup_steps=5 conflicts"):
            metrics(warmup_steps=5)
    finally:
        timeline.end()
        rt_mod.end()


def test_check_graphs_every_before_the_check_and_with_one_worker(caplog):
    """The interval set before the check starts is the check's; with one worker there is
    nothing to compare, and it says so once."""
    from ray_train_xla.toolkit import runtime as rt_mod
    from ray_train_xla.toolkit.observability import compile_causes

    class Store:
        def set(self, key, value):
            pass

    rt_mod.begin()
    try:
        with caplog.at_level(logging.WARNING):
            compile_causes.check_graphs_every(7)
            compile_causes.check_graphs_every(7)
        said = [r for r in caplog.records if "no other rank's graphs" in r.getMessage()]
        assert len(said) == 1  # this process is one worker
        assert compile_causes.check_interval() == 7
        rt = rt_mod.runtime()
        check = compile_causes.GraphCheck(Store(), 0, 2, "t",
                                          rt.options(rt_mod.GraphCheckOptions).every)
        assert check.every == 7
    finally:
        rt_mod.end()
