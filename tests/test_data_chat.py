"""Fine-tuning examples: chat and completion rows, their loss masks, packing, truncation, caching, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hf_support import FIXTURES, fixture, goldens

from nnx_cli import hf
from nnx_cli.config import DataConfig
from nnx_cli.data import examples
from nnx_cli.errors import UserError
from nnx_cli.hf import chat

QA = [
    ("Who keeps the bridge?", "The old guard."),
    ("When does the fiddler come?", "In spring, when the river is high."),
    ("What is the capital of the valley?", "The mill town."),
]


def chats(n: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        q, a = QA[i % len(QA)]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                    {"role": "assistant", "content": a}]  # fmt: skip
        if i % 2:  # a second exchange in every other conversation
            q2, a2 = QA[(i + 1) % len(QA)]
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(tmp_path: Path, source: Path, **options) -> DataConfig:
    defaults = {"format": "chat", "tokenizer": "pretrained", "seq_len": 255, "eval_split": None}
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **{**defaults, **options})


def load(cfg: DataConfig, family: str = "qwen2"):
    return examples.load_example_splits(cfg, seed=0, pretrained=str(fixture(family)))


def segments_of(rows: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every example in the rows, as (tokens, targets), in order."""
    out = []
    for r in range(len(rows["tokens"])):
        for s in range(1, int(rows["segments"][r].max()) + 1):
            where = rows["segments"][r] == s
            out.append((rows["tokens"][r][where], rows["targets"][r][where]))
    return out


@pytest.mark.parametrize(
    "family, end, last",
    [("qwen2", "<|im_end|>", "<|im_end|>"), ("llama", "<|eot_id|>", "<|eot_id|>"),
     ("phi3", "<|end|>", "<|end|> \n")],  # the conversation's end too: its "\n" piece and its eos, decoded as nothing
)  # fmt: skip
def test_chat_targets_are_exactly_the_assistant_turns_through_their_end_token(tmp_path, family, end, last):
    """Phi-3's conversations of two exchanges were refused: the eos its template writes after the last turn made
    the first turn render differently alone than inside the conversation."""
    source = write_jsonl(tmp_path / "chats.jsonl", chats(4))
    split = load(config(tmp_path, source, packing=False), family).train
    tokenizer = hf.pretrained_tokenizer(str(fixture(family)))
    for (tokens, targets), row in zip(segments_of(split.stored()), chats(4)):
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        runs, current = [], []
        for token, target in zip(tokens.tolist(), targets.tolist()):
            if target:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        assert [tokenizer.decode(run) for run in runs] == [a + end for a in answers[:-1]] + [answers[-1] + last]


# Qwen3's way with reasoning, written small: a reply after the last question gets a <think> block, one before it
# does not, so a turn renders differently as the conversation's last than inside it.
THINKING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{{ m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_dropping_earlier_turns_reasoning_marks_them_as_the_conversation_renders_them(tmp_path):
    """Such templates (Qwen3's) were refused for conversations of more than one exchange; the earlier turns train
    as the whole conversation shows them (the text and <|im_end|>), the last with its <think> block."""
    source = write_jsonl(tmp_path / "chats.jsonl", chats(4))
    split = load(config(tmp_path, source, packing=False, chat_template=THINKING)).train
    tokenizer = hf.pretrained_tokenizer(str(fixture("qwen2")))
    for (tokens, targets), row in zip(segments_of(split.stored()), chats(4)):
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        text = tokenizer.decode(tokens.tolist())
        assert text == chat.render(THINKING, row["messages"], add_generation_prompt=False)
        marked = tokenizer.decode([t for t, target in zip(tokens.tolist(), targets.tolist()) if target])
        assert (
            marked
            == "".join(a + "<|im_end|>" for a in answers[:-1]) + f"<think>\n\n</think>\n\n{answers[-1]}<|im_end|>"
        )


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_chat_rows_tokenize_as_transformers_renders_and_tokenizes_the_conversation(family):
    record, gold = json.loads((FIXTURES / f"{family}.json").read_text()), goldens(family)
    tokenizer = hf.pretrained_tokenizer(str(fixture(family)))
    text, _ = chat.assistant_spans(tokenizer.chat_template, record["conversation"], chat.special_tokens(tokenizer))
    ids, targets = examples.encode_chat(tokenizer, tokenizer.chat_template, record["conversation"])
    assert text == record["chat_full_text"] and ids == gold["chat_full_ids"].tolist()
    first_answer = len(gold["chat_prompt_ids"])  # transformers' rendering up to the first reply's prompt
    assert not any(targets[:first_answer]) and targets[first_answer] == 1


def test_a_token_holding_the_end_of_the_prompt_and_the_start_of_the_reply_is_a_target(tmp_path):
    from hf_support import tokenizer_json

    from nnx_cli.data.tokenizers import load_tokenizer

    tokenizer_json(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    messages = [{"role": "user", "content": "a king"}, {"role": "assistant", "content": "quick fox"}]
    ids, targets = examples.encode_chat(tokenizer, template, messages)
    first = targets.index(1)
    assert tokenizer.decode(ids[first : first + 1]) == " qu"  # the generation prompt's space, merged into it
    assert tokenizer.decode(ids[:first]).endswith("assistant:")
    assert ids[len(targets) - 1 - targets[::-1].index(1)] == tokenizer.eod_id  # through <|endoftext|>
    assert tokenizer.decode([t for t, flag in zip(ids, targets) if flag]) == " quick fox"


def test_a_bytes_tokenizer_marks_the_bytes_of_each_reply(tmp_path):
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    source = write_jsonl(tmp_path / "chats.jsonl", chats(2))
    cfg = config(tmp_path, source, tokenizer="bytes", chat_template=template, packing=False)
    rows = examples.load_example_splits(cfg, seed=0).train.stored()
    answers = [bytes(t[g == 1].tolist()).decode() for t, g in segments_of(rows)]
    assert answers == ["The old guard.</assistant>",
                       "In spring, when the river is high.</assistant>The mill town.</assistant>"]  # fmt: skip


def test_completion_targets_are_the_completion_and_the_end_token(tmp_path):
    source = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": q + " ", "completion": a} for q, a in QA])
    split = load(config(tmp_path, source, format="completion", packing=False), "llama").train
    tokenizer = hf.pretrained_tokenizer(str(fixture("llama")))
    for (tokens, targets), (q, a) in zip(segments_of(split.stored()), QA):
        assert tokens[0] == tokenizer.token_id("<|begin_of_text|>")  # the prompt as the tokenizer encodes text
        answer = tokens[targets == 1].tolist()
        assert tokenizer.decode(answer[:-1]) == a and answer[-1] == tokenizer.token_id("<|end_of_text|>")
        assert tokenizer.decode(tokens[targets == 0].tolist()) == "<|begin_of_text|>" + q + " "


def test_train_on_prompt_targets_every_token_but_the_first(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(3))
    split = load(config(tmp_path, source, packing=False, train_on_prompt=True)).train
    for _, targets in segments_of(split.stored()):
        assert targets[0] == 0 and targets[1:].all()


def test_packing_keeps_every_example_whole_once_with_its_own_positions(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(12))
    packed = load(config(tmp_path, source)).train.stored()
    alone = load(config(tmp_path, source, packing=False)).train.stored()
    assert len(packed["tokens"]) < len(alone["tokens"])  # several examples share a row
    pairs = lambda rows: [(t.tolist(), g.tolist()) for t, g in segments_of(rows)]  # noqa: E731
    assert pairs(packed) == pairs(alone)  # the same examples, whole, in order
    for r in range(len(packed["tokens"])):
        segments, positions = packed["segments"][r], packed["positions"][r]
        for s in range(1, segments.max() + 1):
            assert positions[segments == s].tolist() == list(range(int((segments == s).sum())))
        assert not packed["tokens"][r][segments == 0].any() and not packed["targets"][r][segments == 0].any()


def test_a_packed_example_has_the_loss_it_has_alone(tmp_path):
    import jax
    import jax.numpy as jnp

    import nnx
    from nnx_cli.models.transformer_lm import TransformerLM

    source = write_jsonl(tmp_path / "chats.jsonl", chats(6))
    packed, alone = load(config(tmp_path, source)).train, load(config(tmp_path, source, packing=False)).train
    model = TransformerLM((255,), 320, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, positions="rope",
                          norm="rmsnorm", mlp="swiglu", bias=False, dropout=0.0, scan_layers=False,
                          ctx=nnx.context(0))  # fmt: skip
    pure = model.partition()

    @jax.jit
    def sums(pure, rows):
        metrics = pure.call.metrics(rows, nnx.context(flags={"deterministic": True}))
        return jnp.sum(metrics["loss"] * metrics["weight"]), jnp.sum(metrics["weight"])

    count = len(alone)

    def total(split):  # padded with empty rows to one batch shape: one compilation
        stored = {k: np.concatenate([v, np.zeros((count - len(v), *v.shape[1:]), v.dtype)]) for k, v in
                  split.stored().items()}  # fmt: skip
        return tuple(map(float, sums(pure, split.prepare({k: jnp.asarray(v) for k, v in stored.items()}))))

    (loss_packed, count_packed), (loss_alone, count_alone) = total(packed), total(alone)
    assert count_packed == count_alone > 0
    assert loss_packed == pytest.approx(loss_alone, rel=1e-5)


def test_long_examples_are_cut_counted_and_said_once(tmp_path, capsys):
    long = [{"prompt": "word " * 80, "completion": "yes"}, {"prompt": "short ", "completion": "no"}]
    source = write_jsonl(tmp_path / "pairs.jsonl", long)
    split = load(config(tmp_path, source, format="completion", max_len=40, packing=False)).train
    assert split.stored()["segments"][0].sum() == 40
    err = capsys.readouterr().err
    assert "1 of 2 examples are longer than 40 tokens and were cut there" in err
    assert "1 of 2 examples have no target token" in err
    load(config(tmp_path, source, format="completion", max_len=40, packing=False))
    assert capsys.readouterr().err == ""  # said once, not again for the cached rows


def test_rows_are_built_once_and_rebuilt_when_the_template_changes(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(4))
    load(config(tmp_path, source))

    def entries() -> list[str]:
        return sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith("examples-") and p.is_dir())

    first = entries()
    load(config(tmp_path, source))
    assert entries() == first  # the cached rows are read
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
    load(config(tmp_path, source, chat_template=template))
    assert len(entries()) == len(first) + 1


def test_a_template_file_overrides_the_model_directorys(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    source = write_jsonl(tmp_path / "chats.jsonl", chats(1))
    tokens, targets = segments_of(load(config(tmp_path, source, chat_template=str(template))).train.stored())[0]
    tokenizer = hf.pretrained_tokenizer(str(fixture("qwen2")))
    assert tokenizer.decode(tokens.tolist()).startswith("system: Be brief.<|im_end|>user: ")
    assert tokenizer.decode(tokens[targets == 1].tolist()) == "The old guard.<|im_end|>"


def test_a_training_template_with_generation_tags_gives_the_rows_of_the_same_template_without_them(tmp_path):
    plain = (fixture("qwen2") / "chat_template.jinja").read_text()
    tagged = plain.replace("{{ m['content'] }}<|im_end|>", "{% generation %}{{ m['content'] }}"
                           "{% endgeneration %}<|im_end|>")  # fmt: skip
    assert "{% generation %}" in tagged
    source = write_jsonl(tmp_path / "chats.jsonl", chats(4))
    rows = []
    for name, text in [("plain", plain), ("tagged", tagged)]:
        (tmp_path / f"{name}.jinja").write_text(text)
        rows.append(load(config(tmp_path, source, chat_template=str(tmp_path / f"{name}.jinja"))).train.stored())
    for column in rows[0]:
        np.testing.assert_array_equal(rows[0][column], rows[1][column])


def test_a_template_is_compiled_once_for_all_the_renderings_of_a_dataset():
    template = (fixture("qwen2") / "chat_template.jinja").read_text()
    assert chat.compile_template(template) is chat.compile_template(template)  # each turn renders it twice more


def test_unpacked_rows_hold_one_padded_example_and_eval_pads_its_last_batch(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(5))
    cfg = config(tmp_path, source, packing=False, eval_split="train")
    splits = load(cfg)
    rows = splits.train.stored()
    assert rows["tokens"].dtype == np.uint16 and rows["targets"].dtype == np.uint8
    assert rows["segments"].dtype == rows["positions"].dtype == np.int32
    assert rows["tokens"].shape == (5, 256) and rows["segments"].max(axis=1).tolist() == [1] * 5
    batches = list(splits.eval.eval_batches(4))
    assert [b["mask"].tolist() for b in batches] == [[True] * 4, [True, False, False, False]]
    assert (batches[1]["tokens"][0] == rows["tokens"][4]).all() and not batches[1]["segments"][1:].any()
    prepared = splits.eval.prepare({k: v for k, v in batches[0].items() if k != "mask"})
    assert prepared["targets"].dtype == bool and prepared["tokens"].dtype == prepared["positions"].dtype == np.int32


def test_each_epoch_is_a_permutation_of_the_rows_from_the_seed_and_epoch(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(12))
    split = load(config(tmp_path, source, packing=False)).train
    first, again, second = split.epoch_keys(0), split.epoch_keys(0), split.epoch_keys(1)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(12))
    assert (first == again).all() and not (first == second).all()
    assert split.steps_per_epoch(5) == 2
    with pytest.raises(UserError, match=r"'train.batch_size' \(13\) is larger than the training split"):
        split.steps_per_epoch(13)


def test_chat_data_is_text_for_the_trainer_and_its_samples_are_user_turns(tmp_path):
    import types

    from nnx_cli.config import load_config
    from nnx_cli.data import eval_split, spec_from_config, train_split
    from nnx_cli.hooks import eval_prompts

    source = write_jsonl(tmp_path / "chats.jsonl", chats(10))
    cfg = load_config(None, ["model.name=transformer_lm", f"model.pretrained={fixture('qwen2')}",
                             f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}", "data.format=chat",
                             "data.tokenizer=pretrained", "data.seq_len=63", "data.eval_split=test"])  # fmt: skip
    tokenizer = hf.pretrained_tokenizer(str(fixture("qwen2")))
    assert spec_from_config(cfg).input_shape == (63,)
    exp = types.SimpleNamespace(cfg=cfg, eval=eval_split(cfg))
    assert len(train_split(cfg).epoch_keys(0)) > 0 and len(exp.eval) > 0
    prompts = eval_prompts(exp)  # by default, eval examples up to where their first reply begins
    assert tokenizer.decode(prompts[0]).endswith("<|im_start|>assistant\n")
    cfg.train.sample_prompts = ["Who keeps the bridge?"]
    expected = chat.render(tokenizer.chat_template, [{"role": "user", "content": "Who keeps the bridge?"}],
                           add_generation_prompt=True, special_tokens=chat.special_tokens(tokenizer))  # fmt: skip
    assert eval_prompts(exp) == [tokenizer.encode_plain(expected).tolist()]
    cfg.data.chat_template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    assert tokenizer.decode(eval_prompts(exp)[0]) == "Q: Who keeps the bridge?\nA:"


def test_a_source_with_one_split_holds_out_its_last_tenth_of_examples(tmp_path, capsys):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(20))
    splits = load(config(tmp_path, source, eval_split="test", packing=False))
    assert (len(splits.train), len(splits.eval)) == (18, 2)
    assert "its last 2 of 20 examples are held out as 'test'" in capsys.readouterr().err
    tokenizer = hf.pretrained_tokenizer(str(fixture("qwen2")))
    held = [tokenizer.decode(tokens.tolist()) for tokens, _ in segments_of(splits.eval.stored())]
    specials = chat.special_tokens(tokenizer)
    assert held == [chat.render(tokenizer.chat_template, row["messages"], add_generation_prompt=False,
                                special_tokens=specials) for row in chats(20)[18:]]  # fmt: skip


@pytest.mark.parametrize(
    "rows, options, message",
    [
        ([{"messages": chats(1)[0]["messages"]}, {"other": 1}], {}, r"row 1 of .* has no 'messages'; every row"),
        ([{"messages": [{"role": "user"}]}], {}, r"row 0 of .*'messages'\[0\] has no text 'content'"),
        ([{"messages": "hello"}], {}, r"row 0 of .*'messages' is not a non-empty list of messages"),
        (chats(2), {"chat_template": "{{ raise_exception('no system turns, please') }}"},
         r"row 0 of .*the chat template failed: no system turns, please"),
        (chats(2), {"chat_template": "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"},
         r"row 0 of .*renders message 2 \(assistant\) differently inside the conversation"),
        ([{"messages": ["hello"]}], {}, r"row 0 of .*'messages'\[0\] is not a \{role, content\} message"),
        ([{"messages": [{"from": "human", "value": "hi"}]}], {}, r"'messages'\[0\] is not a \{role, content\} "
         r"message \(ShareGPT's \{from, value\}: rename from to role and value to content\)"),
        ([{"prompt": "hi", "completion": ""}], {"format": "completion"}, r"row 0 of .*the completion not empty"),
        ([{"prompt": "a", "completion": "b"}, {"prompt": "c"}], {"format": "completion"},
         r"'data.completion_key': row 1 of .* has no 'completion'"),
        (chats(1), {"chat_template": "no_such_template.jinja"}, r"'data.chat_template': 'no_such_template.jinja' is "
         "neither a file nor a Jinja template"),
    ],
    ids=["missing-key", "no-content", "not-a-list", "template-raises", "not-prefix-consistent", "not-a-message",
         "sharegpt", "empty-completion", "missing-completion", "no-template-file"],
)  # fmt: skip
def test_bad_rows_and_templates_name_the_row(tmp_path, rows, options, message):
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(UserError, match=message):
        load(config(tmp_path, source, **options))


def sharegpt_roles(rows: list[dict]) -> list[dict]:
    return [{"messages": [{**m, "role": {"assistant": "gpt"}.get(m["role"], m["role"])} for m in r["messages"]]}
            for r in rows]  # fmt: skip


@pytest.mark.parametrize(
    "rows, options, message",
    [
        (sharegpt_roles(chats(4)), {}, r"training split 'train' has no target token to learn from: none of its 4 "
         r"conversations has an assistant turn .*rename roles like 'gpt'"),
        (chats(4), {"seq_len": 15}, r"training split 'train' has no target token to learn from: .* within "
         r"data.seq_len \(15\)"),
        (chats(4), {"seq_len": 15, "train_split": "x", "eval_split": "train"}, r"eval split 'train' has no target "
         r"token to measure: .* or set data.eval_split: null"),
        ([{"prompt": "word " * 40, "completion": "yes"}] * 3, {"format": "completion", "seq_len": 31},
         r"none of its \d+ examples has a completion token"),
        (chats(4), {"max_len": 8}, r"training split 'train' has no target token to learn from: .* within "
         r"data.max_len \(8\) tokens: .*; raise data.max_len or fix the data"),  # it named data.seq_len (255)
    ],
    ids=["sharegpt-roles", "answers-cut", "eval-answers-cut", "completions-cut", "max-len-cut"],
)  # fmt: skip
def test_a_split_with_no_target_token_is_an_error_not_a_loss_of_zero(tmp_path, rows, options, message):
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    splits = ("eval",) if options.get("train_split") == "x" else ("train",)
    options = {k: v for k, v in options.items() if k != "train_split"}
    with pytest.raises(UserError, match=message):
        examples.load_example_splits(config(tmp_path, source, **options), 0, splits, str(fixture("qwen2")))


def test_a_csv_completion_column_of_numbers_says_it_was_read_as_numbers(tmp_path):
    """The message blamed the data, which was a valid CSV: datasets reads a column of numbers as int64."""
    (tmp_path / "answers.csv").write_text("prompt,completion\nTwo and two?,4\nThree and three?,6\n")
    with pytest.raises(
        UserError,
        match=r"must be text, the completion not empty \('completion' read as numbers: a "
        r"column of numbers in a CSV file is; write the rows as JSON Lines",
    ):
        load(config(tmp_path, tmp_path / "answers.csv", format="completion"))


def test_a_source_of_one_example_held_out_for_evals_names_the_hold_out(tmp_path):
    """The only way out it named was a longer data.seq_len."""
    source = write_jsonl(tmp_path / "one.jsonl", chats(1))
    with pytest.raises(
        UserError,
        match=r"one.jsonl' has 1 example, all held out as 'test' \(it has no split of that "
        r"name\); add examples, or set data.eval_split: null",
    ):
        load(config(tmp_path, source, eval_split="test"))


def test_a_column_the_source_lacks_is_named_with_the_columns_it_has(tmp_path):
    source = write_jsonl(tmp_path / "pairs.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(UserError, match=r"^config key 'data.prompt_key': .* no column 'prompt'; columns: question, "):
        load(config(tmp_path, source, format="completion"))
    # the key of the column missing: it said 'data.prompt_key/completion_key', a key no config has
    with pytest.raises(UserError, match=r"^config key 'data.completion_key': .* no column 'completion'; columns: q"):
        load(config(tmp_path, source, format="completion", prompt_key="question"))


def test_chat_without_any_template_is_a_user_error(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", chats(2))
    with pytest.raises(UserError, match=r"data.format' is chat, but there is no chat template"):
        load(config(tmp_path, source), "gpt2")


def test_format_and_max_len_are_checked_with_the_config():
    from nnx_cli.config import load_config

    with pytest.raises(UserError, match=r"'data.format' must be text, chat or completion"):
        load_config(None, ["data.format=dialogue"])
    with pytest.raises(UserError, match=r"'data.max_len' must be at least 2"):
        load_config(None, ["data.max_len=1"])


def test_a_template_sees_the_special_tokens_a_directory_names_and_nothing_for_those_it_does_not(tmp_path):
    import shutil

    from nnx_cli.data import chat as chats

    directory = tmp_path / "llama"
    shutil.copytree(fixture("llama"), directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    named = {"bos_token": settings.pop("bos_token"), "eos_token": settings.pop("eos_token")}
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": "<|eot_id|>"}))
    (directory / "special_tokens_map.json").write_text(json.dumps(named))  # older directories name them only here
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ pad_token }}{{ unk_token }}{% endfor %}"

    def rendered() -> str:
        hf.pretrained_tokenizer.cache_clear()
        tokenizer = hf.pretrained_tokenizer(str(directory))
        messages = [{"role": "user", "content": "Hi"}]
        return chats.render(
            template, messages, add_generation_prompt=False, special_tokens=chats.special_tokens(tokenizer)
        )

    assert rendered() == f"{named['bos_token']}Hi<|eot_id|>"
    (directory / "special_tokens_map.json").unlink()
    assert rendered() == "Hi<|eot_id|>"  # transformers renders an unnamed token as nothing, not 'None'


def test_a_text_key_beside_chat_data_is_said_to_be_unread(capsys, monkeypatch):
    from nnx_cli import experiment
    from nnx_cli.config import Config
    from nnx_cli.data import base

    monkeypatch.setattr(base, "_noticed", set())  # said once a process: this one may have said it already
    cfg = Config()
    cfg.data = DataConfig(source="chats.jsonl", format="chat", text_key="text")
    experiment._notice_unread(cfg, "train")
    said = "notice: data.text_key is not read with data.format=chat (rows: data.messages_key)\n"
    assert capsys.readouterr().err == said
    cfg.data = DataConfig(source="chats.jsonl", format="chat")
    experiment._notice_unread(cfg, "train")
    assert capsys.readouterr().err == ""
    # a model directory evaluated on chats (the GGUF guide): it sets data.text_key for text, never for chats
    monkeypatch.setattr(base, "_noticed", set())
    experiment._notice_unread(hf.model_dir_config(fixture("qwen2"), ["data.format=chat"]), "eval")
    assert capsys.readouterr().err == ""
    assert hf.model_dir_config(fixture("qwen2"), []).data.text_key == "text"
