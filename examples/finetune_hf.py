"""Fine-tune a Hugging Face causal LM, sharded, with one training function for every backend.

The same ``train_loop`` runs torch_xla FSDPv2 under ``TorchXLAConfig(spmd=True)`` (one worker per
host owning its devices; on the CPU, one worker with ``--devices`` virtual XLA devices) and FSDP2
under ``TorchNeuronConfig`` / ``TorchTPUConfig`` (one worker per NeuronCore or chip; on the CPU,
``--workers`` gloo workers); ``--config xla|neuron|tpu`` picks the config object, nothing else
changes. Each decoder layer (``LlamaDecoderLayer``, or the model's ``_no_split_modules``) is
sharded on its own; ``--hsdp`` (FSDP2 only) shards within a node and replicates across nodes,
``--activation-checkpointing`` recomputes each layer in the backward pass, and
``--compile-cache DIR`` gives the config object its shared compile cache. ``--tp N`` is the
config's ``parallelism={"tp": N}``: under FSDP2 each group of N consecutive workers (inside a
node) splits every layer by the model's own Hugging Face TP plan, FSDP2 shards over the groups,
and the data is split by data-parallel rank, the peers of a group training on the same rows
(``rtx.iter_xla_batches``; ``--sequence-parallel`` also splits the norms and the residual
stream over the sequence); under FSDPv2 the SPMD mesh gets a ``model`` axis of N devices for the
same plan as partition specs, beside ``fsdp``.

Model: ``--model PATH``, a directory ``save_pretrained`` wrote (safetensors), on a filesystem
every node reads (read in place), since Ray Data's tokenizing tasks read its tokenizer too (in
a training function of your own, ``rtx.pretrained_path(uri)`` fetches an ``s3://`` or ``gs://``
model once per node); or ``--model ORG/NAME[@REVISION]``, a Hugging Face Hub id (one that is no
existing path): each node's local rank 0 fetches it into the node's Hugging Face cache
(``rtx.pretrained_path``; ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` as
huggingface_hub reads them), the tokenizing tasks load its tokenizer by the id, and the driver
fetches its config and tokenizer files (not its weights) to check the id before Ray starts and
for the export. Each worker builds the model from its ``config.json`` on the meta
device and ``rtx.load_pretrained`` fills it by slices in the training dtype: under FSDP2 each
worker reads only its own shards, under FSDPv2 the host's one process reads the model once; no
process holds more, so a model larger than one host loads the same way. Without ``--model``, a
small ``LlamaConfig`` built here with random weights and a byte-level tokenizer, so the default
run needs no download.

Data: ``--data FILE.jsonl``, one JSON object a line, either ``{"prompt": ..., "completion":
...}`` (the completion follows the prompt directly: put any separator in the data; loss on the
completion and the end token) or ``{"messages": [{"role": "user", "content": ...}, {"role":
"assistant", "content": ...}]}`` (rendered by the tokenizer's chat template; loss on every
assistant turn, or on the last one where the template renders earlier turns differently). The
byte tokenizer renders chats itself (``<|role|>``, a newline, the content, a newline); a
``--model`` tokenizer without a chat template is refused for chats. Any other ``--data FILE`` is
one text a line with loss on every token, and without ``--data`` a generated corpus
(``--corpus-lines``). Labels are -100 wherever there is no loss. The driver reads and checks
the file before Ray starts (a line of an unknown schema is refused with its number); Ray Data
tokenizes it (``map_batches``) and pads rows to a few bucket lengths derived from ``--seq-len``
(a quarter, a half and all of it, multiples of 8), so XLA compiles one graph per bucket, not one
per length. ``--pack`` fills rows of ``--seq-len`` tokens with several whole examples each
(labels stay per example; attention crosses the examples of a row, as in simple packing). A
held-out split (the last 10%) gives ``eval_loss`` every ``--eval-every`` steps.

Training: AdamW, weight decay (``--weight-decay``) on the matrices only, linear warm-up
(``--warmup`` steps) then a cosine decay to ``--min-lr-ratio`` of the peak ``--lr`` (2e-5 with
``--model``; 3e-3 for the random tiny model, which must show a falling loss in a few steps),
gradient accumulation (``--accum``), clipping by the global norm. bf16 on Neuron and TPU: a
pretrained model's parameters are read into bf16 (FSDP2 reduces gradients in fp32), the random
model uses FSDP2's ``mixed_precision="bf16"`` (all bf16 under FSDPv2); fp32 on the CPU, where
bf16 matmuls are emulated on most CPUs (slower than fp32) and a CPU run is a check of the
script. Reports carry
loss, tokens/s and compile counts; checkpoints (sharded, every ``--checkpoint-every`` steps) the
step, the data position and the model's ``hf_config``, so a failed run resumes where it stopped
(``--crash-at STEP`` fails once to show it), and the driver writes a Hugging Face model
directory from the last one (``--export DIR``; ``--no-export``): one tensor at a time, only the
model's tensors, read through the checkpoint's own filesystem (local, S3, GCS), in the
pretrained model's stored dtype (``--export-dtype``), with its tokenizer files. ``validate(argv)`` runs every
check of the command line before Ray starts.

    python examples/finetune_hf.py --config xla --devices 4 --steps 40      # FSDPv2, XLA CPU
    python examples/finetune_hf.py --config neuron --workers 2 --steps 40   # FSDP2, CPU workers
    python examples/finetune_hf.py --config tpu --workers 2 --crash-at 20   # fail once, resume
    python examples/finetune_hf.py --config neuron --workers 2 --seq-len 256 --pack --corpus-lines 1200
    python examples/finetune_hf.py --config neuron --workers 4 --tp 2 --sequence-parallel  # TP 2 x FSDP 2
    python examples/finetune_hf.py --config neuron --device neuron --workers 32 \\
        --accelerators-per-worker 1 --address auto --storage-path /fsx/runs --model /fsx/llama \\
        --corpus-lines 4000 --seq-len 1024 --hsdp --activation-checkpointing \\
        --compile-cache /fsx/neff-cache
    python examples/finetune_hf.py --config tpu --device tpu --workers 16 \\
        --tpu-topology 4x4 --accelerator-type TPU-V6E --address auto --storage-path gs://b/runs \\
        --corpus-lines 2000 --export /tmp/finetune_hf-tpu
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

DEFAULT_SEQ_LEN = 128
# The byte-level tokenizer: 0 padding, 1 begin, 2 end, then the 256 byte values; the vocabulary
# is rounded up to a multiple of 8 so that FSDPv2 splits the embedding evenly over 8 devices.
PAD, BOS, EOS, BYTE0 = 0, 1, 2, 3
BYTE_VOCAB = 264
IGNORE = -100  # the label of a token that carries no loss (cross_entropy's ignore_index)
CONFIGS = ("xla", "neuron", "tpu")
EVAL_FRACTION = 0.1  # of the examples, held out (the last ones)
# Full fine-tuning of a pretrained model wants a small rate; the built-in random tiny model needs a
# large one to show a falling loss within a few steps of a CPU check.
PRETRAINED_LR, TINY_LR = 2e-5, 3e-3


def buckets_for(seq_len: int) -> list[int]:
    """The lengths rows are padded to: a quarter, a half and all of ``seq_len``, each rounded up to
    a multiple of 8. XLA compiles one graph per bucket (not one per length), so a few buckets
    keep compilation bounded while short rows are not padded to ``seq_len``."""
    return sorted({max(8, -(-length // 8) * 8) for length in (seq_len // 4, seq_len // 2, seq_len)})


def default_lr(model: str | None) -> float:
    """2e-5 for a pretrained ``--model``; 3e-3 for the built-in random tiny model."""
    return PRETRAINED_LR if model else TINY_LR


def ft_config(**overrides) -> dict:
    """Model, data and training settings (the training function's config). ``buckets`` follow
    from ``seq_len`` unless given (then ``seq_len`` is their largest); ``lr`` None is
    :func:`default_lr` of the model."""
    config = {
        "model": None,  # a model directory or a Hub id; None: the small Llama
        "hidden": 64, "layers": 2, "heads": 4, "ff": 128,
        "seq_len": DEFAULT_SEQ_LEN, "buckets": None, "pack": False,
        "batch_size": 8, "accum": 1,
        "lr": None, "warmup": None, "min_lr_ratio": 0.1, "weight_decay": 0.1,
        "steps": 40, "max_grad_norm": 1.0,
        "eval_every": 10, "checkpoint_every": 10,
        "precision": "auto",  # auto: bf16 on Neuron/TPU devices, fp32 on the CPU
        # For the model-building lines: HSDP (get_sharded_mesh("hsdp"), native configs only) and
        # activation checkpointing (prepare_sharded_model(..., activation_checkpointing=True)).
        "hsdp": False, "activation_checkpointing": False,
        # Tensor parallelism is the config's parallelism (torch_config(..., tp=N)); sequence
        # parallelism is the model-building call's (prepare_sharded_model / load_pretrained).
        "sequence_parallel": False,
        "crash_at": None, "marker_dir": None, "out_dir": None, "seed": 0,
    }
    config.update(overrides)
    if config["buckets"] is None:
        config["buckets"] = buckets_for(config["seq_len"])
    config["buckets"] = sorted(config["buckets"])
    config["seq_len"] = config["buckets"][-1]
    if config["lr"] is None:
        config["lr"] = default_lr(config["model"])
    if config["warmup"] is None:
        config["warmup"] = default_warmup(config["steps"])
    return config


def default_warmup(steps: int) -> int:
    """The warm-up when ``--warmup`` is not given: 5 steps, or a quarter of ``steps`` when that
    is fewer (a short run keeps most of its steps for the decay; 0 below 4 steps)."""
    return min(5, steps // 4)


# ---------------------------------------------------------------------------------------- data
#
# An example is a dict of one of three kinds: {"text": ...} (plain text: every token carries
# loss), {"prompt": ..., "completion": ...} (loss on the completion only) or {"messages": [{"role":
# ..., "content": ...}, ...]} (a chat, rendered by the tokenizer's chat template: loss on the
# assistant turns only). Tokenizing gives each example its ids and labels (IGNORE where no loss).


def builtin_corpus(lines: int = 600, seed: int = 0) -> list[str]:
    """Generated English-like text, 1 to 4 clauses a line (about 20 to 120 bytes: every bucket)."""
    import random

    rng = random.Random(seed)
    adjectives = ["quick", "lazy", "small", "bright", "quiet", "old", "red", "happy"]
    nouns = ["fox", "dog", "cat", "bird", "river", "tree", "child", "ship"]
    verbs = ["sees", "follows", "finds", "likes", "passes", "watches"]
    out = []
    for _ in range(lines):
        clauses = [f"the {rng.choice(adjectives)} {rng.choice(nouns)} {rng.choice(verbs)} "
                   f"the {rng.choice(nouns)}" for _ in range(rng.randint(1, 4))]
        out.append(", and ".join(clauses) + ".")
    return out


def example_kind(record) -> str:
    """"text", "completion" or "messages": the schema of one example; ValueError says what is
    wrong with one that has none of them (or more than one)."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    kinds = [k for k, keys in (("text", ("text",)), ("completion", ("prompt", "completion")),
                               ("messages", ("messages",)))
             if any(key in record for key in keys)]
    if len(kinds) != 1:
        raise ValueError('expected {"prompt": ..., "completion": ...} or {"messages": [...]} (or '
                         f'{{"text": ...}}), got the keys {sorted(record)}')
    kind = kinds[0]
    if kind == "text" and not isinstance(record["text"], str):
        raise ValueError('"text" must be a string')
    if kind == "completion":
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise ValueError(f'"prompt" and "completion" must both be strings ({key!r} is '
                                 f'{type(record.get(key)).__name__})')
        if not record["completion"]:
            raise ValueError('"completion" is empty: nothing to carry the loss')
    if kind == "messages":
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list')
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ValueError(f'messages[{i}] must be {{"role": str, "content": str}}, got {m!r}')
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError('no "assistant" message: nothing to carry the loss')
    return kind


def read_examples(path: str | None, corpus_lines: int = 600) -> list[dict]:
    """The examples: the built-in corpus (``path`` None), a ``.jsonl`` file (one JSON object a
    line, see :func:`example_kind`) or a text file (one text a line). Empty lines are skipped; a
    line of an unknown schema is refused with its number."""
    if path is None:
        return [{"text": t} for t in builtin_corpus(corpus_lines)]
    import json

    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not path.endswith(".jsonl"):
                examples.append({"text": line.rstrip("\n")})
                continue
            try:
                record = json.loads(line)
                example_kind(record)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"--data {path} line {number}: {e}") from None
            examples.append(record)
    if not examples:
        raise ValueError(f"--data {path}: no non-empty lines")
    return examples


_TOKENIZERS: dict = {}


def hf_tokenizer(name: str):
    """``AutoTokenizer.from_pretrained(name)``, once per process."""
    if name not in _TOKENIZERS:
        from transformers import AutoTokenizer

        _TOKENIZERS[name] = AutoTokenizer.from_pretrained(name)
    return _TOKENIZERS[name]


def byte_ids(text: str) -> list[int]:
    return [BYTE0 + b for b in text.encode("utf-8")]


def byte_chat(messages: list[dict]) -> tuple[list[int], list[int]]:
    """The byte tokenizer's chat rendering, ``<|role|>\\n`` then the content and a newline per
    message, begin and end tokens around: (ids, labels) with loss on each assistant content
    and its newline (the turn's end), and on the end token after a final assistant turn."""
    ids, labels = [BOS], [IGNORE]
    for m in messages:
        header, body = byte_ids(f"<|{m['role']}|>\n"), byte_ids(m["content"] + "\n")
        ids += header + body
        labels += [IGNORE] * len(header) + (body if m["role"] == "assistant" else [IGNORE] * len(body))
    ids.append(EOS)
    labels.append(EOS if messages[-1]["role"] == "assistant" else IGNORE)
    return ids, labels


def chat_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The chat template's text of ``messages`` and the character spans of the assistant turns:
    turn i spans from the render of ``messages[:i]`` with the generation prompt to the render
    of ``messages[:i + 1]`` (so a turn's end-of-turn tokens carry loss, its header does not).
    Every assistant turn where each such prefix is a prefix of the whole text; where one is not
    (a template that renders earlier turns differently, e.g. dropping their reasoning), only the
    last assistant turn; ValueError where not even that one is."""
    def render(msgs, generation_prompt):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages, False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = []
    for i in turns:
        start, end = render(messages[:i], True), render(messages[:i + 1], False)
        if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
            break
        spans.append((len(start), len(end)))
    else:
        return text, spans
    last = turns[-1]
    start, end = render(messages[:last], True), render(messages[:last + 1], False)
    if text.startswith(start) and text.startswith(end) and len(start) <= len(end):
        return text, [(len(start), len(end))]
    raise ValueError("the chat template does not render a conversation's beginning as a prefix of "
                     "the whole: cannot tell which tokens are the assistant's")


def hf_encode(tok, example: dict, kind: str) -> tuple[list[int], list[int]]:
    """(ids, labels) of one example with a Hugging Face tokenizer (see :func:`encode_example`)."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if kind == "text":  # as the byte tokenizer: the tokenizer's own start, the text, the end
        ids = tok(example["text"])["input_ids"] + eos
        return ids, list(ids)
    if kind == "completion":
        prompt = tok(example["prompt"])["input_ids"]
        completion = tok(example["completion"], add_special_tokens=False)["input_ids"] + eos
        return prompt + completion, [IGNORE] * len(prompt) + completion
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"the tokenizer {tok.name_or_path!r} has no chat_template: it cannot "
                         "render messages; give prompt/completion data or a chat model's tokenizer")
    text, spans = chat_spans(tok, example["messages"])
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [t if any(s <= a < e for s, e in spans) else IGNORE
                  for t, (a, _) in zip(ids, enc["offset_mapping"])]
        return ids, labels
    # A slow tokenizer has no offsets: tokenize the pieces between the span boundaries.
    ids, labels, at = [], [], 0
    for s, e in spans:
        for piece, loss in ((text[at:s], False), (text[s:e], True)):
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += piece_ids
            labels += piece_ids if loss else [IGNORE] * len(piece_ids)
        at = e
    rest = tok(text[at:], add_special_tokens=False)["input_ids"] if text[at:] else []
    return ids + rest, labels + [IGNORE] * len(rest)


def encode_example(example: dict, model: str | None, max_len: int) -> tuple[list[int], list[int]]:
    """(ids, labels) of one example, cut to ``max_len``: labels are the ids where the token
    carries loss (every token of a text, the completion and its end token, the assistant turns)
    and IGNORE elsewhere. The first label is always IGNORE: nothing predicts a row's first token,
    nor, in a packed row, an example's first token from the example before it."""
    kind = example_kind(example)
    if model is not None:
        ids, labels = hf_encode(hf_tokenizer(model), example, kind)
    elif kind == "text":
        ids = [BOS] + byte_ids(example["text"]) + [EOS]
        labels = list(ids)
    elif kind == "completion":
        prompt, completion = [BOS] + byte_ids(example["prompt"]), byte_ids(example["completion"]) + [EOS]
        ids, labels = prompt + completion, [IGNORE] * len(prompt) + completion
    else:
        ids, labels = byte_chat(example["messages"])
    ids, labels = ids[:max_len], labels[:max_len]
    if labels:
        labels[0] = IGNORE
    return ids, labels


def pad_id(model: str | None) -> int:
    if model is None:
        return PAD
    tok = hf_tokenizer(model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return 0 if pad is None else pad


def bucket_of(length: int, buckets: list[int]) -> int:
    return next(b for b in buckets if length <= b)


def pack_rows(encoded: list[tuple[list[int], list[int]]], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Examples concatenated, in order, into rows of at most ``seq_len`` tokens; an example that
    does not fit in the current row starts the next one (none is split). Labels stay each
    example's own; attention crosses the examples of a row (a causal mask, no per-example mask,
    positions not restarted), as in the usual simple packing."""
    rows: list[tuple[list[int], list[int]]] = []
    for ids, labels in encoded:
        if rows and len(rows[-1][0]) + len(ids) <= seq_len:
            rows[-1][0].extend(ids)
            rows[-1][1].extend(labels)
        else:
            rows.append((list(ids), list(labels)))
    return rows


def tokenize_batch(batch: dict, model: str | None, buckets: list[int], pack: bool = False) -> dict:
    """Ray Data ``map_batches``: examples (JSON strings in ``example``) -> ``input_ids`` and
    ``labels`` padded to the largest bucket (labels IGNORE on padding and where no loss), each
    row's ``bucket`` (the smallest bucket it fits) and ``index`` (the example's position in its
    split; -1 for packed rows). With ``pack`` the batch's examples are packed into rows
    (:func:`pack_rows`). A training batch is cut to the largest bucket among its rows
    (``cut_to_bucket``)."""
    import json

    import numpy as np

    buckets = sorted(buckets)
    width = buckets[-1]
    encoded = [encode_example(json.loads(str(e)), model, width) for e in batch["example"]]
    index = [int(i) for i in batch["index"]]
    if pack:
        encoded = pack_rows(encoded, width)
        index = [-1] * len(encoded)
    n, pad = len(encoded), pad_id(model)
    input_ids = np.full((n, width), pad, dtype=np.int64)
    labels = np.full((n, width), IGNORE, dtype=np.int64)
    bucket = np.zeros(n, dtype=np.int64)
    for i, (row_ids, row_labels) in enumerate(encoded):
        input_ids[i, :len(row_ids)] = row_ids
        labels[i, :len(row_labels)] = row_labels
        bucket[i] = bucket_of(max(len(row_ids), 1), buckets)
    return {"input_ids": input_ids, "labels": labels, "bucket": bucket,
            "index": np.asarray(index, dtype=np.int64)}


def cut_to_bucket(batch: dict) -> tuple:
    """(input_ids, labels) of a CPU batch, cut to the largest bucket among its rows: right
    padding under a causal mask, so no real token attends to padding and no mask is needed."""
    width = int(batch["bucket"].max())
    return batch["input_ids"][:, :width], batch["labels"][:, :width]


def split_examples(examples: list, eval_fraction: float = EVAL_FRACTION) -> tuple[list, list]:
    """(train, eval): the last ``eval_fraction`` of the examples (at least one) is held out."""
    n_eval = max(1, int(len(examples) * eval_fraction))
    if len(examples) - n_eval < 1:
        raise ValueError(f"{len(examples)} examples: too few to hold out {n_eval} for eval")
    return examples[:-n_eval], examples[-n_eval:]


def make_datasets(examples: list, config: dict, eval_fraction: float = EVAL_FRACTION) -> dict:
    """{"train", "eval"}: Ray Data datasets of tokenized rows. ``examples`` are dicts (see
    :func:`example_kind`) or plain strings (texts); each travels as a JSON string, so that
    examples of different schemas share one column."""
    import json

    import ray.data

    kwargs = {"fn_kwargs": {"model": config["model"], "buckets": config["buckets"],
                            "pack": config["pack"]},
              "batch_size": 64}

    def dataset(part):
        items = [{"example": json.dumps(e if isinstance(e, dict) else {"text": e}), "index": i}
                 for i, e in enumerate(part)]
        return ray.data.from_items(items).map_batches(tokenize_batch, **kwargs)

    train, held_out = split_examples(examples, eval_fraction)
    return {"train": dataset(train), "eval": dataset(held_out)}


# --------------------------------------------------------------------------------------- model


def make_model(config: dict, dtype=None):
    """The causal LM: for ``config["model"]`` (a local model directory), built from its
    ``config.json`` on the meta device (no memory: ``load_pretrained`` allocates each rank's
    shards and reads them); else a small random Llama on the CPU (fp32)."""
    import torch

    if config["model"]:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config["model"]),
                                                    dtype=dtype or torch.float32)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=BYTE_VOCAB, hidden_size=config["hidden"], intermediate_size=config["ff"],
        num_hidden_layers=config["layers"], num_attention_heads=config["heads"],
        num_key_value_heads=config["heads"], max_position_embeddings=max(config["buckets"]),
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(config["seed"])
    return LlamaForCausalLM(hf_config)


def source_config(config: dict, model) -> dict:
    """The model's config as saved in checkpoints (``hf_config``, for the export): the
    pretrained model's own ``config.json`` (with its stored dtype, the export's default), or
    the random model's."""
    if config["model"] and os.path.isfile(os.path.join(config["model"], "config.json")):
        import json

        with open(os.path.join(config["model"], "config.json"), encoding="utf-8") as f:
            return json.load(f)
    return model.config.to_dict()


def block_classes(model) -> set:
    """The decoder layer classes, sharded one by one: the model's ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); cannot shard it block by block")
    return classes


def xla_shard_output(output, mesh) -> None:
    """FSDPv2's output sharding for a decoder layer (a tensor) and for the whole model (a
    ``CausalLMOutputWithPast``: its logits), split on dim 0 like the batch."""
    import torch
    import torch_xla.distributed.spmd as xs

    t = output if isinstance(output, torch.Tensor) else output.logits
    xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))


def lm_loss(model, input_ids, labels):
    """Next-token cross entropy over the tokens that carry loss (labels not IGNORE): their mean,
    0 for a batch with none (a completion cut off by ``seq_len``) rather than NaN. The model is
    called with ``use_cache=False``: training keeps no key/value cache, and activation
    checkpointing refuses one."""
    import torch

    logits = model(input_ids=input_ids, use_cache=False).logits
    targets = labels[:, 1:].reshape(-1)
    summed = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets, ignore_index=IGNORE,
        reduction="sum")
    return summed / (targets != IGNORE).sum().clamp(min=1)


def lr_at(step: int, config: dict) -> float:
    """The learning rate of 0-based ``step``: linear warm-up over ``warmup`` steps up to ``lr``
    (reached at step ``warmup - 1``), then a cosine decay to ``min_lr_ratio * lr``, reached at
    the last step (``steps - 1``)."""
    import math

    lr, warmup, steps = config["lr"], config["warmup"], config["steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    floor = lr * config["min_lr_ratio"]
    progress = min(1.0, (step - warmup + 1) / max(1, steps - warmup))
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on the matrices (embeddings included), none on parameters
    of fewer than 2 dimensions (biases, norm weights), the usual rule: decaying a norm's scale
    or a bias towards 0 only fights the model. Shards (FSDP2's DTensors, FSDPv2's) keep the
    full parameter's ``ndim``."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def use_bf16(config: dict, on_cpu: bool) -> bool:
    if config["precision"] == "auto":
        return not on_cpu
    return config["precision"] == "bf16"


# ------------------------------------------------------------------------------------ training


def train_loop(config: dict) -> None:
    """The training function, the same for FSDPv2 (XLA SPMD) and FSDP2 (native configs)."""
    import json

    import ray.train
    import torch

    import ray_train_xla as rtx

    device = rtx.get_device()
    spmd = device.type == "xla"  # TorchXLAConfig(spmd=True): FSDPv2; else FSDP2
    on_cpu = device.type == "cpu" or (spmd and os.environ.get("PJRT_DEVICE", "").upper() == "CPU")
    bf16 = use_bf16(config, on_cpu)
    # (On the native configs the plan sets USE_TORCH_XLA=0: transformers, imported below,
    # keeps off torch_xla where it is installed.)
    # A pretrained model is loaded by slices in its training dtype (bf16 on devices): FSDP2 reads
    # each rank's slices; under FSDPv2 the host's one process reads it once, then shards it.
    dtype = torch.bfloat16 if bf16 else torch.float32
    if config["model"]:  # a Hub id: fetched once per node into its Hugging Face cache
        config = {**config, "model": rtx.pretrained_path(config["model"])}
    model = make_model(config, dtype)
    hf_config = source_config(config, model)
    blocks = block_classes(model)
    options = {"auto_wrap_policy": blocks,
               "activation_checkpointing": config.get("activation_checkpointing", False)}
    if spmd:
        mesh = rtx.get_sharded_mesh()
        if config["batch_size"] % mesh.size():
            raise ValueError(f"batch_size {config['batch_size']} is split over {mesh.size()} "
                             "devices under FSDPv2: make it a multiple of the device count")
        options.update(shard_output=xla_shard_output)
        if config["model"]:
            model = rtx.load_pretrained(model, config["model"], dtype=dtype, mesh=mesh, **options)
        else:
            if bf16:
                model = model.to(torch.bfloat16)  # FSDPv2 has no mixed precision: all bf16
            model = rtx.prepare_sharded_model(model, mesh, **options)
    else:
        mesh = None
        # The layout is the config's parallelism: with --tp, TP over each group of tp workers,
        # then FSDP2 over the groups (the default mesh); else FSDP2 (or HSDP) over every worker.
        shards = rtx.get_sharded_mesh("hsdp") if config.get("hsdp") else None
        if config.get("sequence_parallel"):
            options["sequence_parallel"] = True
        if config["model"]:
            # bf16 parameters; gradients reduced in fp32.
            from torch.distributed.fsdp import MixedPrecisionPolicy

            model = rtx.load_pretrained(
                model, config["model"], dtype=dtype, mesh=shards,
                mixed_precision=MixedPrecisionPolicy(reduce_dtype=torch.float32) if bf16 else None,
                **options)
        else:
            model = rtx.prepare_sharded_model(model, shards, mixed_precision="bf16" if bf16 else None,
                                              **options)
    optimizer = torch.optim.AdamW(param_groups(model, config["weight_decay"]), lr=config["lr"])

    def to_device(t):
        return rtx.shard_batch(t, mesh) if spmd else t.to(device)

    state = rtx.load_checkpoint(model, optimizer)  # this rank's shards; None on a fresh start
    step = state["step"] if state else 0
    epoch, position = (state["epoch"], state["position"]) if state else (0, 0)
    rank, out_dir = rtx.rank(), config.get("out_dir")
    # Which batch this worker trains on: its data-parallel rank, shared with its tensor-parallel
    # peers (iter_xla_batches hands them the same batches); tp peers of a group (1 without TP).
    dp_rank, dp = rtx.data_parallel()
    tp = 1 if spmd else rtx.world_size() // dp

    def log(record: dict) -> None:  # for tests: what this rank did, one JSON line each
        if out_dir:
            with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    log({"event": "start", "resumed_from": step if state else None, "epoch": epoch,
         "position": position, "dp": [dp_rank, dp],
         "layout": rtx.get_layout().to_text(), "mesh": dict(mesh.shape()) if spmd else None})
    train_shard = ray.train.get_dataset_shard("train")
    eval_shard = ray.train.get_dataset_shard("eval")
    batch_size, accum = config["batch_size"], config["accum"]

    def train_batches():
        """CPU batches across epochs; ``epoch`` and ``position`` (batches read in it) follow
        them. After a restart the batches of the epoch already trained on are skipped."""
        nonlocal epoch, position
        while True:
            seen = 0
            # CPU batches: cut to their bucket, then put on the device (sharded under SPMD).
            for i, batch in enumerate(rtx.iter_xla_batches(train_shard, batch_size,
                                                           to_device=False)):
                seen += 1
                if i < position:
                    continue
                position = i + 1
                yield batch
            if seen == 0:
                raise ValueError(f"rank {rank}: the train split has fewer than batch_size="
                                 f"{batch_size} rows per worker (with --pack: packed rows, "
                                 "several examples each)")
            epoch, position = epoch + 1, 0

    def evaluate() -> float:
        model.eval()
        total = torch.zeros((), device=device)
        count = 0
        with torch.no_grad():
            for batch in rtx.iter_xla_batches(eval_shard, batch_size, to_device=False):
                ids, labels = cut_to_bucket(batch)
                n = int((labels[:, 1:] != IGNORE).sum())
                total = total + lm_loss(model, to_device(ids), to_device(labels)).float() * n
                count += n
                rtx.sync()
        model.train()
        both = torch.stack([total.detach().float().cpu(), torch.tensor(float(count))])
        # Summed over every worker: tensor-parallel peers add the same batches tp times to
        # both sums, which leaves their ratio the loss over the data-parallel ranks' rows.
        if rtx.world_size() > 1 and not spmd:
            both = rtx.all_reduce(both.to(device)).cpu()
        return float(both[0] / both[1]) if both[1] else float("nan")

    # Warm-up: until the first eval has compiled its graphs. A bucket first seen later is one
    # more graph, counted in xla/compiles_after_warmup.
    monitor = rtx.CompileMonitor(warmup_steps=min(config["eval_every"], config["steps"]))
    batches = train_batches()
    tokens, interval_start = 0, time.perf_counter()
    crash_marker = os.path.join(config.get("marker_dir") or tempfile.gettempdir(),
                                f"finetune_hf_crashed_rank{rank}")
    model.train()
    while step < config["steps"]:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        optimizer.zero_grad()
        step_loss = torch.zeros((), device=device)
        rows = []  # for tests: (example index, tokens carrying loss) of each row of this step
        for _ in range(accum):
            batch = next(batches)
            ids, labels = cut_to_bucket(batch)
            tokens += int((labels[:, 1:] != IGNORE).sum())
            if out_dir:
                rows += [[int(i), int(n)] for i, n in zip(batch["index"].tolist(),
                                                          (labels[:, 1:] != IGNORE).sum(1).tolist())]
            loss = lm_loss(model, to_device(ids), to_device(labels)) / accum
            loss.backward()
            step_loss = step_loss + loss.detach()
            if accum > 1:
                rtx.sync()  # one graph per bucket, not one per mix of buckets
        grad_norm = rtx.clip_grad_norm_(model, config["max_grad_norm"])
        optimizer.step()
        rtx.sync()
        step += 1
        if out_dir:  # (the loss read only for tests: on XLA a transfer from the device)
            log({"event": "step", "step": step, "epoch": epoch, "position": position,
                 "rows": rows, "loss": float(step_loss.detach().float().cpu())})
        last = step >= config["steps"]
        do_eval = step % config["eval_every"] == 0 or last
        do_ckpt = step % config["checkpoint_every"] == 0 or last
        if do_eval or do_ckpt:
            seconds = time.perf_counter() - interval_start
            # This step's loss (the mean over the data-parallel ranks) and the tokens trained
            # on since the last report (every data-parallel rank's). Summed over every worker,
            # each data-parallel rank's values come tp times (its tensor-parallel peers hold
            # the same loss and tokens).
            summed = torch.stack([step_loss.detach().float().cpu(), torch.tensor(float(tokens))])
            if rtx.world_size() > 1 and not spmd:
                summed = rtx.all_reduce(summed.to(device)).cpu()
            copies = 1 if spmd else rtx.world_size()
            trained = float(summed[1]) / (1 if spmd else tp)
            report = {"step": step, "epoch": epoch, "loss": float(summed[0]) / copies,
                      "grad_norm": float(grad_norm.float().cpu()), "lr": lr_at(step - 1, config),
                      "tokens": trained, "tokens_per_s": trained / seconds, "bf16": bf16}
            if do_eval:
                report["eval_loss"] = evaluate()
            report.update(monitor.metrics(step))  # after the eval: its graphs count here
            if rank == 0:
                log({"event": "report", **report})
            if do_ckpt:
                rtx.save_checkpoint(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "step": step, "epoch": epoch, "position": position,
                     "hf_config": hf_config},
                    report)
            else:
                rtx.report(report)
            tokens, interval_start = 0, time.perf_counter()
        if config["crash_at"] and step == config["crash_at"] and not os.path.exists(crash_marker):
            open(crash_marker, "w").close()
            # Let Ray take the checkpoint of this step before failing: Ray Train V2 registers a
            # report when its controller next polls the workers.
            rtx.flush_reports()
            time.sleep(2.5 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")))
            raise RuntimeError(f"finetune_hf: simulated crash after step {step}")
    if out_dir:
        probe = probe_ids(model.config.vocab_size)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=to_device(probe), use_cache=False).logits.float().cpu()
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, "probe_logits.pt"))


def probe_ids(vocab: int):
    """A fixed batch of token ids (4 x 16) to compare the trained model with its export."""
    import torch

    return (torch.arange(64).reshape(4, 16) * 7 + 3) % vocab


# -------------------------------------------------------------------------------------- driver


def torch_config(name: str, device: str, devices: int | None = None,
                 compile_cache: str | None = None, tp: int = 1):
    """The config object: the only thing that differs between backends. ``compile_cache`` is
    each config's own: ``NEURON_COMPILE_CACHE_URL`` (xla on Neuron: a path or s3:// URL),
    torch_xla's persistent cache (xla on TPU: a directory), ``TORCH_NEURONX_NEFF_CACHE_DIR``
    (neuron) or ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` (tpu), shared by every node. ``tp``
    above 1: the layout, ``parallelism={"tp": tp}`` (FSDP over what the groups leave)."""
    from ray_train_xla import TorchNeuronConfig, TorchTPUConfig, TorchXLAConfig

    layout = {"parallelism": {"tp": tp}} if tp > 1 else {}
    if name == "xla":
        if device == "cpu":
            return TorchXLAConfig(device="cpu", spmd=True, cpu_devices_per_worker=devices or 4,
                                  timeout_s=300, **layout)
        return TorchXLAConfig(device=device, spmd=True, compile_cache=compile_cache, **layout)
    if name == "neuron":
        return TorchNeuronConfig(device=device, timeout_s=300, compile_cache=compile_cache, **layout)
    return TorchTPUConfig(device=device, timeout_s=300, compile_cache=compile_cache, **layout)


def scaling_config(name: str, device: str, workers: int, per_worker: int = 1,
                   tpu_topology: str | None = None, accelerator_type: str | None = None):
    """Workers and the accelerators each one asks Ray for."""
    from ray.train import ScalingConfig

    if device == "cpu":
        return ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1})
    if device == "neuron":
        return ScalingConfig(num_workers=workers, resources_per_worker={"neuron_cores": per_worker})
    kwargs = {}
    if tpu_topology:
        kwargs["topology"] = tpu_topology
    if accelerator_type:
        kwargs["accelerator_type"] = accelerator_type
    return ScalingConfig(num_workers=workers, use_tpu=True,
                         resources_per_worker={"TPU": per_worker}, **kwargs)


def build_trainer(config: dict, torch_cfg, scaling, storage_path: str, name: str,
                  examples: list | None = None, max_failures: int = 1, keep: int | None = 2):
    """A TorchTrainer for ``train_loop`` with the tokenized train and eval datasets of
    ``examples`` (dicts of :func:`example_kind`'s schemas or texts; default: the built-in
    corpus)."""
    from ray.data import ExecutionOptions
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop,
        train_loop_config=config,
        torch_config=torch_cfg,
        scaling_config=scaling,
        datasets=make_datasets(examples if examples is not None else builtin_corpus(), config),
        # The same batches in the same order every epoch (per worker, as Ray Data splits them).
        dataset_config=DataConfig(datasets_to_split=["train", "eval"],
                                  execution_options=ExecutionOptions(preserve_order=True)),
        run_config=RunConfig(storage_path=storage_path, name=name,
                             checkpoint_config=CheckpointConfig(num_to_keep=keep),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )


def export_hf(checkpoint, out_dir: str, source: str | None = None, dtype: str | None = None) -> dict:
    """Write a Hugging Face model directory from a sharded checkpoint (a Ray ``Checkpoint``,
    read through its own filesystem: local, S3, GCS), one tensor at a time and only the
    model's tensors; ``from_pretrained(out_dir)`` loads it. The dtype defaults to the
    pretrained model's stored one; ``source`` (the pretrained directory or Hub id) gives the
    config and the tokenizer files."""
    from ray_train_xla.tools.consolidate import consolidate_hf

    return consolidate_hf(checkpoint.path, out_dir, config=model_source(source), dtype=dtype,
                          filesystem=checkpoint.filesystem)


def model_source(model: str | None) -> str | None:
    """``--model``'s config and tokenizer files on this machine: its directory, or a Hub id's
    snapshot in the Hugging Face cache (fetched here, without the weights); None for the random
    model or a directory this machine does not see."""
    if not model:
        return None
    from ray_train_xla.toolkit.pretrained import pretrained_path

    local = pretrained_path(model, weights=False)
    return local if os.path.isdir(local) else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=CONFIGS, default="xla",
                        help="xla: TorchXLAConfig(spmd=True), FSDPv2; neuron: TorchNeuronConfig, "
                        "FSDP2; tpu: TorchTPUConfig, FSDP2 (default xla)")
    parser.add_argument("--device", choices=("cpu", "neuron", "tpu"), default="cpu",
                        help="cpu (default: the CPU twin of the config) or the accelerator")
    parser.add_argument("--workers", type=int, default=None,
                        help="training workers (default 1 for xla on the CPU, 2 otherwise)")
    parser.add_argument("--devices", type=int, default=None,
                        help="virtual XLA CPU devices of the SPMD worker (--config xla --device "
                        "cpu only; default 4)")
    parser.add_argument("--accelerators-per-worker", type=int, default=None, metavar="N",
                        help="NeuronCores (neuron) or TPU chips (tpu) each worker asks Ray for "
                        "(default 1; SPMD: all of a host's, e.g. 4)")
    parser.add_argument("--tpu-topology", default=None, help="TPU slice topology, e.g. 4x4 "
                        "(ScalingConfig(use_tpu=True, topology=...); needed for several workers)")
    parser.add_argument("--accelerator-type", default=None, help="e.g. TPU-V6E "
                        "(ScalingConfig(accelerator_type=...); needed for several workers)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (e.g. auto); default: an embedded local Ray")
    parser.add_argument("--model", default=None,
                        help="a save_pretrained directory every node reads, or a Hugging Face "
                        "Hub id ORG/NAME[@REVISION] (fetched once per node into its Hugging Face "
                        "cache: HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN apply); default: a small "
                        "random Llama and a byte-level tokenizer")
    parser.add_argument("--data", default=None, metavar="FILE",
                        help="a local file the driver reads: FILE.jsonl, one JSON object a line, "
                        '{"prompt": ..., "completion": ...} (loss on the completion) or '
                        '{"messages": [{"role": ..., "content": ...}, ...]} (the chat template; '
                        "loss on the assistant turns); any other file: one text a line (loss on "
                        "every token). Default: a generated corpus")
    parser.add_argument("--corpus-lines", type=int, default=600, metavar="N",
                        help="lines of the generated corpus (without --data; default 600)")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, metavar="N",
                        help="longest row in tokens, a multiple of 8 (longer examples are cut); "
                        "rows are padded to the buckets N/4, N/2, N (rounded up to multiples of "
                        f"8): one XLA graph per bucket (default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--pack", action="store_true",
                        help="pack several examples into each row of --seq-len tokens (labels "
                        "stay per example; attention crosses the examples of a row)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="rows per worker per micro-batch (SPMD: split over its devices)")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"peak learning rate (default {PRETRAINED_LR:g} with --model, for full "
                        f"fine-tuning; {TINY_LR:g} for the built-in random tiny model, which needs "
                        "a large rate to show a falling loss within a few steps)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="linear LR warm-up steps, then a cosine decay (default 5, or a "
                        "quarter of --steps when that is fewer)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1,
                        help="the cosine decay ends at this fraction of --lr (default 0.1)")
    parser.add_argument("--weight-decay", type=float, default=0.1,
                        help="AdamW weight decay of the matrices; none on biases and norm weights "
                        "(parameters of fewer than 2 dimensions; default 0.1)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=10, metavar="N")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="N")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 on neuron/tpu, fp32 on the CPU")
    parser.add_argument("--hsdp", action="store_true",
                        help="HSDP: shards within a node, replicas across nodes "
                        "(get_sharded_mesh('hsdp'); --config neuron or tpu)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor parallelism, the config's parallelism={'tp': N}: "
                        "neuron, tpu: each group of N consecutive workers, inside a node, splits "
                        "every layer by the model's own Hugging Face TP plan and trains on the "
                        "same rows, and FSDP2 shards over the groups (N divides --workers); xla: "
                        "the SPMD mesh's 'model' axis of N devices beside FSDPv2's 'fsdp' (N "
                        "divides the devices). N divides the model's heads, KV heads, MLP width "
                        "and vocabulary (default 1)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp (--config neuron or tpu): the norms and the residual "
                        "stream between the layers split over the sequence within each "
                        "tensor-parallel group")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each decoder layer in the backward pass: less memory, "
                        "about a third more compute")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="the config's compile_cache, a directory every node shares (xla on "
                        "Neuron also takes an s3:// URL); not with --device cpu")
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--crash-at", type=int, default=None, help="fail once after this step")
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "finetune_hf"),
                        help="run storage (shared by every node on a cluster: NFS, s3://, gs://)")
    parser.add_argument("--export", default=None, metavar="DIR",
                        help="Hugging Face model directory to write (default <storage>/<run>/hf)")
    parser.add_argument("--export-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="dtype of the exported model (default: the pretrained model's stored "
                        "dtype; the random model's is float32)")
    parser.add_argument("--no-export", action="store_true", help="do not write the HF model")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse every flag that does not apply, with the reason, instead of ignoring it."""
    devices = {"xla": ("cpu", "neuron", "tpu"), "neuron": ("cpu", "neuron"), "tpu": ("cpu", "tpu")}
    if args.device not in devices[args.config]:
        parser.error(f"--device {args.device} with --config {args.config}: use one of "
                     f"{', '.join(devices[args.config])}")
    if args.devices is not None and not (args.config == "xla" and args.device == "cpu"):
        parser.error("--devices sets the virtual XLA CPU devices of --config xla --device cpu; "
                     "on accelerators each worker gets --accelerators-per-worker, and FSDP2 "
                     "(neuron, tpu) has one device per worker")
    if args.config == "xla" and args.device == "cpu" and args.workers != 1:
        parser.error("--config xla --device cpu runs one SPMD worker (its --devices are the "
                     "mesh; torch_xla's CPU client has no collectives across processes): "
                     "--workers 1")
    if args.device == "cpu" and args.accelerators_per_worker is not None:
        parser.error("--accelerators-per-worker is for --device neuron or tpu")
    if (args.tpu_topology or args.accelerator_type) and args.device != "tpu":
        parser.error("--tpu-topology/--accelerator-type are for --device tpu")
    for flag in ("steps", "workers", "batch_size", "accum", "eval_every", "checkpoint_every",
                 "corpus_lines"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.accelerators_per_worker is not None and args.accelerators_per_worker < 1:
        parser.error("--accelerators-per-worker must be at least 1")
    if args.config == "xla" and args.device == "cpu" and args.batch_size % (args.devices or 4):
        parser.error(f"--batch-size {args.batch_size} is split over the {args.devices or 4} "
                     "devices of the SPMD worker: give a multiple of --devices")
    if args.seq_len < 8 or args.seq_len % 8:
        parser.error(f"--seq-len {args.seq_len}: give a multiple of 8 (the buckets are multiples "
                     "of 8, so that a row splits evenly on XLA devices)")
    if args.lr is not None and args.lr <= 0:
        parser.error("--lr must be positive")
    if not 0 <= args.min_lr_ratio <= 1:
        parser.error("--min-lr-ratio is a fraction of --lr: give 0..1")
    if args.weight_decay < 0:
        parser.error("--weight-decay must be at least 0")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.warmup is None:
        args.warmup = default_warmup(args.steps)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: give 0..{args.steps - 1} (fewer than --steps, so "
                     "the cosine decay has steps)")
    if args.crash_at is not None and not 1 <= args.crash_at < args.steps:
        parser.error(f"--crash-at {args.crash_at}: give a step in 1..{args.steps - 1}")
    if args.crash_at is not None and args.crash_at % args.checkpoint_every:
        parser.error(f"--crash-at {args.crash_at} is not a checkpoint step (a multiple of "
                     f"--checkpoint-every {args.checkpoint_every}): the restart would go back "
                     "to the checkpoint before it")
    check_layout(parser, args)
    if args.hsdp and args.config == "xla":
        parser.error("--hsdp is FSDP2's (get_sharded_mesh('hsdp'), --config neuron or tpu): "
                     "FSDPv2 under TorchXLAConfig(spmd=True) shards over the one 'fsdp' axis of "
                     "its SPMD mesh, with no replica axis")
    if args.compile_cache is not None:
        if args.device == "cpu":
            parser.error("--compile-cache is for --device neuron or tpu: no CPU run keeps a "
                         "compile cache (torch_xla's CPU client cannot load cached executables; "
                         "the native configs run eager on the CPU)")
        if "://" in args.compile_cache and not (args.config == "xla" and args.device == "neuron"):
            parser.error(f"--compile-cache {args.compile_cache}: a URL is for --config xla "
                         "--device neuron (NEURON_COMPILE_CACHE_URL); give a directory every "
                         "node shares")
    if args.data is not None and args.corpus_lines != parser.get_default("corpus_lines"):
        parser.error("--corpus-lines sizes the generated corpus: not with --data")
    if args.data is not None and "://" in args.data:
        parser.error(f"--data {args.data}: the driver reads the file, give a local path")
    if args.export and args.no_export:
        parser.error("--export and --no-export together")
    if not (args.export or args.no_export) and "://" in args.storage_path:
        parser.error(f"--storage-path {args.storage_path} is remote: give --export DIR (a local "
                     "directory for the Hugging Face model) or --no-export")


def check_layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tp and --sequence-parallel against the config, the workers and the buckets."""
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: give 1 (no tensor parallelism) or more")
    if args.sequence_parallel and args.tp == 1:
        parser.error("--sequence-parallel splits the sequence over each tensor-parallel group: "
                     "give --tp 2 or more")
    if args.tp == 1:
        return
    if args.config == "xla":  # TP x FSDPv2 over the SPMD mesh's devices, one process a host
        if args.sequence_parallel:
            parser.error("--sequence-parallel is a DTensor style (--config neuron or tpu): under "
                         "torch_xla SPMD, XLA's sharding propagation places the activations; "
                         "leave it off")
        devices = args.devices or 4
        if args.device == "cpu" and devices % args.tp:
            parser.error(f"--tp {args.tp} does not divide the SPMD worker's --devices {devices}: "
                         f"give --tp among {[d for d in range(1, devices + 1) if devices % d == 0]}")
        if args.hsdp:
            parser.error("--hsdp is FSDP2's (--config neuron or tpu)")
        return
    if args.workers % args.tp:
        fitting = [d for d in range(1, args.workers + 1) if args.workers % d == 0]
        parser.error(f"--tp {args.tp} does not divide --workers {args.workers}: the workers "
                     f"form groups of --tp; give --tp among {fitting}, or --workers a multiple "
                     f"of {args.tp}")
    if args.hsdp:
        parser.error("--hsdp with --tp: get_sharded_mesh('hsdp') has no tensor-parallel "
                     "dimension; give one of them (replicas with TP are the config's "
                     "parallelism={'tp': N, 'dp_replicate': R} in a training function of your own)")
    if args.sequence_parallel:
        odd = [b for b in buckets_for(args.seq_len) if b % args.tp]
        if odd:
            parser.error(f"--sequence-parallel splits each row's {', '.join(map(str, odd))} "
                         f"tokens (the buckets of --seq-len {args.seq_len}) into --tp {args.tp} "
                         "equal slices: give a --tp that divides 8 (the buckets are multiples of "
                         "8)")


def check_model_layout(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       config: dict) -> None:
    """--tp against the model's sizes (its config.json, or the built-in model's): each worker
    of a tensor-parallel group holds whole heads and equal parts of the MLP and vocabulary."""
    if args.tp == 1:
        return
    from ray_train_xla.errors import XLAConfigError
    from ray_train_xla.planning.layout import Layout

    if config["model"] is None:
        sizes = {"heads": config["heads"], "kv_heads": config["heads"], "mlp": config["ff"],
                 "vocab": BYTE_VOCAB}
        owner = "the built-in model"
    else:
        from ray_train_xla.planning.hub import hub_id
        from ray_train_xla.planning.memory import load_model_config

        if hub_id(config["model"]) is None and not os.path.exists(config["model"]):
            return  # a directory only the cluster's workers see: they check it
        try:
            hf = load_model_config(config["model"])
        except XLAConfigError as e:
            parser.error(f"--model {config['model']}: {e.for_plan()}")
        hf = hf.get("text_config") or hf
        heads = hf.get("num_attention_heads")
        sizes = {"heads": heads, "kv_heads": hf.get("num_key_value_heads") or heads,
                 "mlp": hf.get("intermediate_size"), "vocab": hf.get("vocab_size")}
        if not all(isinstance(v, int) and v > 0 for v in sizes.values()):
            return  # not a decoder of the usual shape: the workers check what their plan splits
        owner = f"--model {config['model']}"
    try:
        Layout(tp=args.tp).check_model(owner=owner, **sizes)  # (the model's sizes: tp's alone)
    except XLAConfigError as e:
        parser.error(e.for_plan())


def check_examples(parser: argparse.ArgumentParser, args: argparse.Namespace, examples: list) -> None:
    """The data against the run: enough rows for a batch on every worker in both splits, and,
    for chat data with ``--model``, a tokenizer with a chat template whose turns can be told
    apart (the first chat is tokenized here, so a bad template fails before Ray starts)."""
    try:
        train, held_out = split_examples(examples)
    except ValueError as e:
        parser.error(str(e))
    if len(train) // args.workers < args.batch_size or len(held_out) // args.workers < args.batch_size:
        parser.error(f"{len(examples)} examples ({len(held_out)} held out for eval) give some of "
                     f"the {args.workers} workers fewer than --batch-size {args.batch_size} rows"
                     + ("" if args.data else ": give a larger --corpus-lines"))
    chat = next((e for e in examples if "messages" in e), None)
    if chat is not None and args.model is not None:
        try:
            tok = hf_tokenizer(args.model)
        except Exception as e:  # any loading failure, reported against the flag
            parser.error(f"--model {args.model}: cannot load its tokenizer for the chat data: {e}")
        if not getattr(tok, "chat_template", None):
            parser.error(f"--data {args.data} holds chats (messages), but the tokenizer of --model "
                         f"{args.model} has no chat_template to render them: give prompt/"
                         "completion data, or a chat model's tokenizer")
        try:
            encode_example(chat, args.model, args.seq_len)
        except ValueError as e:
            parser.error(f"--data {args.data}: {e}")


def validate(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict, list]:
    """Every check of a run up to, not including, ``ray.init``: the flags, the config object's
    own validation, the data (read here: the driver hands it to Ray Data) and, for chat data with
    ``--model``, its tokenizer. Touches neither Ray nor remote storage, but for a Hub id's
    config and tokenizer files, fetched into the Hugging Face cache. Returns (args, the
    training function's config, the examples); an error exits as argparse does (status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = 1 if (args.config == "xla" and args.device == "cpu") else 2
    check_args(parser, args)
    if not args.no_export:
        try:  # fail now, not after training
            from ray_train_xla.tools.consolidate import consolidate_hf  # noqa: F401
        except ImportError:
            parser.error("this ray_train_xla has no tools.consolidate.consolidate_hf to write "
                         "the Hugging Face model: pass --no-export")
    try:
        torch_config(args.config, args.device, args.devices, args.compile_cache, args.tp)
    except ValueError as e:  # XLAConfigError names the option and what it takes
        parser.error(str(e))
    if args.model and "://" in args.model:
        parser.error(f"--model {args.model}: give a directory every node reads (a shared "
                     "filesystem): Ray Data's tokenizing tasks read the tokenizer from it too; "
                     "or a Hugging Face Hub id")
    from ray_train_xla.planning.hub import hub_id

    if args.model and hub_id(args.model):
        try:  # the id, its access and its config, before Ray starts
            model_source(args.model)
        except (OSError, ImportError) as e:
            parser.error(f"--model {args.model}: {e}")
    # The model directory is checked where the driver sees it: always for a local run; on a
    # cluster (--address) a path only the workers see is checked by them.
    elif args.model and "://" not in args.model and (os.path.exists(args.model) or not args.address):
        if not os.path.isdir(args.model):
            parser.error(f"--model {args.model}: no such directory (give a local directory "
                         "save_pretrained wrote, or a Hugging Face Hub id ORG/NAME)")
        from ray_train_xla.toolkit.pretrained import safetensors_files

        try:
            safetensors_files(args.model)
        except (OSError, ValueError) as e:  # .bin weights, no weights, a broken index
            parser.error(f"--model {args.model}: {e}")
    if args.data is not None and not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: no such file")
    try:
        examples = read_examples(args.data, args.corpus_lines)
    except ValueError as e:
        parser.error(str(e))
    check_examples(parser, args, examples)
    config = ft_config(model=args.model, seq_len=args.seq_len, pack=args.pack, steps=args.steps,
                       batch_size=args.batch_size, accum=args.accum, lr=args.lr,
                       warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                       weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
                       eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                       precision=args.precision, hsdp=args.hsdp,
                       activation_checkpointing=args.activation_checkpointing,
                       sequence_parallel=args.sequence_parallel, crash_at=args.crash_at)
    check_model_layout(parser, args, config)
    return args, config, examples


def main(argv: list[str] | None = None) -> None:
    args, config, examples = validate(argv)
    config["marker_dir"] = tempfile.mkdtemp(prefix="finetune_hf-")
    name = time.strftime(f"finetune_hf-{args.config}-%Y%m%d-%H%M%S")
    import ray

    if args.address:
        ray.init(address=args.address)
    else:
        # Logical CPUs for the workers and for Ray Data's tokenizing tasks, even on a small machine.
        ray.init(address="local", include_dashboard=False,
                 num_cpus=max(os.cpu_count() or 1, args.workers + 2))
    try:
        trainer = build_trainer(
            config, torch_config(args.config, args.device, args.devices, args.compile_cache,
                                 args.tp),
            scaling_config(args.config, args.device, args.workers,
                           args.accelerators_per_worker or 1, args.tpu_topology,
                           args.accelerator_type),
            args.storage_path, name, examples, max_failures=args.max_failures)
        result = trainer.fit()
    finally:
        ray.shutdown()
    m = result.metrics or {}
    print(f"step {m.get('step')}: loss {m.get('loss'):.4f}, eval_loss {m.get('eval_loss'):.4f}, "
          f"{m.get('tokens_per_s', 0):.0f} tokens/s, {m.get('xla/compiles')} graphs compiled "
          f"({m.get('xla/compiles_after_warmup')} after warm-up); checkpoint {result.checkpoint}")
    if not args.no_export:
        out = args.export or os.path.join(args.storage_path, name, "hf")
        export_hf(result.checkpoint, out, source=args.model, dtype=args.export_dtype)
        print(f"Hugging Face model written to {out}: AutoModelForCausalLM.from_pretrained({out!r})")


if __name__ == "__main__":
    main()
