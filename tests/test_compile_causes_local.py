"""Compilation causes without Ray: torch_xla's analysis parsed from its debug file (as torch_xla
2.9 writes it, read as it grows), Dynamo's guard failures, and the comparison of the ranks'
graphs through a store (two ranks in one process). The whole path on 2 Ray workers is in
``test_observe_ray.py``."""

from __future__ import annotations

import warnings

from ray_train_xla.toolkit import steps
from ray_train_xla.toolkit.observability import compile_causes
from ray_train_xla.toolkit.observability.compile_causes import DebugLog, GraphCheck, parse_analysis
from ray_train_xla.toolkit.runtime import runtime


def block(graph_hash: str, line: int, cause: str = "user torch_xla.sync") -> str:
    """One compilation as torch_xla 2.9 writes it with PT_XLA_DEBUG_LEVEL=1."""
    p = "Compilation Analysis: "
    return "\n".join([
        "", p + "=" * 80, p + "Compilation Cause", p + "  " + cause, p + "Graph Info: ",
        p + f"  Graph Hash: {graph_hash}", p + "  Number of Graph Inputs: 4",
        p + "  Number of Graph Outputs: 3", p + "Python Frame Triggered Execution: ",
        p + "  sync (/venv/site-packages/torch_xla/torch_xla.py:87)",
        p + "  optimizer_step (/venv/site-packages/ray_train_xla/toolkit/optim.py:200)",
        p + f"  train_func (/home/me/train.py:{line})", p + "-" * 80, p + "=" * 80, "",
        "Computation hash: d5c5ac070885ac8b05c754c9d4d9ee5f", "",
        "Post Compilation Analysis: " + "=" * 80,
        "Post Compilation Analysis: Graph input size: 0.000000 GB",
        "Post Compilation Analysis: " + "=" * 80, ""])


def test_parse_torch_xla_analysis_as_the_file_grows(tmp_path):
    [c], _ = parse_analysis(block("417c79a26849cecb5c90606b6c69a9b1", 42))
    assert c.cause == "user torch_xla.sync" and c.graph_hash.startswith("417c79a2")
    assert (c.inputs, c.outputs) == (4, 3)
    assert c.user_frame == "train_func (/home/me/train.py:42)"  # not torch_xla's, not ours
    path = tmp_path / "debug.txt"
    text = block("aaaa", 42) + block("bbbb", 42)
    cut = text.index("Graph Hash: bbbb")
    path.write_text(text[:cut])  # the second block is half written
    log = DebugLog(str(path))
    assert [c.graph_hash for c in log.read()] == ["aaaa"]
    with open(path, "a") as f:
        f.write(text[cut:])
    assert [c.graph_hash for c in log.read()] == ["bbbb"]
    assert log.read() == [] and log.hashes() == ["aaaa", "bbbb"]


def test_cause_text_names_the_line_that_cut_a_new_graph(tmp_path, monkeypatch):
    path = tmp_path / "debug.txt"
    path.write_text(block("aaaa1111", 42) + block("bbbb2222", 42))
    monkeypatch.setattr(runtime(), "debug_log", DebugLog(str(path)))
    text = compile_causes.causes_text(since=1)
    assert "user torch_xla.sync (graph bbbb2222, 4 inputs, 3 outputs) at train_func " in text
    assert "the same line cut graph aaaa1111 before: an input shape" in text
    monkeypatch.setattr(runtime(), "debug_log", DebugLog(None))
    assert "compile_causes=True" in compile_causes.causes_text(since=1)


def test_dynamo_names_the_guard_that_failed(monkeypatch):
    # What torch 2.9's Dynamo records when f(torch.ones(4)) then f(torch.ones(6)) recompile
    # (measured; a real torch.compile here would cost seconds of the suite).
    import collections

    from torch._dynamo import utils

    from ray_train_xla.planning import contract

    def f(x):
        return x * 2

    failures = collections.defaultdict(list)
    failures[f.__code__].append("0/0: tensor 'x' size mismatch at index 0. expected 4, actual 6")
    monkeypatch.setattr(utils, "guard_failures", failures)
    monkeypatch.setattr(compile_causes, "worker_context",
                        lambda: contract.WorkerContext(runtime=contract.NATIVE, device="cpu"))
    text = compile_causes.causes_text()
    assert text.startswith("torch.compile recompiled because its guards failed: f (")
    assert "test_compile_causes_local.py:" in text and "expected 4, actual 6" in text
    failures.clear()
    assert "exposes no cause for eager execution" in compile_causes.causes_text()


def test_compare_names_the_ranks_of_each_group():
    assert compile_causes.compare({0: "3:ab", 1: "3:ab"}) is None
    verdict = compile_causes.compare({0: "3:ab", 1: "4:cd", 2: "3:ab"})
    assert verdict == "ranks 0, 2: 3 graphs (hashes ab); rank 1: 4 graphs (hashes cd)"


def test_rank_zero_warns_when_the_ranks_graphs_differ(monkeypatch):
    import torch.distributed as dist

    steps.reset()
    store = dist.HashStore()
    counts = {0: 3, 1: 3}
    checks = [GraphCheck(store, r, 2, "g", every=10) for r in range(2)]
    rank_of_call = []
    monkeypatch.setattr(compile_causes, "summary", lambda: f"{counts[rank_of_call[-1]]}:")

    def step(n):  # both ranks end step n (rank 1 first: the order must not matter)
        for r in (1, 0):
            rank_of_call.append(r)
            checks[r].on_step(n)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 21):
            if n == 15:
                counts[1] = 4  # rank 1 compiles a graph of its own at step 15
            step(n)
        assert caught == []  # step 10 was compared at step 20: the same graphs
        for n in range(21, 31):
            step(n)
    [w] = caught
    assert issubclass(w.category, compile_causes.DivergentGraphsWarning)
    assert "compared at step 20): rank 0: 3 graphs; rank 1: 4 graphs" in str(w.message)
    assert checks[0].verdicts == [(20, "rank 0: 3 graphs; rank 1: 4 graphs")]
    steps.reset()
