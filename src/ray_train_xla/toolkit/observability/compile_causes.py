"""Why graphs compiled, and whether the ranks compile the same ones (``docs/debugging.md``).

- **Causes, torch_xla.** With ``PT_XLA_DEBUG_LEVEL`` 1 (2 would also analyse every execution,
  about 1 KB of text a step) torch_xla analyses every compilation: its cause, the graph's hash,
  its numbers of inputs and outputs, the Python frames that triggered it. It reads the level
  once, at the first compilation: ``TorchXLAConfig(compile_causes=True)`` plans it for every
  worker with ``PT_XLA_DEBUG_FILE`` a file of its own, which :class:`DebugLog` reads when asked
  (the end of warm-up, a recompilation warning, a graph check); :func:`analyse_this_process`
  has torch_xla write it on every worker, not only where ``PJRT_LOCAL_PROCESS_RANK`` is 0.
- **Causes, native stacks**: Dynamo's guard failures (:func:`dynamo_reasons`), with nothing to
  switch on; eager code compiles nothing.
- **Ranks compiling different graphs** run different programs: with collectives in them, the
  usual cause of a hang. :class:`GraphCheck` compares them every ``every`` steps (100 by
  default) through the process group's store, without a collective.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from dataclasses import dataclass, field

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit import steps as _steps
from ray_train_xla.toolkit.observability.counters import Counters
from ray_train_xla.toolkit.runtime import GraphCheckOptions, runtime

logger = logging.getLogger(__name__)

_PREFIX = "Compilation Analysis: "
_RULE = "=" * 20
_END = "-" * 20
# Frames inside these packages are how a graph was cut, not where the user's code cut it.
_OWN_FRAMES = ("/torch_xla/", "/ray_train_xla/", "/torch/", "/ray/")


@dataclass
class Compilation:
    """One compilation as torch_xla's analysis describes it."""

    cause: str = ""
    graph_hash: str = ""
    inputs: int | None = None
    outputs: int | None = None
    frames: list[str] = field(default_factory=list)

    @property
    def user_frame(self) -> str:
        """The first frame outside torch, torch_xla, Ray and this package (the user's line that
        cut the graph), else the first frame."""
        outside = [f for f in self.frames if not any(part in f for part in _OWN_FRAMES)]
        return (outside or self.frames or [""])[0]

    def describe(self) -> str:
        where = f" at {self.user_frame}" if self.user_frame else ""
        shape = f", {self.inputs} inputs, {self.outputs} outputs" if self.inputs is not None else ""
        return f"{self.cause or 'unknown cause'} (graph {self.graph_hash[:12] or '?'}{shape}){where}"


def parse_analysis(text: str) -> tuple[list[Compilation], int]:
    """The compilations in ``text`` (torch_xla's debug output) and how many characters of it
    were consumed (a block still being written is left for the next read)."""
    found: list[Compilation] = []
    consumed = pos = 0
    current: Compilation | None = None
    section = ""
    for line in text.split("\n")[:-1]:  # whole lines only (the last piece has no newline)
        pos += len(line) + 1
        body = line[len(_PREFIX):] if line.startswith(_PREFIX) else None
        if current is None:
            if body is not None and body.startswith(_RULE):
                current, section = Compilation(), ""
            else:
                consumed = pos
            continue
        if body is None:
            continue
        if body.startswith(_END):
            found.append(current)
            current, consumed = None, pos
            continue
        if not body.startswith("  "):
            section = body.strip().rstrip(":").strip()
            continue
        value = body.strip()
        if section == "Compilation Cause":
            current.cause = f"{current.cause}; {value}" if current.cause else value
        elif section == "Graph Info":
            key, _, val = value.partition(":")
            val = val.strip()
            if key == "Graph Hash":
                current.graph_hash = val
            elif key == "Number of Graph Inputs" and val.isdigit():
                current.inputs = int(val)
            elif key == "Number of Graph Outputs" and val.isdigit():
                current.outputs = int(val)
        elif section.startswith("Python Frame"):
            current.frames.append(value)
    return found, consumed


class DebugLog:
    """torch_xla's compilation analysis of this process, read from ``PT_XLA_DEBUG_FILE`` as it
    grows (None of it when the analysis is off or goes to stderr)."""

    def __init__(self, path: str | None = None) -> None:
        level = os.environ.get("PT_XLA_DEBUG_LEVEL", "").strip()
        on = int(level) >= 1 if level.isdigit() else os.environ.get("PT_XLA_DEBUG", "") == "1"
        if path is None and on:
            path = os.environ.get("PT_XLA_DEBUG_FILE") or None
        self.path = path
        self._offset = 0
        self.compilations: list[Compilation] = []

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def read(self) -> list[Compilation]:
        """The compilations written since the last read (also appended to ``compilations``)."""
        if self.path is None:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                raw = f.read()
        except FileNotFoundError:
            return []
        # whole lines only (ASCII newlines never occur inside a UTF-8 character)
        raw = raw[:raw.rfind(b"\n") + 1]
        text = raw.decode("utf-8", errors="replace")
        new, consumed = parse_analysis(text)
        self._offset += (len(raw) if consumed == len(text)
                         else len(text[:consumed].encode("utf-8")))
        self.compilations.extend(new)
        return new

    def hashes(self) -> list[str]:
        self.read()
        return sorted({c.graph_hash for c in self.compilations if c.graph_hash})


def debug_log() -> DebugLog:
    """This worker's :class:`DebugLog`, held by the runtime (one reader: each block read once)."""
    return runtime().part("debug_log", DebugLog)


def dynamo_reasons(limit: int = 5) -> list[str]:
    """Why ``torch.compile`` compiled a frame again: Dynamo's guard failures, newest last, as
    "function (file:line): reason" (at most ``limit``)."""
    import sys

    if "torch._dynamo.utils" not in sys.modules:  # torch.compile never ran here
        return []
    from torch._dynamo.utils import guard_failures

    return [f"{getattr(code, 'co_name', str(code))} ({getattr(code, 'co_filename', '?')}:"
            f"{getattr(code, 'co_firstlineno', '?')}): {reason}"
            for code, reasons in list(guard_failures.items()) for reason in reasons][-limit:]


def causes_text(since: int = 0, limit: int = 3) -> str:
    """What this worker's stack says about its compilations after the first ``since`` of them
    (torch_xla: ``compilations[since:]``), as one sentence for a warning."""
    if worker_context().native:
        reasons = dynamo_reasons(limit)
        if reasons:
            return "torch.compile recompiled because its guards failed: " + "; ".join(reasons)
        return ("the native stack exposes no cause for eager execution (torch.compile's guard "
                "failures are reported when it recompiles)")
    log = debug_log()
    if not log.enabled:
        return ("cause not recorded: TorchXLAConfig(compile_causes=True) has torch_xla analyse "
                "every compilation (PT_XLA_DEBUG_LEVEL=1) and names it here")
    log.read()
    if not log.compilations:
        return (f"not recorded: torch_xla wrote no analysis in this process ({log.path}; it "
                f"analyses only where {LOCAL_RANK_VAR} is 0)")
    new = log.compilations[since:]
    if not new:
        return "torch_xla's analysis has not recorded it yet"
    shown = "; ".join(c.describe() for c in new[-limit:])
    more = f" (and {len(new) - limit} more)" if len(new) > limit else ""
    same_code = _same_code_other_graph(log.compilations[:since], new)
    return f"torch_xla: {shown}{more}{same_code}"


def _same_code_other_graph(before: list[Compilation], new: list[Compilation]) -> str:
    """A hint when a new graph was cut at a line that had cut another graph before: the same
    code traced a different graph (an input shape or a constant changed)."""
    seen = {c.user_frame: c for c in before if c.user_frame}
    for c in new:
        old = seen.get(c.user_frame)
        if old is not None and old.graph_hash != c.graph_hash:
            return (f"; the same line cut graph {old.graph_hash[:12]} before: an input shape or "
                    "a Python constant in the step changed")
    return ""


class DivergentGraphsWarning(UserWarning):
    """The ranks compiled different graphs (different programs: collectives in them hang)."""


# ---- comparing the ranks ------------------------------------------------------------------------

DEFAULT_CHECK_EVERY = 100
SHOWN_RANKS = 16


def summary() -> str:
    """This rank's graphs as ``"<count>:<digest of their hashes>"``: the graphs this process
    compiled so far (``counters.py``), the digest empty without the causes."""
    digest = ""
    if not worker_context().native and debug_log().enabled:
        hashes = debug_log().hashes()
        digest = hashlib.sha1(",".join(hashes).encode()).hexdigest()[:12] if hashes else ""
    return f"{int(Counters().compiles())}:{digest}"


def compare(values: dict[int, str]) -> str | None:
    """None when every rank has the same graphs, else a sentence naming the ranks of each group
    (the largest group first)."""
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    if len(groups) <= 1:
        return None
    parts = []
    for value, ranks in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
        count, _, digest = value.partition(":")
        shown = ", ".join(str(r) for r in ranks[:SHOWN_RANKS])
        if len(ranks) > SHOWN_RANKS:
            shown += f" and {len(ranks) - SHOWN_RANKS} more"
        what = f"{count} graphs" + (f" (hashes {digest})" if digest else "")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {shown}: {what}")
    return "; ".join(parts)


class GraphCheck:
    """Every ``every`` steps, each rank writes its :func:`summary` to the store with the previous
    check's (so rank 0 finds it whatever the order of the writes); rank 0 compares the ranks'
    values of the previous check and warns (logs and :class:`DivergentGraphsWarning`, on its
    training thread) once per different outcome."""

    def __init__(self, store, rank: int, world: int, prefix: str,
                 every: int = DEFAULT_CHECK_EVERY) -> None:
        self._store, self._prefix = store, prefix
        self.rank, self.world = rank, world
        self.set_every(every)
        self._last: tuple[int, str] | None = None  # (step, summary) of this rank's last check
        self._last_verdict: str | None = None
        self.verdicts: list[tuple[int, str]] = []  # (step compared, sentence): rank 0 only

    def on_step(self, n: int) -> None:
        if n >= self._next:
            self._check(n)

    def set_every(self, every: int) -> None:
        self.every = every
        self._next = _steps.steps_done() // every * every + every

    def _check(self, n: int) -> None:
        self._next = n // self.every * self.every + self.every
        now, previous = summary(), self._last
        self._last = (n, now)
        value = f"{n}={now}" + (f";{previous[0]}={previous[1]}" if previous else "")
        try:
            self._store.set(f"{self._prefix}/{self.rank}", value)
            if self.rank == 0 and previous is not None:
                self._compare(previous[0])
        except Exception as exc:  # noqa: BLE001 (a diagnostic: never fail the step)
            logger.debug("graph check at step %d skipped: %s", n, exc)

    def _compare(self, step: int) -> None:
        keys = [f"{self._prefix}/{r}" for r in range(self.world)]
        if not self._store.check(keys):
            return  # a rank has not reached its first check yet
        values: dict[int, str] = {}
        for rank, raw in enumerate(self._store.multi_get(keys)):
            entries = dict(part.split("=", 1) for part in raw.decode().split(";") if "=" in part)
            if str(step) not in entries:
                return  # a rank is more than one check away: compare at the next one
            values[rank] = entries[str(step)]
        verdict, last = compare(values), self._last_verdict
        self._last_verdict = verdict
        if verdict is None or verdict == last:
            return
        self.verdicts.append((step, verdict))
        message = (f"ranks compile different graphs (compared at step {step}): {verdict}. "
                   "Ranks that run different graphs run different programs: with collectives "
                   "in them they wait for each other forever. Look at the ranks outside the "
                   "largest group: their recompilation warnings name the step and the cause.")
        logger.warning(message)
        warnings.warn(message, DivergentGraphsWarning, stacklevel=2)


LOCAL_RANK_VAR = "PJRT_LOCAL_PROCESS_RANK"


def analyse_this_process() -> None:
    """With torch_xla's analysis on (``compile_causes=True``), have it analyse this worker's
    compilations too (every rank, as the training function starts, so their graph counts stay
    equal). torch_xla 2.9 writes it only where ``PJRT_LOCAL_PROCESS_RANK`` is 0, and reads that
    variable (with the level and the file) once, at its first compilation: so this process
    makes its first compilation here, a graph of one small op, with the variable at 0 for that
    moment only, after the device is up (the runtime has read the real value). When torch_xla
    compiled already (too late): a warning."""
    ctx = worker_context()
    if ctx.native or not debug_log().enabled:
        return
    import torch
    import torch_xla

    if Counters().compiles():
        logger.warning("rank %d: torch_xla compiled before the training function started, so "
                       "it analyses compilations only where %s is 0 (local rank 0): this "
                       "worker's recompilation warnings will not name their cause",
                       ctx.rank, LOCAL_RANK_VAR)
        return
    # A copy to the device (data, no graph): the runtime up, with the planned variables.
    one = torch.zeros(1).to(torch_xla.device())
    old = os.environ.get(LOCAL_RANK_VAR)
    os.environ[LOCAL_RANK_VAR] = "0"
    try:
        one = one + 1  # noqa: F841 (the first compilation: torch_xla reads its debug settings)
        torch_xla.sync()
    finally:
        if old is None:
            os.environ.pop(LOCAL_RANK_VAR, None)
        else:
            os.environ[LOCAL_RANK_VAR] = old


def install(store=None) -> GraphCheck | None:
    """Start the graph check on this worker (as the training function starts, every rank; held
    by the runtime), on the process group's store unless given one; None with one worker."""
    uninstall()
    rt = runtime()
    ctx = rt.ctx
    if store is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
    if store is None or ctx.world_size < 2:
        return None
    rt.graph_check = GraphCheck(store, ctx.rank, ctx.world_size,
                                f"ray_train_xla/graphs/{ctx.run_id or os.getpid()}",
                                rt.options(GraphCheckOptions).every)
    _steps.add_step_hook(rt.graph_check.on_step)
    return rt.graph_check


def uninstall() -> None:
    rt = runtime()
    check, rt.graph_check = rt.graph_check, None
    if check is not None:
        _steps.remove_step_hook(check.on_step)


def check_graphs_every(steps: int) -> None:
    """Compare the ranks' compiled graphs every ``steps`` steps (default 100). Call it with the
    same value on every rank; a value that differs from one set before raises ``ValueError``.
    With one worker there is nothing to compare: it says so, once."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"check_graphs_every(steps={steps!r}): expected an int >= 1")
    rt = runtime()
    rt.configure(GraphCheckOptions, every=steps)
    if rt.graph_check is not None:
        rt.graph_check.set_every(steps)
    elif rt.ctx.world_size < 2 and not rt.warned_one_worker_check:
        rt.warned_one_worker_check = True
        logger.warning("check_graphs_every(%d): one worker, no other rank's graphs to compare "
                       "with: nothing is checked", steps)


def check_interval() -> int:
    """Steps between two graph checks on this worker."""
    return runtime().options(GraphCheckOptions).every
