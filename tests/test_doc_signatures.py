"""What README.md and docs/*.md write about the public API is what the code has.

- Every ``name(...)`` the docs write for a public name (``ray_train_xla.__all__``), in a code
  span or a python block, against the name's signature, read from the source without importing
  it (no torch, no Ray):
  - a *signature* (a code span without the ``rtx.`` prefix whose arguments are parameters, with
    a literal default or a bare ``*``), e.g. ``prepare_sharded_model(model, mesh=None, *, ...)``:
    the same parameters in the same order, of the same kind (``*``), with the same defaults;
    complete, unless it has ``...`` where parameters are left out;
  - a *call* (anything else: ``rtx.metrics(step, execute_time=True)``,
    ``TorchXLAConfig(spmd=True)``): every keyword names a parameter, and no more positional
    arguments than the function takes. A call the text calls an error ("is a `TypeError`",
    "raises", "is refused") must be one.
- Every list of a config's fields: a table whose first column is ``field``, under a heading that
  names the config, and a run of three or more backticked field names in prose or a table cell
  (the config: the nearest one named before it, in its paragraph first), holds exactly the
  config's fields, unless it ends with ``...``; a run none of whose names is a field of the
  config ("there is no `spmd`, ...") must name no field of it.
- Every ``VAR=value`` code span for a variable the planner sets on a device (its value the same
  for every worker) gives a value some plan gives it (``<...>`` stands for any text).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import io
import json
import os
import re
from typing import Any

import pytest

import ray_train_xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(os.path.abspath(ray_train_xla.__file__))
PUBLIC = set(ray_train_xla.__all__)
CONFIGS = ("TorchXLAConfig", "TorchNeuronConfig", "TorchTPUConfig")
OPTIONS = {"XLAOptions": "TorchXLAConfig", "NeuronOptions": "TorchNeuronConfig",
           "TPUOptions": "TorchTPUConfig"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # a code span, wrapped over two lines at most
PREFIX = re.compile(r"^(?:(rtx|ray_train_xla)\.)?([A-Za-z_]\w*)\((.*)\)$", re.S)
# After a call: the text says it fails.
FAILS = re.compile(r"^\s*(?:is an? `?\w*Error|raises|is refused|are refused)")


def doc_files() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def without_fences(text: str) -> str:
    """The text with every fenced block blanked (its lines kept, for line numbers)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


# ---- the code's signatures, from the source ------------------------------------------------------


def _module_of(name: str) -> str:
    """The module that defines public ``name``: the package's exports, then the toolkit's."""
    if name in ray_train_xla._EXPORTS:
        return ray_train_xla._EXPORTS[name]
    import ray_train_xla.toolkit as toolkit  # lazy: loads no torch

    return f"ray_train_xla.toolkit.{toolkit._EXPORTS[name]}"


@functools.cache
def _tree(module: str) -> ast.Module:
    path = os.path.join(PACKAGE, *module.split(".")[1:])
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def _definition(name: str, module: str) -> tuple[ast.AST | None, str]:
    """The top-level definition of ``name`` in ``module`` (following imports), and the module
    that holds it."""
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node, module
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return _definition(name, node.module)
    return None, module


def _constant(name: str, module: str) -> Any:
    """The value of a module-level constant (``NAME = <literal>``, following imports)."""
    for node in _tree(module).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(t, ast.Name) and t.id == name
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            return _default(node.value, module)
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            return _constant(name, node.module)
    raise LookupError(f"{name} in {module}")


# Decorators that keep the function's signature.
KEEP_SIGNATURE = {"torch.no_grad()", "contextlib.contextmanager", "contextmanager"}


def _default(node: ast.expr, module: str = "") -> Any:
    """A default's value: a literal (or arithmetic on literals), a module constant, else its
    source text."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        if all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
               for n in ast.walk(node)):
            return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})  # noqa: S307
        if module and isinstance(node, ast.Name):
            with contextlib.suppress(LookupError):
                return _constant(node.id, module)
        return ast.unparse(node)


def _signature_of_def(node: ast.FunctionDef, module: str, drop_self: bool = False) -> inspect.Signature:
    bad = [ast.unparse(d) for d in node.decorator_list if ast.unparse(d) not in KEEP_SIGNATURE]
    assert not bad, f"{node.name}: decorators {bad} may change the signature the docs are read against"
    a = node.args
    P = inspect.Parameter
    params = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [P.empty] * (len(positional) - len(a.defaults)) + [_default(d, module) for d in a.defaults]
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=default))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        value = P.empty if default is None else _default(default, module)
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=value))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params[1:] if drop_self else params)


def _options_class(name: str):
    """The options class (planning/options.py: no Ray, no torch) holding a config's fields."""
    from ray_train_xla.planning import options

    return getattr(options, {v: k for k, v in OPTIONS.items()}.get(name, name))


def config_fields(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_options_class(name))]


def signature(name: str) -> inspect.Signature | None:
    """The signature of public ``name`` (a config: its options' fields, keyword-only), or None
    for a class that takes what its base takes (the error types)."""
    if name in CONFIGS or name in OPTIONS:
        return inspect.signature(_options_class(name))
    node, module = _definition(name, _module_of(name))
    assert node is not None, f"{name}: no definition found in {_module_of(name)}"
    if isinstance(node, ast.FunctionDef):
        return _signature_of_def(node, module)
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    return _signature_of_def(init, module, drop_self=True) if init is not None else None


# ---- what the docs write -------------------------------------------------------------------------


@dataclasses.dataclass
class Written:
    """One ``name(args)`` in the docs."""

    where: str  # file:line
    name: str
    args: str  # the text between the parentheses
    prefixed: bool  # rtx.NAME or ray_train_xla.NAME
    after: str = ""  # the text that follows it


def spans() -> list[Written]:
    out = []
    for doc in doc_files():
        text = without_fences(read(doc))
        for m in SPAN.finditer(text):
            found = PREFIX.match(m.group(1).strip().replace("\\|", "|"))
            if found and found.group(2) in PUBLIC:
                out.append(Written(f"{doc}:{line_of(text, m.start())}", found.group(2),
                                   found.group(3), bool(found.group(1)), text[m.end():m.end() + 80]))
    return out


def block_calls() -> list[tuple[str, str, list[ast.expr], list[ast.keyword]]]:
    """(file:line, name, positional args, keywords) of every call of a public name in the python
    blocks: ``rtx.NAME(...)``, ``ray_train_xla.NAME(...)``, ``NAME(...)`` imported from it."""
    out = []
    for doc in doc_files():
        text = read(doc)
        for m in FENCE.finditer(text):
            if m.group(1) != "python":
                continue
            start = line_of(text, m.start())
            tree = ast.parse(m.group(2))
            modules = {"ray_train_xla"}
            names: dict[str, str] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name == "ray_train_xla":
                            modules.add(a.asname or a.name)
                elif isinstance(node, ast.ImportFrom) and node.module == "ray_train_xla":
                    for a in node.names:
                        names[a.asname or a.name] = a.name
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules:
                    name = f.attr
                elif isinstance(f, ast.Name) and f.id in names:
                    name = names[f.id]
                else:
                    continue
                if name in PUBLIC:
                    out.append((f"{doc}:{start + node.lineno}", name, node.args, node.keywords))
    return out


def split_args(args: str) -> list[str]:
    """The top-level, comma-separated items of an argument list."""
    items, depth, quote, cur = [], 0, "", ""
    for ch in args:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        items.append(cur.strip())
    return [" ".join(i.split()) for i in items]


PARAM = re.compile(r"^(\*{0,2})([A-Za-z_]\w*)(?:=(.+))?$")


def _literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
        return True
    except (ValueError, SyntaxError):
        return False


def as_declaration(w: Written) -> list[str] | None:
    """The items of ``w`` when it is written as a signature, else None (a call): no ``rtx.``
    prefix, parameters only (``name``, ``name=<literal>``, ``*``, ``/``, ``...``, ``**name``),
    and a bare ``*`` or ``/``, or a parameter written with its own default (``src=0``): a call
    passes other values (``mixed_precision="bf16"``). ``name=...`` is a call that leaves the
    value out; a config is always called."""
    if w.prefixed or w.name in CONFIGS:
        return None
    items = split_args(w.args)
    if not all(i in ("*", "/", "...") or PARAM.match(i) for i in items):
        return None
    if "*" in items or "/" in items:
        return items
    params = [PARAM.match(i) for i in items if i != "..."]
    if any(p.group(3) == "..." for p in params):
        return None
    sig = signature(w.name)
    real = sig.parameters if sig is not None else {}
    own = [p for p in params if p.group(3) is not None and p.group(2) in real
           and real[p.group(2)].default is not inspect.Parameter.empty
           and all(_literal(a) for a in p.group(3).split("|"))
           and _same_default(p.group(3), real[p.group(2)].default)]
    return items if own else None


def _same_default(written: str, real: Any) -> bool:
    """``written`` (doc text, alternatives ``a|b`` allowed) gives the real default."""
    for alt in written.split("|"):
        value = _default(ast.parse(alt, mode="eval").body)
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, real))
        if value == real and (numbers or type(value) is type(real)):
            return True
    return False


def check_declaration(items: list[str], sig: inspect.Signature) -> list[str]:
    P = inspect.Parameter
    real = sig.parameters
    problems = []
    partial = "..." in items
    kind = P.POSITIONAL_OR_KEYWORD
    order = list(real)
    last = -1
    for item in items:
        if item == "...":
            continue
        if item == "*":
            kind = P.KEYWORD_ONLY
            continue
        if item == "/":
            continue
        stars, name, default = PARAM.match(item).groups()
        if name not in real:
            problems.append(f"{name!r} is no parameter (the parameters: {', '.join(order)})")
            continue
        p = real[name]
        want = {"*": P.VAR_POSITIONAL, "**": P.VAR_KEYWORD}.get(stars, kind)
        if p.kind != want and not (want == P.POSITIONAL_OR_KEYWORD and p.kind == P.POSITIONAL_ONLY):
            problems.append(f"{name!r} is {p.kind.description}, written as {want.description}")
        if order.index(name) < last:
            problems.append(f"{name!r} is out of order (the parameters: {', '.join(order)})")
        last = max(last, order.index(name))
        if default is None and p.default is not P.empty:
            problems.append(f"{name!r} is written without its default, {p.default!r}")
        elif default is not None and p.default is P.empty:
            problems.append(f"{name!r} is written with a default ({default}) it does not have")
        elif default is not None and not _same_default(default, p.default):
            problems.append(f"{name!r} defaults to {p.default!r}, written {default}")
    written = {PARAM.match(i).group(2) for i in items if PARAM.match(i)}
    missing = [n for n in order if n not in written]
    if missing and not partial:
        problems.append(f"leaves out {', '.join(missing)} (write them, or '...' where they go)")
    return problems


def check_call(name: str, positional: int, keywords: list[str], partial: bool,
               sig: inspect.Signature) -> str | None:
    """Why the call cannot bind, or None."""
    try:
        sig.bind_partial(*([None] * (0 if partial else positional)), **dict.fromkeys(keywords))
    except TypeError as e:
        return str(e)
    return None


def written_call(w: Written) -> tuple[int, list[str], bool]:
    """(positional arguments, keywords, partial) of a call written in a span."""
    items = split_args(w.args)
    keywords = [m.group(1) for i in items if (m := re.match(r"^([A-Za-z_]\w*)=(?!=)", i))]
    positional = [i for i in items if not re.match(r"^([A-Za-z_]\w*)=(?!=)", i)]
    partial = "..." in positional or any(i.startswith("*") for i in positional)
    return len(positional), keywords, partial


SIGNATURE_SPANS = spans()
BLOCK_CALLS = block_calls()


def test_the_docs_write_signatures_and_calls():
    declarations = [w for w in SIGNATURE_SPANS if as_declaration(w)]
    assert len(declarations) >= 20 and len(SIGNATURE_SPANS) >= 150 and len(BLOCK_CALLS) >= 50
    assert {"prepare_sharded_model", "configure_timeline", "load_pretrained",
            "export_pretrained", "save_checkpoint", "load_checkpoint"} <= {w.name for w in declarations}


def test_every_signature_in_the_docs_is_the_code_s():
    problems = []
    for w in SIGNATURE_SPANS:
        items = as_declaration(w)
        if items is None:
            continue
        sig = signature(w.name)
        if sig is None:
            continue
        for p in check_declaration(items, sig):
            problems.append(f"{w.where}: {w.name}({w.args}): {p}; the code: {w.name}{sig}")
    assert not problems, "\n".join(problems)


def build_config(name: str, args: list[ast.expr], keywords: list[ast.keyword]) -> str | None:
    """Build config ``name`` (its options class: no Ray) from literal arguments: why it fails,
    or None; ``"not literal"`` when an argument is not a literal."""
    try:
        values = [ast.literal_eval(a) for a in args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in keywords}
    except ValueError:
        return "not literal"
    try:
        _options_class(name)(*values, **kwargs)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _call_problem(where: str, name: str, args: list[ast.expr], keywords: list[ast.keyword],
                  partial: bool, fails: bool, text: str) -> str | None:
    """Why a written call is wrong: a config with literal arguments is built, and must build
    (or fail, where the text says it does); anything else must bind."""
    sig = signature(name)
    if name in CONFIGS and not partial:
        why = build_config(name, args, keywords)
        if why != "not literal":
            if fails and why is None:
                return f"{where}: {text} is said to fail, but builds"
            if not fails and why is not None:
                return f"{where}: {text}: {why}"
            return None
    if sig is None:
        return None
    why = check_call(name, len(args), [k.arg for k in keywords], partial, sig)
    if fails and why is None and name not in CONFIGS:
        return f"{where}: {text} is said to fail, but binds"
    if not fails and why is not None:
        return f"{where}: {text}: {why}; the code: {name}{sig}"
    return None


def test_every_call_in_the_docs_binds_and_every_config_builds():
    problems = []
    for w in SIGNATURE_SPANS:
        if as_declaration(w) is not None:
            continue
        positional, keywords, partial = written_call(w)
        try:
            call = ast.parse(f"f({w.args})", mode="eval").body
            args, kws = call.args, call.keywords
        except SyntaxError:  # "..." where arguments are left out, "a|b": names only
            args = [ast.Name("_")] * positional
            kws = [ast.keyword(k, ast.Name("_")) for k in keywords]
        problems.append(_call_problem(w.where, w.name, args, kws, partial,
                                      bool(FAILS.match(w.after)), f"{w.name}({w.args})"))
    for where, name, args, keywords in BLOCK_CALLS:
        if any(k.arg is None for k in keywords):
            continue
        partial = any(isinstance(a, ast.Starred) for a in args)
        problems.append(_call_problem(where, name, args, keywords, partial, False, f"{name}(...)"))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


# ---- config fields ---------------------------------------------------------------------------------

ITEM = r"`([a-z_][a-z0-9_]*)`"
SEP = r"(?:\s*,\s*(?:and\s+|or\s+)?|\s+and\s+|\s+or\s+)"
RUN = re.compile(ITEM + "(?:" + SEP + ITEM + ")+" + r"(?P<more>\s*,\s*\.\.\.)?")
CONFIG_NAME = re.compile(r"\b(" + "|".join([*CONFIGS, *OPTIONS]) + r")\b")
HEADING = re.compile(r"^#+ .*$", re.M)


def _blank_parentheses(text: str) -> str:
    """``text`` with what parentheses hold blanked (same length), so that a list reads
    ``device (...), timeout_s`` as two neighbours."""
    out, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
            out.append(" ")
            continue
        out.append(" " if depth and ch != "\n" else ch)
    return "".join(out)


def _config_before(text: str, pos: int) -> str | None:
    """The config a list at ``pos`` is about: named in its paragraph (or table row) before it,
    else in the heading above it, else the nearest one named before it."""
    start = max(text.rfind("\n\n", 0, pos), text.rfind("\n|", 0, pos))
    for scope in (text[start:pos],
                  (HEADING.findall(text[:pos]) or [""])[-1],
                  text[:pos]):
        names = CONFIG_NAME.findall(scope)
        if names:
            return OPTIONS.get(names[-1], names[-1])
    return None


def lists_in(doc: str, text: str) -> list[tuple[str, str | None, list[str], bool]]:
    """(file:line, config, names, partial) of every list of config fields in ``text``."""
    every = {f for c in CONFIGS for f in config_fields(c)}
    out = []
    blank = _blank_parentheses(text)
    for m in RUN.finditer(blank):
        names = re.findall(ITEM, m.group(0))
        if len(names) >= 3 and sum(n in every for n in names) >= 3:
            config = _config_before(text, m.start())
            out.append((f"{doc}:{line_of(text, m.start())}", config, names, bool(m.group("more"))))
    # tables whose first column is "field": the fields of the config the heading names
    for table in re.finditer(r"^\| field \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, re.M):
        heading = (HEADING.findall(text[:table.start()]) or [""])[-1]
        config = (CONFIG_NAME.findall(heading) or [None])[-1]
        names = re.findall(r"^\| `(\w+)` \|", table.group(1), re.M)
        out.append((f"{doc}:{line_of(text, table.start())}", OPTIONS.get(config, config),
                    names, False))
    return out


FIELD_LISTS = [found for doc in doc_files() for found in lists_in(doc, read(doc))]


def test_config_field_lists_are_found():
    configs = {c for _, c, _, _ in FIELD_LISTS}
    assert set(CONFIGS) <= configs
    assert {w.split(":")[0] for w, *_ in FIELD_LISTS} >= {"docs/configuration.md", "docs/api.md"}


def list_problems(lists) -> list[str]:
    problems = []
    for where, config, names, partial in lists:
        if config is None:
            problems.append(f"{where}: a list of config fields ({', '.join(names)}) names no config")
            continue
        fields = config_fields(config)
        have = [n for n in names if n in fields]
        if not have:  # a list of what the config does not take
            continue
        lacks = [n for n in names if n not in fields]
        missing = [f for f in fields if f not in names]
        if lacks:
            problems.append(f"{where}: {config} has no field {', '.join(lacks)}")
        if missing and not partial:
            problems.append(f"{where}: the list of {config}'s fields leaves out {', '.join(missing)} "
                            "(end it with ', ...' if it is meant to be partial)")
    return problems


def test_every_list_of_a_config_s_fields_is_whole():
    problems = list_problems(FIELD_LISTS)
    assert not problems, "\n".join(problems)


def test_the_checks_find_what_they_are_for():
    """Each check on a line written wrong: the issues these tests were written for."""
    def declared(name, args):
        return check_declaration(split_args(args), signature(name))

    old = declared("prepare_sharded_model", "model, mesh=None, *, auto_wrap_policy=None, "
                   "mixed_precision=None, activation_checkpointing=False")
    assert old == ["leaves out shard_output, parallelism, tp_plan, sequence_parallel, "
                   "loss_parallel (write them, or '...' where they go)"]
    assert "leaves out flops_per_step, peak_tflops, straggler_threshold" in declared(
        "configure_timeline", "samples_per_step=None, tokens_per_step=None, interval_s=None, "
        "storage_interval_s=None")[0]
    assert declared("save_checkpoint", 'state, metrics=None, filename="c.pt", wait=False') == [
        "'filename' defaults to 'checkpoint.pt', written \"c.pt\""]
    assert "keyword-only" in declared("load_pretrained", "model, path, dtype=None, ...")[0]
    assert "out of order" in declared("save_checkpoint", "state, wait=False, metrics=None, ...")[0]
    assert declared("get_sharded_mesh", "shape=None, ...") == []
    assert as_declaration(Written("x", "metrics", "step=None, execute_time=True", False)) is not None
    assert as_declaration(Written("x", "metrics", "step=None, execute_time=True", True)) is None
    assert as_declaration(Written("x", "metrics", "step, execute_time=True", False)) is None
    assert as_declaration(Written("x", "configure_reports", "writer_process=False", False)) is None
    assert "unexpected keyword argument 'flops'" in check_call(
        "configure_timeline", 0, ["flops"], False, signature("configure_timeline"))
    assert check_call("all_reduce", 4, [], False, signature("all_reduce"))
    assert build_config("TorchTPUConfig", [], [ast.keyword("efa", ast.Constant(True))]).startswith(
        "XLAConfigError: TorchTPUConfig.efa=True is not valid")
    text = ("## `TorchTPUConfig`\n\n`TorchTPUConfig` takes `device`, `timeout_s`, `env` and "
            "`compile_cache`.\n\nThere is no `spmd`, `runtime` or `efa`.\n\n"
            "It takes `device`, `efa`, `env` and `timeout_s`, ...\n")
    assert list_problems(lists_in("t.md", text)) == [
        "t.md:3: the list of TorchTPUConfig's fields leaves out profile_steps, memory_every, "
        "recovery, max_in_place_restarts, peak_tflops, parallelism (end it with ', ...' if it "
        "is meant to be partial)",
        "t.md:7: TorchTPUConfig has no field efa"]


def test_the_compile_cache_table_is_the_rule():
    """docs/configuration.md's table of what each runtime's compile cache reads is
    ``COMPILE_CACHES``, the rule ``check_compile_cache`` applies."""
    from ray_train_xla.planning.options import COMPILE_CACHES

    text = read("docs/configuration.md")
    table = re.search(r"^\| config \| device \| planned as \| URLs \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)",
                      text, re.M)
    assert table, "docs/configuration.md: no table '| config | device | planned as | URLs |'"
    rows = {}
    for row in table.group(1).splitlines():
        config, device, variable, urls = (c.strip() for c in row.strip("|").split("|")[:4])
        rows[(config.strip("`"), device.strip("`"))] = (variable.strip("`"),
                                                        tuple(re.findall(r"`(\w+)://`", urls)))
    assert rows == {key: (c.variable, c.schemes) for key, c in COMPILE_CACHES.items()}


# ---- planned values --------------------------------------------------------------------------------

# The kinds of plan (config and device), each on three topologies.
PLANS = [
    ["--device", "cpu"], ["--device", "neuron", "--efa", "--compile-cache", "/fsx/c"],
    ["--device", "tpu"], ["--device", "neuron", "--parallel-compile"],
    ["--device", "cpu", "--runtime", "native"], ["--device", "neuron", "--runtime", "native"],
    ["--device", "tpu", "--runtime", "native"],
]
TOPOLOGIES = [["--nodes", "1", "--workers-per-node", "1"], ["--nodes", "1", "--workers-per-node", "2"],
              ["--nodes", "2", "--workers-per-node", "4"]]
LOCAL_RANK = "<local rank>"


@pytest.fixture(scope="module")
def planned() -> dict[str, set[str]]:
    """Each variable that every plan of a kind sets to one value -> the values; a value that
    ends with the worker's local rank on every worker is written ``...<local rank>``."""
    from ray_train_xla.tools.cli import main

    values: dict[str, set[str]] = {}
    varying: set[str] = set()
    for flags in PLANS:
        kind: dict[str, set[str]] = {}
        for topology in TOPOLOGIES:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["plan", *flags, *topology, "--json"]) == 0
            rows = json.loads(out.getvalue())
            for var in set().union(*(r["env"] for r in rows)):
                seen = [r["env"].get(var) for r in rows]
                local = [str(r["local_rank"]) for r in rows]
                if len(local) > 1 and all(v is not None and v.endswith(":" + n) for v, n in zip(seen, local)):
                    seen = [v[:-len(n)] + LOCAL_RANK for v, n in zip(seen, local)]
                kind.setdefault(var, set()).update(seen)
        for var, seen in kind.items():
            # one worker: its local rank is 0
            seen -= {v[:-len(LOCAL_RANK)] + "0" for v in seen if v and v.endswith(LOCAL_RANK)}
            if len(seen) != 1 or None in seen:
                varying.add(var)
            values.setdefault(var, set()).update(seen)
    return {var: seen for var, seen in values.items() if var not in varying}


def test_every_planned_value_the_docs_write_is_planned(planned):
    """A ``VAR=value`` span of a variable every plan of a kind sets alike is a value some kind
    gets, and the docs write every such value of a variable they write at all."""
    assert planned["ACCELERATE_TORCH_DEVICE"] == {"xla:0", "tpu:0", f"neuron:{LOCAL_RANK}", "cpu"}
    problems, written = [], {}
    for doc in doc_files():
        text = read(doc)
        for m in re.finditer(r"`([A-Z][A-Z0-9_]*)=([^`]+)`", text):
            var, value = m.groups()
            if var not in planned:
                continue
            written.setdefault(var, set()).add(value)
            if value not in planned[var]:
                problems.append(f"{doc}:{line_of(text, m.start())}: {var}={value}, but the plans "
                                f"give {sorted(planned[var])}")
    assert len(written) >= 5
    for var, values in written.items():
        if planned[var] - values:
            problems.append(f"{var}: the docs write {sorted(values)}, not "
                            f"{sorted(planned[var] - values)}, which the plans give too")
    assert not problems, "\n".join(problems)
