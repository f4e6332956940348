"""examples/finetune_hf.py through real Ray Train (the shared one-node cluster): the same
training function fine-tunes a small random Llama with Ray Data batches under
``TorchXLAConfig(spmd=True)`` (FSDPv2, one worker on 4 virtual XLA CPU devices),
``TorchNeuronConfig(device="cpu", parallelism={"tp": 2})`` (``--tp 2 --sequence-parallel``: TP 2
x FSDP 2 on 4 workers) and ``TorchTPUConfig(device="cpu")`` (FSDP2, 2 workers). Each run fails
once after its step-4 checkpoint and resumes from it within the same fit (``FailureConfig``).
Three fits, one per config, shared by the tests of that config, each on another kind of data:
the generated text (xla), JSON-lines chats (neuron: loss on the assistant turns only) and
prompt/completion pairs (tpu: loss on the completions only), checked row by row against what
the data implies; under TP, the rows of each tensor-parallel group's peers and the reports'
loss and tokens against the data-parallel ranks'.

The export test (``consolidate_hf``, then ``from_pretrained``) is skipped while
``ray_train_xla.tools.consolidate.consolidate_hf`` cannot be imported."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from conftest import connected

pytestmark = [pytest.mark.ray, pytest.mark.beside]

STEPS, CRASH_AT = 8, 4
BUCKETS = [64, 128]
DATA = {"xla": "text", "neuron": "messages", "tpu": "completion"}
WORKERS = {"xla": 1, "neuron": 4, "tpu": 2}
TP = {"neuron": 2, "xla": 2}  # neuron: --tp 2 --sequence-parallel, TP 2 x FSDP 2; xla: TP 2 x FSDPv2 2


def examples_of(ft, kind: str, lines: int = 120) -> list[dict]:
    """Examples of one schema from the generated corpus, each short enough (under 128 bytes
    rendered) that nothing is cut."""
    corpus = ft.builtin_corpus(lines)
    if kind == "text":
        return [{"text": t[:120]} for t in corpus]
    if kind == "completion":
        return [{"prompt": f"Q{i % 7}: ", "completion": t[:100]} for i, t in enumerate(corpus)]
    return [{"messages": [{"role": "user", "content": f"say {i % 7}"},
                          {"role": "assistant", "content": t[:80]}]} for i, t in enumerate(corpus)]


def loss_tokens(example: dict) -> int:
    """The tokens of an example that carry loss with the byte tokenizer, from the data alone:
    every byte of a text, of a completion or of an assistant turn (with the newline that ends
    the turn), and the end token; never the begin token, a prompt or another role's turn."""
    if "text" in example:
        return len(example["text"].encode()) + 1
    if "completion" in example:
        return len(example["completion"].encode()) + 1
    return sum(len(m["content"].encode()) + 1 for m in example["messages"]
               if m["role"] == "assistant") + 1


@pytest.fixture(scope="module")
def cluster(one_node):
    with connected(one_node):
        yield one_node


def example():
    from ray_train_xla.tools.demo import load_example

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_example(os.path.join(root, "examples", "finetune_hf.py"))


def read_logs(out_dir: str) -> dict[int, list[dict]]:
    logs = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name)) as f:
                logs[int(name[len("rank"):-len(".jsonl")])] = [json.loads(line) for line in f]
    return logs


def pretrained_dir(path, tie: bool) -> str:
    """A small "pretrained" model directory as ``save_pretrained`` writes it, with its tokenizer:
    a byte-level BPE without merges (one token a byte, so the loss tokens of an example are
    counted as for the example's byte tokenizer) that begins a text with ``<s>`` (as Llama's
    does), end token ``</s>``, and a random Llama in fp32 (the export's default dtype, its
    stored one, keeps the trained logits exact)."""
    import tokenizers
    import torch
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=len(alphabet) + 3,
                                             special_tokens=["[UNK]", "<s>", "</s>"],
                                             initial_alphabet=alphabet)
    tok.train_from_iterator(["x"], trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        tie_word_embeddings=tie, eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id,
        pad_token_id=fast.pad_token_id)
    assert len(fast) <= config.vocab_size
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


# The native configs' runs are `make test-native`'s, on the torch those stacks ship.
NATIVE_ONLY = (pytest.mark.native, pytest.mark.native_only)


@pytest.fixture(scope="module", params=["xla", pytest.param("neuron", marks=NATIVE_ONLY),
                                        pytest.param("tpu", marks=NATIVE_ONLY)])
def run(request, cluster, tmp_path_factory):
    """One fit of the example on this config: 8 steps, a crash after step 4, a resume. The xla
    and tpu runs start from a pretrained directory (``--model``: loaded by slices; tied
    embeddings on tpu); the neuron run is TP 2 x FSDP 2 with sequence parallelism, the xla run
    TP 2 x FSDPv2 2 on its 4 devices."""
    name = request.param
    ft = example()
    tmp = tmp_path_factory.mktemp(f"finetune-{name}")
    out = tmp / "out"
    out.mkdir()
    workers, tp = WORKERS[name], TP.get(name, 1)
    model = pretrained_dir(tmp / "pretrained", tie=name == "tpu") if name != "neuron" else None
    # Two buckets (the example's default has three): fewer graphs for XLA to compile here, and
    # still more than one length to pad to.
    # lr: the tiny random model's default (3e-3), cosine decay and weight decay as in a real run.
    config = ft.ft_config(steps=STEPS, crash_at=CRASH_AT, checkpoint_every=4, eval_every=2,
                          warmup=2, batch_size=4, buckets=BUCKETS, marker_dir=str(tmp),
                          out_dir=str(out), model=model, lr=3e-3,
                          sequence_parallel=name == "neuron")
    # Every worker's shard of the held-out 10% holds a batch.
    examples = examples_of(ft, DATA[name], lines=max(120, 60 * workers))
    trainer = ft.build_trainer(
        config, ft.torch_config(name, "cpu", 4 if name == "xla" else None, tp=tp),
        ft.scaling_config(name, "cpu", workers), str(tmp / "results"), f"finetune-{name}",
        examples=examples, max_failures=1)
    result = trainer.fit()
    return SimpleNamespace(name=name, ft=ft, result=result, logs=read_logs(str(out)),
                           out=out, tmp=tmp, workers=workers, tp=tp, config=config,
                           examples=examples,
                           model=model, run_path=str(tmp / "results" / f"finetune-{name}"))


def test_trains_fails_once_and_resumes_from_its_checkpoint(run):
    assert os.path.exists(run.tmp / "finetune_hf_crashed_rank0")  # it did fail once
    assert sorted(run.logs) == list(range(run.workers))
    for rank, events in run.logs.items():
        starts = [e for e in events if e["event"] == "start"]
        steps = [e for e in events if e["event"] == "step"]
        # A fresh start, then one restart from the step-4 checkpoint at the data position that
        # step reached; every step trained exactly once.
        assert [s["resumed_from"] for s in starts] == [None, CRASH_AT], rank
        # The layout each attempt ran: the config's parallelism, on the stack's mesh.
        devices = 4 if run.name == "xla" else run.workers
        assert {s["layout"] for s in starts} == {
            f"dp_replicate=1,dp_shard={devices // run.tp},tp={run.tp}"}, rank
        mesh = {"fsdp": devices // run.tp, "model": run.tp} if run.name == "xla" else None
        assert [s["mesh"] for s in starts] == [mesh] * 2, rank
        at_crash = next(s for s in steps if s["step"] == CRASH_AT)
        assert (starts[1]["epoch"], starts[1]["position"]) == (at_crash["epoch"],
                                                               at_crash["position"])
        assert at_crash["position"] > 0
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), rank
    m = run.result.metrics
    assert m["step"] == STEPS
    reports = [e for e in run.logs[0] if e["event"] == "report"]
    assert [r["step"] for r in reports] == [2, 4, 6, 8]
    # The loss goes down (from about ln(264) = 5.6 for random weights).
    evals = [r["eval_loss"] for r in reports]
    assert evals[-1] < evals[0] - 0.2, evals
    assert reports[-1]["loss"] < reports[0]["loss"], [r["loss"] for r in reports]
    assert m["eval_loss"] == pytest.approx(evals[-1]) and m["tokens_per_s"] > 0
    assert m["bf16"] is False  # fp32 on the CPU
    if run.name == "xla":
        # XLA compiles per bucket, not per length: at most a train and an eval graph per
        # bucket in the restarted process, and two more (the optimizer's priming, the load).
        assert 0 < m["xla/compiles"] <= 2 * len(run.config["buckets"]) + 2, m
    else:
        assert m["xla/compiles"] == 0  # native eager: torch.compile graphs only, none here
    names = set(os.listdir(run.result.checkpoint.path))
    assert {".metadata", "extra.pt", "sharded.json"} <= names
    # The example steps its optimizer with a plain optimizer.step(): goodput counts its steps.
    from ray_train_xla.toolkit.observability.goodput import goodput_of

    result = goodput_of(run.run_path)
    counted = sum(max((w.steps for w in a.workers), default=0) for a in result.attempts)
    assert counted >= STEPS, [(a.id, [w.steps for w in a.workers]) for a in result.attempts]
    assert result.buckets["productive"] > 0, result.buckets


def test_only_completion_tokens_carry_loss(run):
    """Every row trained on carries loss on exactly the tokens its example implies: for chats,
    the assistant turns; for prompt/completion pairs, the completions (each step logs the
    example index and the count of tokens with a label of each of its rows)."""
    train, _ = run.ft.split_examples(run.examples)
    rows = [row for events in run.logs.values() for e in events if e["event"] == "step"
            for row in e["rows"]]
    assert len(rows) >= STEPS * run.config["batch_size"], len(rows)
    for index, count in rows:
        assert count == loss_tokens(train[index]), (index, train[index])


def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(run, tmp_path):
    try:
        from ray_train_xla.tools.consolidate import consolidate_hf  # noqa: F401
    except ImportError:
        pytest.skip("ray_train_xla.tools.consolidate.consolidate_hf is not on this branch yet")
    import torch
    from transformers import AutoModelForCausalLM

    hf_dir = str(tmp_path / "hf")
    # Through the checkpoint's own filesystem, as on S3 or GCS.
    run.ft.export_hf(run.result.checkpoint, hf_dir, source=run.model)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=run.ft.probe_ids(model.config.vocab_size)).logits
    trained = torch.load(run.out / "probe_logits.pt")
    if run.model:  # loaded by slices; exported with its tokenizer, in its stored dtype
        assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(hf_dir))
        assert model.dtype == torch.float32
        assert model.config.tie_word_embeddings is (run.name == "tpu")
        untrained = AutoModelForCausalLM.from_pretrained(run.model).eval()
    else:
        untrained = run.ft.make_model(run.config).eval()
    with torch.no_grad():
        initial = untrained(input_ids=run.ft.probe_ids(model.config.vocab_size)).logits
    assert not torch.allclose(trained, initial, atol=1e-3)  # it trained
    assert torch.allclose(logits, trained, atol=1e-4, rtol=1e-4), (logits - trained).abs().max()


def test_tensor_parallel_peers_train_on_the_same_rows_and_reports_count_each_batch_once(run):
    """Under ``--tp 2`` (the neuron run): the peers of a tensor-parallel group train on the same
    rows every step, the two data-parallel ranks on rows of their own, and each report's loss
    is the mean of the data-parallel ranks' losses and its tokens theirs, counted once."""
    if run.tp == 1 or run.name == "xla":
        pytest.skip("no tensor-parallel peers among the workers (the xla run is one SPMD process; "
                    "test_xla_tp_local checks its batches' partition specs)")
    by_dp: dict[int, list[dict]] = {}
    for rank, events in run.logs.items():
        starts = [e for e in events if e["event"] == "start"]
        assert {tuple(s["dp"]) for s in starts} == {(rank // run.tp, run.workers // run.tp)}, rank
        by_dp.setdefault(rank // run.tp, []).append(
            {e["step"]: e for e in events if e["event"] == "step"})
    dp = len(by_dp)
    assert dp == run.workers // run.tp == 2
    for peers in by_dp.values():
        for step in range(1, STEPS + 1):
            assert len({json.dumps(p[step]["rows"]) for p in peers}) == 1, step
            assert len({p[step]["loss"] for p in peers}) == 1, step
    first = [by_dp[d][0] for d in range(dp)]
    for step in range(1, CRASH_AT + 1):  # the first attempt's rows, apart per dp rank
        seen = [{i for i, _ in steps[step]["rows"]} for steps in first]
        assert not seen[0] & seen[1], step
    reports = [e for e in run.logs[0] if e["event"] == "report"]
    for before, report in zip([0] + [r["step"] for r in reports], reports):
        step = report["step"]
        assert report["loss"] == pytest.approx(
            sum(steps[step]["loss"] for steps in first) / dp, rel=1e-5)
        assert report["tokens"] == sum(n for steps in first for s in range(before + 1, step + 1)
                                       for _, n in steps[s]["rows"])
