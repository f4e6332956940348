"""examples/finetune_hf.py without Ray: every command line its docstring and the docs show passes
the script's own validation (``validate``, which stops short of ``ray.init``), and the pieces a
run is made of do what the docs say: completion-only and assistant-only labels, the refusal of
a bad JSON line with its number, the cosine schedule, the weight decay groups."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
import shlex

import pytest

pytestmark = pytest.mark.native  # `make test-native` runs it again on torch 2.13

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "examples/finetune_hf.py"


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("finetune_hf_args_under_test",
                                                  os.path.join(ROOT, SCRIPT))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_lines(text: str) -> list[str]:
    """Each ``python examples/finetune_hf.py ...`` of ``text``, backslash-continued lines joined
    and a trailing ``# comment`` dropped."""
    joined = re.sub(r"\\\s*\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        at = line.find(f"python {SCRIPT}")
        if at >= 0:
            out.append(line[at:].split(" #")[0].strip())
    return out


def documented_lines(ft) -> list[tuple[str, str]]:
    sources = [("the module docstring", ft.__doc__)]
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]:
        with open(path, encoding="utf-8") as f:
            sources.append((os.path.relpath(path, ROOT), f.read()))
    return [(where, line) for where, text in sources for line in command_lines(text)]


def test_every_documented_command_line_passes_validation(ft, capsys):
    lines = documented_lines(ft)
    assert len([w for w, _ in lines if w == "the module docstring"]) >= 5, lines
    for where, line in lines:
        argv = shlex.split(line)[2:]
        try:
            args, config, examples = ft.validate(argv)
        except SystemExit:
            pytest.fail(f"{where}: {line}\n{capsys.readouterr().err}")
        assert config["buckets"][-1] == args.seq_len and examples, line


def test_validation_refuses_what_cannot_run(ft, tmp_path, capsys):
    def refused(*argv) -> str:
        with pytest.raises(SystemExit):
            ft.validate(list(argv))
        return capsys.readouterr().err

    assert "--hsdp is FSDP2's" in refused("--config", "xla", "--hsdp")
    assert "--compile-cache is for --device neuron or tpu" in refused(
        "--config", "neuron", "--compile-cache", str(tmp_path))
    assert "multiple of 8" in refused("--seq-len", "100")
    assert "fewer than --batch-size" in refused("--config", "neuron", "--device", "neuron",
                                                "--workers", "32", "--no-export")
    assert "no such file" in refused("--data", str(tmp_path / "missing.jsonl"))


def test_the_default_warmup_fits_every_run_length(ft, capsys):
    """Without --warmup, every --steps from 1 is valid: the warm-up is 5 steps, or a quarter of
    the run when that is fewer; a --warmup the user gives that does not fit is refused."""
    for steps, warmup in ((1, 0), (2, 0), (3, 0), (4, 1), (12, 3), (20, 5), (40, 5)):
        args, config, _ = ft.validate(["--steps", str(steps)])
        assert (args.warmup, config["warmup"]) == (warmup, warmup), steps
        assert 0 < ft.lr_at(steps - 1, config) <= config["lr"]
    assert ft.ft_config(steps=2)["warmup"] == 0
    with pytest.raises(SystemExit):
        ft.validate(["--steps", "3", "--warmup", "3"])
    assert "--warmup 3: give 0..2" in capsys.readouterr().err


def test_lr_defaults_to_full_fine_tuning_with_a_model_and_larger_for_the_tiny_one(ft):
    assert ft.validate(["--no-export"])[1]["lr"] == ft.TINY_LR == 3e-3
    assert ft.ft_config(model="/some/llama")["lr"] == ft.PRETRAINED_LR == 2e-5
    assert ft.validate(["--no-export", "--lr", "1e-4"])[1]["lr"] == 1e-4


def test_seq_len_gives_the_buckets_and_the_config_keys_for_the_model(ft):
    args, config, _ = ft.validate(["--config", "neuron", "--seq-len", "256", "--hsdp",
                                   "--activation-checkpointing", "--no-export"])
    assert config["buckets"] == [64, 128, 256] and config["seq_len"] == 256
    assert config["hsdp"] is True and config["activation_checkpointing"] is True
    assert ft.buckets_for(40) == [16, 24, 40]
    assert ft.ft_config(buckets=[128, 64])["seq_len"] == 128


def byte_text(ft, ids) -> str:
    return bytes(t - ft.BYTE0 for t in ids if t >= ft.BYTE0).decode()


def loss_ids(ids, labels) -> list[int]:
    return [t for t, label in zip(ids, labels) if label != -100]


def tokenized_row(ft, example: dict, model=None, buckets=(32, 64, 128)):
    batch = ft.tokenize_batch({"example": [json.dumps(example)], "index": [7]}, model, list(buckets))
    assert batch["index"].tolist() == [7]
    return batch["input_ids"][0].tolist(), batch["labels"][0].tolist()


def test_prompt_completion_rows_carry_loss_on_the_completion_only(ft):
    ids, labels = tokenized_row(ft, {"prompt": "Q: 2+2?\nA:", "completion": " 4"})
    assert byte_text(ft, ids) == "Q: 2+2?\nA: 4"
    assert byte_text(ft, loss_ids(ids, labels)) == " 4"
    assert loss_ids(ids, labels)[-1] == ft.EOS  # it learns to stop
    # Prompt and padding: -100, the completion: its own ids.
    n = len(" 4") + 1
    start = labels.index(next(label for label in labels if label != -100))
    assert labels[:start] == [-100] * start
    assert labels[start:start + n] == ids[start:start + n]
    assert set(labels[start + n:]) == {-100}


def test_chat_rows_with_the_byte_tokenizer_carry_loss_on_assistant_content_only(ft):
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello."},
                         {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Bye!"}]}
    ids, labels = tokenized_row(ft, chat)
    assert byte_text(ft, ids) == ("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n"
                                  "<|user|>\nBye\n<|assistant|>\nBye!\n")
    carried = loss_ids(ids, labels)
    assert byte_text(ft, carried) == "Hello.\nBye!\n" and carried[-1] == ft.EOS
    assert ft.BOS not in carried


def test_packed_rows_keep_each_examples_labels(ft):
    examples = [{"prompt": "ab", "completion": "cd"}, {"text": "xyz"}, {"prompt": "p", "completion": "q"}]
    batch = ft.tokenize_batch({"example": [json.dumps(e) for e in examples], "index": [0, 1, 2]},
                              None, [8, 16, 32], pack=True)
    assert batch["input_ids"].shape == (1, 32) and batch["index"].tolist() == [-1]
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    # Each example's first token (its begin token) carries no loss: it is not predicted from
    # the example before it.
    assert byte_text(ft, loss_ids(ids, labels)) == "cdxyzq"


def test_a_bad_jsonl_line_is_refused_with_its_number(ft, tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"})
    path.write_text("\n".join([good, "", good, json.dumps({"question": "a", "answer": "b"}), good]))
    with pytest.raises(ValueError, match=r"line 4: .*'answer', 'question'"):
        ft.read_examples(str(path))
    with pytest.raises(SystemExit):
        ft.validate(["--data", str(path), "--no-export"])
    assert "line 4" in capsys.readouterr().err
    path.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        ft.read_examples(str(path))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "no reply"}]}) + "\n")
    with pytest.raises(ValueError, match='line 1: no "assistant" message'):
        ft.read_examples(str(path))


def test_a_valid_chat_file_passes_validation_with_the_byte_tokenizer(ft, tmp_path):
    path = tmp_path / "chat.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path.write_text("\n".join(json.dumps(chat) for _ in range(40)) + "\n")
    args, config, examples = ft.validate(["--config", "neuron", "--data", str(path),
                                          "--batch-size", "2", "--no-export"])
    assert len(examples) == 40 and examples[0] == chat


def test_cosine_schedule_peaks_at_the_end_of_warmup_and_ends_at_the_floor(ft):
    config = ft.ft_config(lr=1e-3, warmup=4, steps=20, min_lr_ratio=0.1)
    assert ft.lr_at(0, config) == pytest.approx(1e-3 / 4)
    assert ft.lr_at(3, config) == pytest.approx(1e-3)  # the last warm-up step: the peak
    assert ft.lr_at(19, config) == pytest.approx(1e-4)  # the last step: min_lr_ratio * lr
    middle = 4 + (20 - 4) // 2 - 1  # half way through the decay
    assert ft.lr_at(middle, config) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    values = [ft.lr_at(s, config) for s in range(20)]
    assert all(a >= b for a, b in zip(values[3:], values[4:]))  # decreasing after the peak
    assert ft.lr_at(9, ft.ft_config(lr=1e-3, warmup=0, steps=10, min_lr_ratio=0.0)) == 0.0


def test_weight_decay_groups_leave_out_biases_and_norm_weights(ft):
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4),
                                torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    decay, no_decay = ft.param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[1].weight),
                                                id(model[3].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[1].bias), id(model[2].weight),
                                                   id(model[2].bias)}
    torch.optim.AdamW([decay, no_decay], lr=1e-3)  # the groups AdamW takes


def test_lm_loss_is_zero_not_nan_for_a_batch_without_loss_tokens(ft):
    import torch

    class Logits(torch.nn.Module):
        def forward(self, input_ids, use_cache=True):
            assert use_cache is False
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 5, requires_grad=True)})

    ids = torch.ones(2, 4, dtype=torch.long)
    assert float(ft.lm_loss(Logits(), ids, torch.full_like(ids, -100)).detach()) == 0.0
    assert float(ft.lm_loss(Logits(), ids, ids).detach()) == pytest.approx(math.log(5))


def test_chat_spans_through_a_chat_template(ft, tmp_path):
    """A Hugging Face tokenizer with a chat template: the assistant turns (with their end-of-turn
    marker) carry loss, nothing else; one without a template is refused before Ray starts."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "<s>", "</s>", "<|end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["<|user|>\nhello there\n<|assistant|>\ngeneral kenobi"] * 20, trainer)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", chat_template=template)
    fast.save_pretrained(tmp_path / "chat-tok")
    chat = {"messages": [{"role": "user", "content": "hello there"},
                         {"role": "assistant", "content": "general kenobi"},
                         {"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "there"}]}
    ids, labels = ft.encode_example(chat, str(tmp_path / "chat-tok"), 128)
    assert fast.decode(ids) == fast.apply_chat_template(chat["messages"], tokenize=False)
    assert fast.decode(loss_ids(ids, labels)) == "general kenobi<|end|>\nthere<|end|>\n"
    # Prompt/completion: the completion and the end token.
    ids, labels = ft.encode_example({"prompt": "hello", "completion": " there"},
                                    str(tmp_path / "chat-tok"), 128)
    assert fast.decode(loss_ids(ids, labels)) == " there</s>"

    fast.chat_template = None
    fast.save_pretrained(tmp_path / "plain-tok")
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(chat) for _ in range(40)) + "\n")
    with pytest.raises(SystemExit):
        ft.validate(["--config", "neuron", "--data", str(data), "--batch-size", "2",
                     "--model", str(tmp_path / "plain-tok"), "--no-export"])


def test_a_hugging_face_hub_id_is_accepted_and_checked_before_ray(ft, tmp_path, monkeypatch,
                                                                   capsys):
    """``--model ORG/NAME`` that is no path: the driver fetches the id's config (offline here,
    from a Hugging Face cache laid out by hand) and keeps the id for the workers; an id the
    cache does not hold offline is refused naming the cache and the fix."""
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for var, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(tmp_path / "hub"))):
        monkeypatch.setenv(var, str(int(value)) if value is True else value)
        monkeypatch.setattr(constants, var, value)  # huggingface_hub read them at its import
    monkeypatch.chdir(tmp_path)
    args, config, _ = ft.validate(["--config", "neuron", "--model", "org/tiny", "--no-export"])
    assert args.model == config["model"] == "org/tiny" and config["lr"] == ft.PRETRAINED_LR
    assert ft.model_source("org/tiny") == str(repo / "snapshots" / commit)  # for the export
    with pytest.raises(SystemExit):
        ft.validate(["--config", "neuron", "--model", "org/unknown", "--no-export"])
    err = capsys.readouterr().err
    assert "--model org/unknown" in err and "HF_HUB_OFFLINE=1" in err and str(tmp_path / "hub") in err
    with pytest.raises(SystemExit):
        ft.validate(["--config", "neuron", "--model", "no-such-dir", "--no-export"])
    assert "or a Hugging Face Hub id" in capsys.readouterr().err


def test_tp_makes_the_layout_of_the_native_configs_and_refuses_what_cannot_split(ft, tmp_path,
                                                                                  capsys):
    """``--tp N`` is the config's ``parallelism={"tp": N}`` on neuron and tpu (sequence
    parallelism the training function's); what cannot be laid out is refused before Ray starts,
    naming the flag and the sizes that fit."""
    args, config, _ = ft.validate(["--config", "neuron", "--workers", "4", "--tp", "2",
                                   "--sequence-parallel", "--no-export"])
    assert args.tp == 2 and config["sequence_parallel"] is True
    for name in ("xla", "neuron", "tpu"):
        assert ft.torch_config(name, "cpu", tp=2).parallelism == {"tp": 2}
        assert ft.torch_config(name, "cpu").parallelism is None
    assert ft.validate(["--no-export"])[1]["sequence_parallel"] is False
    args, config, _ = ft.validate(["--config", "xla", "--tp", "2", "--no-export"])  # TP x FSDPv2
    assert args.tp == 2 and config["sequence_parallel"] is False

    def refused(*argv) -> str:
        with pytest.raises(SystemExit):
            ft.validate([*argv, "--no-export"])
        return capsys.readouterr().err

    assert "--sequence-parallel is a DTensor style (--config neuron or tpu)" in refused(
        "--config", "xla", "--tp", "2", "--sequence-parallel")
    assert "--tp 3 does not divide the SPMD worker's --devices 4: give --tp among [1, 2, 4]" \
        in refused("--config", "xla", "--tp", "3")
    assert "the built-in model: --tp 8 does not divide the model's 4 attention heads" in refused(
        "--config", "xla", "--devices", "8", "--batch-size", "8", "--tp", "8")
    assert "--tp 3 does not divide --workers 4: the workers form groups of --tp; give --tp " \
           "among [1, 2, 4]" in refused("--config", "neuron", "--workers", "4", "--tp", "3")
    assert "--tp 0: give 1" in refused("--config", "neuron", "--tp", "0")
    assert "--hsdp with --tp" in refused("--config", "tpu", "--tp", "2", "--hsdp")
    assert "give --tp 2 or more" in refused("--config", "neuron", "--sequence-parallel")
    assert "into --tp 3 equal slices" in refused("--config", "neuron", "--workers", "6", "--tp",
                                                "3", "--sequence-parallel",
                                                "--corpus-lines", "2000")
    # The model's sizes: the built-in model's 4 heads, a --model directory's config.json.
    err = refused("--config", "neuron", "--workers", "8", "--tp", "8", "--corpus-lines", "2000")
    assert "the built-in model: --tp 8 does not divide the model's 4 attention heads" in err
    assert "Use --tp among [1, 2, 4]" in err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": 1024, "hidden_size": 64}))
    (model / "model.safetensors").write_bytes(b"")
    err = refused("--config", "neuron", "--workers", "4", "--tp", "4", "--model", str(model))
    assert f"--model {model}: --tp 4 does not divide the model's 2 key/value heads" in err
    assert "Use --tp among [1, 2]" in err
    args, config, _ = ft.validate(["--config", "neuron", "--workers", "4", "--tp", "2",
                                   "--model", str(model), "--no-export"])
    assert config["model"] == str(model)
