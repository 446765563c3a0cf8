"""Text datasets for language models: tokenizers, token streams cached on disk, training and eval windows."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from nnx_cli.config import DataConfig
from nnx_cli.data import text
from nnx_cli.data.base import DataSpec, EvalSplit, TrainSplit
from nnx_cli.data.cache import cache_root
from nnx_cli.data.text import TextEvalSplit, TextTrainSplit, load_text_splits, stream_dtype, text_spec
from nnx_cli.data.tokenizers import BytesTokenizer, load_tokenizer, tokenizer_vocab_size
from nnx_cli.errors import UserError

SPEC = DataSpec((4,), 257, "bytes")
POEM = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
DOCS = ["ab", "", "cé\nd"]


def config(tmp_path: Path, source: Path | str, **options) -> DataConfig:
    """A text config whose cache lives in the test's own directory."""
    options = {"text_key": "text", "seq_len": 4, "eval_split": None, "workers": 0, **options}
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **options)


def write_jsonl(path: Path, documents: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(documents)))
    return path


def byte_stream(documents: list[str]) -> list[int]:
    """The bytes tokenizer's stream by hand: each document's UTF-8 bytes, then 256."""
    return [t for d in documents for t in [*d.encode(), 256]]


def stream_entries(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "cache").glob("tokens-*") if p.is_dir())


def train_bpe(path: Path, corpus: list[str], end_of_document: str | None = "<|endoftext|>") -> Path:
    """A small byte-level BPE tokenizer trained on `corpus`, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [end_of_document] if end_of_document else []
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(path))
    return path


# --------------------------------------------------------------------------- tokenizers


def test_bytes_tokenizer_round_trips_utf8_text():
    tokenizer = load_tokenizer("bytes")
    ids = tokenizer.encode("héllo ✓")
    assert ids.tolist() == list("héllo ✓".encode())
    assert tokenizer.decode(ids) == "héllo ✓"
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (257, 256)


def test_bytes_tokenizer_drops_end_of_document_when_decoding():
    tokenizer = BytesTokenizer()
    assert tokenizer.decode([104, 105, 256, 33]) == "hi!"


def test_bytes_tokenizer_gives_raw_bytes_that_may_end_mid_character():
    tokenizer = BytesTokenizer()
    euro = list("€".encode())
    assert tokenizer.to_bytes(euro[:2]) == "€".encode()[:2]
    assert tokenizer.decode(euro[:2]) == "\ufffd"


def test_a_tokenizer_json_with_an_end_of_text_token_uses_it_as_end_of_document(tmp_path):
    tokenizer = load_tokenizer(str(train_bpe(tmp_path / "tokenizer.json", [POEM])))
    assert tokenizer.eod_id == tokenizer._tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.vocab_size == tokenizer._tokenizer.get_vocab_size()
    assert tokenizer.decode(tokenizer.encode(POEM)) == POEM


def test_a_tokenizer_json_without_an_end_of_document_token_gets_one_past_its_vocabulary(tmp_path):
    tokenizer = load_tokenizer(str(train_bpe(tmp_path / "tokenizer.json", [POEM], end_of_document=None)))
    base = tokenizer._tokenizer.get_vocab_size()
    assert (tokenizer.eod_id, tokenizer.vocab_size) == (base, base + 1)
    assert tokenizer.decode([*tokenizer.encode("thee"), tokenizer.eod_id]) == "thee"


def test_the_vocabulary_size_needs_no_data(tmp_path):
    path = train_bpe(tmp_path / "tokenizer.json", [POEM])
    assert tokenizer_vocab_size("bytes") == 257
    assert tokenizer_vocab_size(str(path)) == load_tokenizer(str(path)).vocab_size
    spec = text_spec(DataConfig(source=str(tmp_path / "no-such-corpus.txt"), text_key="text", seq_len=64))
    assert spec == DataSpec((64,), 257, "bytes")


def test_a_missing_tokenizer_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="data.tokenizer.*tokenizer file .*missing.json.* does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("name", ["BYTES", "Bytes", "Pretrained"])
def test_a_built_in_name_in_capitals_is_refused_with_its_spelling_not_asked_of_the_hub(name, tmp_path, monkeypatch):
    """`data.tokenizer=BYTES` went to the Hub for a tokenizer of that name, and said the Hub could not be reached."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"data.tokenizer' is '{name}'.*did you mean '{name.lower()}'"):
        load_tokenizer(name)
    with pytest.raises(UserError, match="did you mean"):
        tokenizer_vocab_size(name)


def test_a_hub_tokenizer_that_cannot_be_fetched_offline_says_how_to_use_a_local_file(tmp_path):
    script = (
        "from nnx_cli.data.tokenizers import load_tokenizer\n"
        "from nnx_cli.errors import UserError\n"
        "try:\n    load_tokenizer('gpt2')\nexcept UserError as e:\n    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert "cannot load Hub tokenizer 'gpt2'" in done.stdout
    assert "data.tokenizer=/path/to/tokenizer.json" in done.stdout


def test_a_hugging_face_tokenizer_without_the_tokenizers_package_names_the_pip_install(monkeypatch, tmp_path):
    path = train_bpe(tmp_path / "tokenizer.json", [POEM])
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what `import tokenizers` sees when it is not installed
    with pytest.raises(UserError, match="pip install tokenizers"):
        load_tokenizer(str(path))


# --------------------------------------------------------------------------- token streams


def test_documents_are_joined_with_end_of_document_after_each(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    tokens = load_text_splits(config(tmp_path, source, seq_len=2), seed=0).train.tokens
    assert tokens.tolist() == byte_stream(DOCS)
    assert tokens.dtype == np.uint16


def test_a_txt_file_is_one_document(tmp_path):
    (tmp_path / "poem.txt").write_text(POEM)
    tokens = load_text_splits(config(tmp_path, tmp_path / "poem.txt"), seed=0).train.tokens
    assert tokens.tolist() == byte_stream([POEM])


def documents_of(tokens: np.ndarray) -> list[str]:
    """The documents of a bytes stream, each ended by end-of-document."""
    return [BytesTokenizer().decode(d) for d in np.split(tokens, np.flatnonzero(tokens == 256) + 1)[:-1]]


def write_files(root: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return root


def test_a_directory_of_txt_and_md_files_is_one_document_per_file_in_the_order_of_their_paths(tmp_path):
    files = {"b.txt": "second\n", "a.md": "# first\n", "notes/c.txt": "third\n", ".draft.txt": "hidden\n"}
    tokens = load_text_splits(config(tmp_path, write_files(tmp_path / "works", files)), seed=0).train.tokens
    assert documents_of(tokens) == ["# first\n", "second\n", "third\n"]


def test_a_directory_of_markdown_files_alone_is_text(tmp_path):
    source = write_files(tmp_path / "notes", {"one.md": "# one\n", "two.md": "# two\n"})
    assert documents_of(load_text_splits(config(tmp_path, source), seed=0).train.tokens) == ["# one\n", "# two\n"]


def test_text_files_named_after_splits_are_those_splits(tmp_path):
    source = write_files(tmp_path / "corpus", {"train.txt": POEM * 3, "test.md": "held out\n"})
    splits = load_text_splits(config(tmp_path, source, eval_split="test"), seed=0)
    assert documents_of(splits.train.tokens) == [POEM * 3] and documents_of(splits.eval.tokens) == ["held out\n"]


@pytest.mark.parametrize(
    "files, key",
    [({"book.txt": POEM}, "text"), ({"a.txt": POEM, "b.md": POEM}, "text"), ({"a.txt": POEM, "b.jsonl": "{}"}, None)],
)
def test_plain_text_needs_no_text_key_and_other_files_still_do(tmp_path, files, key):
    write_files(tmp_path / "data", files)
    source = tmp_path / "data" / next(iter(files)) if len(files) == 1 else tmp_path / "data"
    cfg = DataConfig(source=str(source))
    text.fill_text_key(cfg)
    assert cfg.text_key == key


def test_a_model_trained_from_scratch_reads_a_text_file_without_text_key(tmp_path):
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup

    (tmp_path / "book.txt").write_text(POEM * 20)
    model = ["model.name=transformer_lm", "model.num_layers=1", "model.num_heads=2", "model.embed_dim=16"]
    data = [f"data.source={tmp_path / 'book.txt'}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}"]
    exp = setup(load_config(None, [*model, *data, "data.eval_split=validation", "train.batch_size=4"]))
    assert exp.cfg.data.text_key == "text" and exp.spec.input_shape == (16,)  # the resolved config says so too
    assert len(exp.train.tokens) + len(exp.eval.tokens) == len((POEM * 20).encode()) + 1  # one document, held out


def test_a_file_name_with_glob_characters_is_that_file_and_no_other(tmp_path):
    (tmp_path / "draft[v2].txt").write_text(POEM)
    (tmp_path / "draft2.txt").write_text("a file the pattern draft[v2].txt matches\n")
    tokens = load_text_splits(config(tmp_path, tmp_path / "draft[v2].txt"), seed=0).train.tokens
    assert tokens.tolist() == byte_stream([POEM])


def test_a_directory_of_text_under_a_name_with_glob_characters_is_read(tmp_path):
    source = write_files(tmp_path / "notes[1]", {"a.txt": "first\n", "b.md": "second\n"})
    assert documents_of(load_text_splits(config(tmp_path, source), seed=0).train.tokens) == ["first\n", "second\n"]


def test_a_directory_of_other_files_under_a_name_with_glob_characters_is_a_user_error(tmp_path):
    (tmp_path / "data[1]").mkdir()
    source = write_jsonl(tmp_path / "data[1]" / "docs.jsonl", DOCS).parent
    with pytest.raises(UserError, match=r"data.source.*directory .*data\[1\].* as a pattern.*rename"):
        load_text_splits(config(tmp_path, source), seed=0)


@pytest.mark.parametrize("name", ["BOOK.TXT", "Notes.Md"])
def test_a_text_file_extension_is_read_in_any_case(tmp_path, name):
    (tmp_path / name).write_text(POEM)
    cfg = config(tmp_path, tmp_path / name, text_key=None)
    text.fill_text_key(cfg)
    assert cfg.text_key == "text"
    assert load_text_splits(cfg, seed=0).train.tokens.tolist() == byte_stream([POEM])


def test_a_directory_of_upper_case_text_files_is_plain_text(tmp_path):
    source = write_files(tmp_path / "works", {"A.TXT": "first\n", "B.MD": "second\n"})
    cfg = config(tmp_path, source, text_key=None)
    text.fill_text_key(cfg)
    assert documents_of(load_text_splits(cfg, seed=0).train.tokens) == ["first\n", "second\n"]


def test_a_text_file_that_is_not_utf8_names_the_file_the_byte_and_how_to_convert_it(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\u00e9\n".encode("latin-1") * 100)
    with pytest.raises(UserError) as raised:
        load_text_splits(config(tmp_path, tmp_path / "latin1.txt"), seed=0)
    message = str(raised.value)
    assert "latin1.txt' is not UTF-8 text (byte 0xe9 at offset 6, line 2)" in message
    assert "iconv -f latin1 -t utf-8" in message and "DatasetGenerationError" not in message


def test_the_file_of_a_directory_that_is_not_utf8_is_the_one_named(tmp_path):
    source = write_files(tmp_path / "works", {"a.txt": "first\n", "b.txt": "second\n"})
    (source / "c.txt").write_bytes(b"third\n" * 2 + "\u00e9".encode("cp1252"))
    with pytest.raises(UserError, match=r"works/c.txt' is not UTF-8 text \(byte 0xe9 at offset 12, line 3\)"):
        load_text_splits(config(tmp_path, source), seed=0)


def test_a_json_lines_file_that_is_not_utf8_is_named_as_a_text_file_is(tmp_path):
    """pyarrow's JSON reader took the bytes without a word: reading the rows ended in a UnicodeDecodeError traceback."""
    good = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)).encode()
    (tmp_path / "latin1.jsonl").write_bytes(good + b'{"text": "caf\xe9"}\n')
    offset = len(good) + len(b'{"text": "caf')
    with pytest.raises(UserError, match=rf"latin1.jsonl' is not UTF-8 text \(byte 0xe9 at offset {offset}, line 21\)"):
        load_text_splits(config(tmp_path, tmp_path / "latin1.jsonl"), seed=0)


def test_a_text_column_of_mixed_types_says_so(tmp_path):
    """It said the column holds Json(decode=True), datasets' type for it."""
    (tmp_path / "mixed.jsonl").write_text('{"text": "a story"}\n{"text": 5}\n')
    with pytest.raises(
        UserError,
        match=r"holds values of several types \(strings and others\), not text; name a column "
        r"of strings in every row$",
    ):
        load_text_splits(config(tmp_path, tmp_path / "mixed.jsonl"), seed=0)


@pytest.mark.parametrize("name, content", [("header.csv", "text\n"), ("empty.json", "[]\n")])
def test_a_file_of_no_rows_says_so(tmp_path, name, content):
    """It said: cannot load dataset ...: ValueError: Instruction "train" corresponds to no data!"""
    (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=rf"^config key 'data.source': '.*{name}' holds no rows to read$"):
        load_text_splits(config(tmp_path, tmp_path / name), seed=0)


def test_a_directory_of_several_configs_names_them_and_how_to_read_one(tmp_path):
    """Only the first line of datasets' error was said (Config name is missing.), not the configs it lists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    layout = ["---", "configs:"]
    for name in ("easy", "hard"):
        (tmp_path / "multi" / name).mkdir(parents=True)
        pq.write_table(
            pa.table({"text": [f"{name} {i}" for i in range(4)]}), tmp_path / "multi" / name / "train.parquet"
        )
        layout += [f"- config_name: {name}", "  data_files:", "  - split: train", f"    path: {name}/train.parquet"]
    (tmp_path / "multi" / "README.md").write_text("\n".join([*layout, "---", ""]))
    with pytest.raises(UserError, match=r"multi' holds several configs \('easy', 'hard'\), and nnx reads one: set"):
        load_text_splits(config(tmp_path, tmp_path / "multi"), seed=0)
    splits = load_text_splits(config(tmp_path, tmp_path / "multi" / "hard"), seed=0)  # the way it names
    assert splits.train is not None


def test_a_broken_file_says_what_datasets_found_wrong_inside_its_generation_error(tmp_path):
    (tmp_path / "docs.csv").write_text('text\n"a\n')
    with pytest.raises(UserError, match=r"cannot load dataset .*docs.csv.*: \w+Error: "):
        load_text_splits(config(tmp_path, tmp_path / "docs.csv"), seed=0)


def test_a_json_lines_file_names_its_first_line_that_is_not_json(tmp_path):
    """Arrow's "JSON parse error ... in row 5438" counted from the start of one of its read blocks (a file of 24 MB
    broken at line 120,001), from 0; in a small file the error was pandas' ('at position 9')."""
    rows = [json.dumps({"text": f"document {i} " + "words " * 30}) for i in range(60_000)]
    rows[50_000] = '{"text": [}'
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(
        UserError, match=r"'data.source': line 50,001 of '.*docs.jsonl' is not JSON \(Expecting value\)"
    ):
        load_text_splits(config(tmp_path, tmp_path / "docs.jsonl"), seed=0)
    (tmp_path / "small.jsonl").write_text('{"text": "a"}\n\n{"text": \n')
    with pytest.raises(UserError, match=r"line 3 of '.*small.jsonl' is not JSON"):
        load_text_splits(config(tmp_path, tmp_path / "small.jsonl"), seed=0)


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank lines"])
def test_an_empty_file_is_named_as_empty(tmp_path, text):
    """A file of blank lines ended in datasets' 'Instruction "train" corresponds to no data!'."""
    (tmp_path / "docs.jsonl").write_text(text)
    with pytest.raises(UserError, match=r"'data.source': '.*docs.jsonl' is an empty file; it holds no rows"):
        load_text_splits(config(tmp_path, tmp_path / "docs.jsonl"), seed=0)


def test_a_directory_of_two_formats_warns_of_the_files_datasets_leaves_out(tmp_path, capsys):
    source = write_files(tmp_path / "mixed", {"a.txt": "left out\n", "notes/c.md": "left out too\n"})
    write_jsonl(source / "b.jsonl", DOCS)
    write_jsonl(source / "d.jsonl", ["read"])
    assert load_text_splits(config(tmp_path, source, seq_len=2), seed=0).train.tokens.tolist() == byte_stream(
        [*DOCS, "read"]
    )
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "reads one format from directory" in warnings[0] and "its .jsonl files" in warnings[0]
    assert "leaves out a.txt, notes/c.md" in warnings[0]


def test_a_file_whose_name_says_no_split_beside_files_that_do_is_named_in_a_warning(tmp_path, capsys):
    source = write_files(tmp_path / "corpus", {"train.txt": POEM * 3, "test.md": "held out\n", "notes.md": "x\n"})
    splits = load_text_splits(config(tmp_path, source, eval_split="test"), seed=0)
    assert documents_of(splits.train.tokens) == [POEM * 3]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "as splits (train, test)" in warnings[0] and "leaves out notes.md" in warnings[0]


def test_a_readme_among_text_documents_is_named_as_left_out(tmp_path, capsys):
    """`datasets` takes a README.md for the dataset's card: among .txt and .md documents it was left out unsaid."""
    source = write_files(tmp_path / "notes", {"README.md": "# my notes\n", "ch1.txt": POEM})
    assert documents_of(load_text_splits(config(tmp_path, source), seed=0).train.tokens) == [POEM]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "takes README.md in directory" in warnings[0] and "rename it" in warnings[0]


def test_a_directory_datasets_reads_whole_warns_of_nothing(tmp_path, capsys):
    source = write_files(tmp_path / "works", {"README.md": "# about\n", ".draft.txt": "hidden\n"})
    write_jsonl(source / "b.jsonl", DOCS)
    assert load_text_splits(config(tmp_path, source, seq_len=2), seed=0).train.tokens.tolist() == byte_stream(DOCS)
    assert "warning:" not in capsys.readouterr().err


def _save_jsonl(path: Path) -> Path:
    return write_jsonl(path / "docs.jsonl", DOCS)


def _save_parquet(path: Path) -> Path:
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(path / "docs.parquet"))
    return path / "docs.parquet"


def _save_parquet_dir(path: Path) -> Path:
    import datasets

    (path / "corpus").mkdir()
    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(path / "corpus" / "train-00000-of-00001.parquet"))
    return path / "corpus"


def _save_to_disk(path: Path) -> Path:
    import datasets

    splits = {
        "train": datasets.Dataset.from_dict({"text": DOCS}),
        "test": datasets.Dataset.from_dict({"text": ["xyz"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(path / "saved"))
    return path / "saved"


@pytest.mark.parametrize("save", [_save_jsonl, _save_parquet, _save_parquet_dir, _save_to_disk])
def test_every_kind_of_source_gives_the_same_stream(tmp_path, save):
    tokens = load_text_splits(config(tmp_path, save(tmp_path), seq_len=2), seed=0).train.tokens
    assert tokens.tolist() == byte_stream(DOCS)


def test_a_tokenizer_json_tokenizes_each_document_then_ends_it(tmp_path):
    documents = [POEM, "more lovely\n"]
    path = train_bpe(tmp_path / "tokenizer.json", documents)
    source = write_jsonl(tmp_path / "docs.jsonl", documents)
    tokens = load_text_splits(config(tmp_path, source, tokenizer=str(path)), seed=0).train.tokens
    tokenizer = load_tokenizer(str(path))
    expected = [t for d in documents for t in [*tokenizer.encode(d).tolist(), tokenizer.eod_id]]
    assert tokens.tolist() == expected


def test_a_post_processor_that_ends_each_text_with_the_end_token_ends_each_document_once(tmp_path):
    from hf_support import fixture

    import nnx_cli.hf  # noqa: F401  (reads model directories)

    model = tmp_path / "model"
    shutil.copytree(fixture("llama"), model)
    spec = json.loads((model / "tokenizer.json").read_text())
    ends = {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}}
    spec["post_processor"]["single"].append(ends)  # <|begin_of_text|> $A <|end_of_text|>
    spec["post_processor"]["special_tokens"]["<|end_of_text|>"] = {"id": "<|end_of_text|>", "ids": [1],
                                                                   "tokens": ["<|end_of_text|>"]}  # fmt: skip
    (model / "tokenizer.json").write_text(json.dumps(spec))
    documents = ["more lovely", "a summer's day"]
    source = write_jsonl(tmp_path / "docs.jsonl", documents)
    cfg = config(tmp_path, source, tokenizer="pretrained")
    tokens = load_text_splits(cfg, seed=0, pretrained=str(model)).train.tokens.tolist()
    tokenizer = load_tokenizer("pretrained", str(model))
    assert tokenizer.encode(documents[0]).tolist()[-1] == tokenizer.eod_id == 1  # the post-processor's end
    assert tokens == [t for d in documents for t in tokenizer.encode(d).tolist()]  # as transformers tokenizes


def test_long_documents_are_tokenized_in_pieces_that_tokenize_as_the_whole(tmp_path):
    document = POEM * 40
    pieces = list(text._pieces(document, size=300))
    assert len(pieces) > 1 and "".join(pieces) == document
    assert all(p.endswith("\n") and not n[0].isspace() for p, n in itertools.pairwise(pieces))
    tokenizer = load_tokenizer(str(train_bpe(tmp_path / "tokenizer.json", [POEM])))
    assert np.concatenate(tokenizer.encode_batch(pieces)).tolist() == tokenizer.encode(document).tolist()


def test_the_stream_is_uint16_unless_the_vocabulary_needs_uint32():
    assert stream_dtype(257) == np.uint16 and stream_dtype(65536) == np.uint16
    assert stream_dtype(65537) == np.uint32


def test_worker_processes_give_the_stream_one_process_gives(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "_PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(text, "_TASK_BYTES", 64)  # several tasks from a few documents
    documents = [POEM[i:] for i in range(0, 80, 8)]
    source = write_jsonl(tmp_path / "docs.jsonl", documents)
    tokenizer = str(train_bpe(tmp_path / "tokenizer.json", documents))
    serial = load_text_splits(config(tmp_path / "serial", source, tokenizer=tokenizer), seed=0).train.tokens
    parallel_cfg = config(tmp_path / "parallel", source, tokenizer=tokenizer, workers=2)
    parallel = load_text_splits(parallel_cfg, seed=0).train.tokens
    assert parallel.tolist() == serial.tolist()
    assert json.loads((stream_entries(tmp_path / "parallel")[0] / "meta.json").read_text())["workers"] == 2


def test_a_text_key_that_is_not_a_column_is_a_user_error_with_a_did_you_mean(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS, key="content")
    with pytest.raises(UserError, match="data.text_key.*no column 'contnet'.*did you mean 'content'.*columns: content"):
        load_text_splits(config(tmp_path, source, text_key="contnet"), seed=0)


def test_a_column_of_numbers_is_not_text(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    with pytest.raises(UserError, match="column 'id' .* not text"):
        load_text_splits(config(tmp_path, source, text_key="id"), seed=0)


# --------------------------------------------------------------------------- the cache


def test_a_second_load_reads_neither_the_text_nor_the_tokenizer_again(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", ["tokenized once"])
    stat = source.stat()
    first = load_text_splits(config(tmp_path, source), seed=0).train.tokens
    # Same size and modification time, other words: only a fresh read would see them.
    write_jsonl(source, ["TOKENIZED ONCE"])
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = load_text_splits(config(tmp_path, source), seed=0).train.tokens
    assert isinstance(second, np.memmap)
    assert second.tolist() == first.tolist() == byte_stream(["tokenized once"])
    assert len(stream_entries(tmp_path)) == 1


def test_editing_the_text_builds_a_new_stream(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", ["first version"])
    load_text_splits(config(tmp_path, source), seed=0)
    write_jsonl(source, ["second version, longer"])
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    tokens = load_text_splits(config(tmp_path, source), seed=0).train.tokens
    assert tokens.tolist() == byte_stream(["second version, longer"])
    assert len(stream_entries(tmp_path)) == 2


def test_another_tokenizer_builds_another_stream(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [POEM])
    path = train_bpe(tmp_path / "tokenizer.json", [POEM])
    by_bytes = load_text_splits(config(tmp_path, source), seed=0).train.tokens
    by_bpe = load_text_splits(config(tmp_path, source, tokenizer=str(path)), seed=0).train.tokens
    assert len(by_bpe) < len(by_bytes)
    assert len(stream_entries(tmp_path)) == 2


def test_an_edited_tokenizer_json_builds_another_stream(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [POEM])
    path = train_bpe(tmp_path / "tokenizer.json", [POEM])
    first = load_text_splits(config(tmp_path, source, tokenizer=str(path)), seed=0).train.tokens
    train_bpe(path, ["temperate temperate temperate"])
    second = load_text_splits(config(tmp_path, source, tokenizer=str(path)), seed=0).train.tokens
    assert second.tolist() != first.tolist()
    assert len(stream_entries(tmp_path)) == 2


def _load_stream(cfg: DataConfig) -> list[int]:
    return load_text_splits(cfg, seed=0).train.tokens.tolist()


def test_concurrent_loads_build_the_stream_once(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [POEM] * 50)
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        streams = pool.map(_load_stream, [config(tmp_path, source)] * 2)
    assert streams[0] == streams[1] == byte_stream([POEM] * 50)
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if ".partial-" in p.name]
    assert len(stream_entries(tmp_path)) == 1 and leftovers == []


# --------------------------------------------------------------------------- splits


def test_a_single_split_source_holds_out_its_last_tenth_for_eval(tmp_path, capsys):
    (tmp_path / "poem.txt").write_text(POEM * 3)
    cfg = config(tmp_path, tmp_path / "poem.txt", eval_split="validation")
    splits = load_text_splits(cfg, seed=0)
    stream = byte_stream([POEM * 3])
    cut = len(stream) - len(stream) // 10
    assert splits.train.tokens.tolist() == stream[:cut]
    assert splits.eval.tokens.tolist() == stream[cut:]
    load_text_splits(cfg, seed=0)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 1 and "held out as 'validation'" in notices[0]


def test_training_alone_still_leaves_out_the_held_out_tenth(tmp_path):
    (tmp_path / "poem.txt").write_text(POEM * 3)
    cfg = config(tmp_path, tmp_path / "poem.txt", eval_split="validation")
    train_only = load_text_splits(cfg, seed=0, splits=["train"])
    both = load_text_splits(cfg, seed=0)
    assert train_only.eval is None
    assert train_only.train.tokens.tolist() == both.train.tokens.tolist()


def test_an_eval_split_the_source_has_is_its_own_stream(tmp_path):
    splits = load_text_splits(config(tmp_path, _save_to_disk(tmp_path), seq_len=2, eval_split="test"), seed=0)
    assert splits.train.tokens.tolist() == byte_stream(DOCS)
    assert splits.eval.tokens.tolist() == byte_stream(["xyz"])


def test_an_eval_split_a_multi_split_source_lacks_is_a_user_error(tmp_path):
    cfg = config(tmp_path, _save_to_disk(tmp_path), seq_len=2, eval_split="tset")
    with pytest.raises(UserError, match="data.eval_split.*no split 'tset'.*did you mean 'test'.*data.eval_split=null"):
        load_text_splits(cfg, seed=0)


def test_only_the_splits_asked_for_are_loaded(tmp_path):
    cfg = config(tmp_path, _save_to_disk(tmp_path), seq_len=2, eval_split="test")
    splits = load_text_splits(cfg, seed=0, splits=["eval"])
    assert splits.train is None and splits.eval.tokens.tolist() == byte_stream(["xyz"])
    assert [p.name.split("-")[2] for p in stream_entries(tmp_path)] == ["test"]


def test_a_stream_too_short_for_seq_len_is_a_user_error(tmp_path):
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(UserError, match="data.seq_len.*5 tokens.*at least 17"):
        load_text_splits(config(tmp_path, tmp_path / "short.txt", seq_len=8), seed=0)


def test_a_split_whose_documents_are_all_empty_is_a_user_error_naming_the_column(tmp_path):
    """A source of empty documents trained, on end-of-document tokens alone, without a word."""
    source = write_jsonl(tmp_path / "empty.jsonl", [""] * 50)
    with pytest.raises(UserError, match="'data.train_split': split 'train' of .* holds no text: its 50 documents in "
                                        "column 'text' are all empty"):  # fmt: skip
        load_text_splits(config(tmp_path, source), seed=0)
    mostly = write_jsonl(tmp_path / "mostly.jsonl", ["some words here"] + [""] * 99)  # its held-out tail: empty
    with pytest.raises(UserError, match="'data.eval_split': split 'validation' .* holds no text.*data.eval_split=null"):
        load_text_splits(config(tmp_path, mostly, eval_split="validation"), seed=0)
    assert len(load_text_splits(config(tmp_path, mostly), seed=0).train) > 0


def test_the_default_sample_prompts_are_each_the_beginning_of_one_document(tmp_path):
    """Documents shorter than a prompt: the prompts ran on into the next documents (and empty ones), and
    writing the samples at the first eval ended the run with a traceback on the end-of-document token."""
    import types

    from nnx_cli.config import load_config
    from nnx_cli.data import eval_split
    from nnx_cli.decoding import text_of
    from nnx_cli.hooks import eval_prompts

    documents = [f"line {i}" if i % 3 else "" for i in range(300)]
    source = write_jsonl(tmp_path / "short.jsonl", documents)
    overrides = [f"data.source={source}", "data.text_key=text", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_config(None, ["model.name=transformer_lm", *overrides, "data.seq_len=64", "data.eval_split=test"])
    prompts = eval_prompts(types.SimpleNamespace(cfg=cfg, eval=eval_split(cfg)))
    tokenizer = BytesTokenizer()
    texts = [tokenizer.decode(prompt) for prompt in prompts]
    assert len(prompts) == 2 and not any(tokenizer.eod_id in prompt for prompt in prompts)
    assert set(texts) <= set(documents) - {""}, texts
    assert text_of(tokenizer, [*prompts[0], tokenizer.eod_id, *prompts[1]]) == texts[0] + texts[1]


def test_a_file_whose_name_is_not_utf8_is_read_like_any_other(tmp_path):
    """Names from a zip archive or a Windows copy: fingerprinting the directory raised UnicodeEncodeError."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "plain.txt").write_text(POEM)
    (corpus / os.fsdecode(b"caf\xe9.txt")).write_text(POEM)
    splits = load_text_splits(config(tmp_path, corpus), seed=0)
    assert splits.train.tokens.tolist() == byte_stream([POEM, POEM])


def test_a_misspelt_local_source_is_named_missing_with_the_closest_name_not_asked_for_its_columns(tmp_path):
    """`data.source=book.tx` was told to set data.text_key (as if it were a dataset without text)."""
    from nnx_cli.config import load_config
    from nnx_cli.experiment import setup

    (tmp_path / "book.txt").write_text(POEM)
    for source, closest in (("book.tx", "book.txt"), ("./books.txt", "./book.txt"), ("nothing.txt", None)):
        with pytest.raises(UserError) as raised:
            setup(load_config(None, ["model.name=transformer_lm", f"data.source={tmp_path / source}"]), data=None)
        message = str(raised.value)
        assert message.startswith(f"config key 'data.source': local dataset '{tmp_path / source}' does not exist")
        assert ("did you mean" in message) == (closest is not None), message


def test_sample_prompts_that_cannot_be_encoded_say_why_in_one_line(tmp_path):
    """A lone surrogate ended the run with a traceback; a chat template's own error was reported as a prompt
    that encodes to no tokens."""
    import types

    from hf_support import fixture

    import nnx_cli.hf  # noqa: F401  (reads model directories' tokenizers)
    from nnx_cli.config import load_config
    from nnx_cli.hooks import eval_prompts

    cfg = load_config(None, ["model.name=transformer_lm", "data.source=x.txt", 'train.sample_prompts=["a\\ud800"]'])
    with pytest.raises(UserError, match=r"prompt 0 \('a\\ud800'\) is not UTF-8 text \(a lone surrogate"):
        eval_prompts(types.SimpleNamespace(cfg=cfg))
    template = "{{ raise_exception('the first message must be a system turn') }}"
    overrides = [f"model.pretrained={fixture('llama')}", "data.format=chat", "data.tokenizer=pretrained"]
    cfg = load_config(None, ["model.name=transformer_lm", *overrides, "train.sample_prompts=['Who?']"])
    cfg.data.chat_template = template
    with pytest.raises(UserError, match="prompt 0 \\('Who\\?'\\): .*the first message must be a system turn"):
        eval_prompts(types.SimpleNamespace(cfg=cfg))


# --------------------------------------------------------------------------- windows


def test_text_splits_give_the_loop_its_interface():
    tokens = np.arange(50, dtype=np.uint16)
    assert isinstance(TextTrainSplit(tokens, 4, 0, SPEC), TrainSplit)
    assert isinstance(TextEvalSplit(tokens, 4, SPEC), EvalSplit)


def test_each_epoch_lays_out_its_windows_from_an_offset_in_0_to_seq_len():
    split = TextTrainSplit(np.arange(103, dtype=np.uint32), seq_len=4, seed=1, spec=SPEC)
    offsets = set()
    for epoch in range(60):
        keys = np.sort(split.epoch_keys(epoch))
        offset = split.epoch_offset(epoch)
        assert keys.tolist() == (offset + 4 * np.arange(len(keys))).tolist()
        offsets.add(offset)
    assert offsets == {0, 1, 2, 3, 4}


def test_every_epoch_has_as_many_windows_as_fit_at_the_largest_offset():
    for length in (9, 10, 11, 12, 13, 100):
        split = TextTrainSplit(np.zeros(length, np.uint16), seq_len=4, seed=0, spec=SPEC)
        fit_at_largest = len(range(4, length - 4, 4))  # starts s with s + 5 <= length
        assert {len(split.epoch_keys(e)) for e in range(20)} == {fit_at_largest}
        assert all(split.epoch_keys(e).max() + 5 <= length for e in range(20))


def test_every_token_after_the_offset_is_a_target_exactly_once():
    split = TextTrainSplit(np.arange(41, dtype=np.uint32), seq_len=4, seed=3, spec=SPEC)
    windows = split.read(split.epoch_keys(0))["tokens"]
    targets = np.sort(windows[:, 1:].ravel())
    offset = split.epoch_offset(0)
    assert targets.tolist() == list(range(offset + 1, offset + 1 + 4 * len(windows)))


def test_an_epoch_is_a_permutation_drawn_from_seed_and_epoch():
    tokens = np.arange(400, dtype=np.uint16)
    split = TextTrainSplit(tokens, seq_len=4, seed=7, spec=SPEC)
    assert not np.array_equal(split.epoch_keys(0), split.epoch_keys(1))
    assert not np.array_equal(split.epoch_keys(0), TextTrainSplit(tokens, 4, 8, SPEC).epoch_keys(0))


def test_batch_i_of_epoch_e_is_rebuilt_after_a_restart():
    tokens = np.arange(400, dtype=np.uint16)
    before, after = TextTrainSplit(tokens, 4, 7, SPEC), TextTrainSplit(tokens.copy(), 4, 7, SPEC)
    i, batch_size = 5, 8
    rebuilt = after.read(after.epoch_keys(3)[i * batch_size : (i + 1) * batch_size])["tokens"]
    assert (
        rebuilt.tolist() == before.read(before.epoch_keys(3)[i * batch_size : (i + 1) * batch_size])["tokens"].tolist()
    )


def test_keys_read_exactly_the_stream_slices():
    tokens = np.random.default_rng(0).integers(0, 257, size=300).astype(np.uint16)
    split = TextTrainSplit(tokens, seq_len=6, seed=0, spec=SPEC)
    keys = split.epoch_keys(2)[:10]
    windows = split.read(keys)["tokens"]
    assert windows.dtype == np.uint16 and windows.shape == (10, 7)
    for key, window in zip(keys, windows):
        assert window.tolist() == tokens[key : key + 7].tolist()


def test_read_on_device_agrees_with_read_on_the_host():
    tokens = np.random.default_rng(1).integers(0, 257, size=300).astype(np.uint16)
    split = TextTrainSplit(tokens, seq_len=6, seed=0, spec=SPEC)
    keys = split.epoch_keys(0)[:12]
    stored = jax.device_put(split.stored())
    on_device = jax.jit(split.read_on_device)(stored, jax.numpy.asarray(keys))
    np.testing.assert_array_equal(np.asarray(on_device["tokens"]), split.read(keys)["tokens"])


def test_prepare_casts_tokens_to_int32():
    split = TextTrainSplit(np.arange(50, dtype=np.uint16), seq_len=4, seed=0, spec=SPEC)
    batch = jax.jit(split.prepare)(jax.device_put(split.read(split.epoch_keys(0)[:2])))
    assert batch["tokens"].dtype == jax.numpy.int32


def test_steps_per_epoch_drop_the_last_partial_batch():
    split = TextTrainSplit(np.zeros(45, np.uint16), seq_len=4, seed=0, spec=SPEC)  # 10 windows
    assert len(split) == 10 and split.steps_per_epoch(3) == 3


def test_a_batch_larger_than_the_windows_is_a_user_error():
    split = TextTrainSplit(np.zeros(45, np.uint16), seq_len=4, seed=0, spec=SPEC)
    with pytest.raises(UserError, match=r"train.batch_size' \(11\).*10 windows"):
        split.steps_per_epoch(11)


def test_eval_windows_cover_the_stream_in_order_from_offset_0():
    tokens = np.arange(23, dtype=np.uint16)
    split = TextEvalSplit(tokens, seq_len=4, spec=SPEC)
    batches = list(split.eval_batches(batch_size=2))
    windows = np.concatenate([b["tokens"][b["mask"]] for b in batches])
    assert windows.tolist() == [tokens[s : s + 5].tolist() for s in range(0, 18, 4)]  # 5 windows; 2 tokens left
    assert [b["mask"].tolist() for b in batches] == [[True, True], [True, True], [True, False]]
    assert batches[-1]["tokens"].shape == (2, 5)


def test_eval_batch_rows_are_each_process_share_of_the_same_batch():
    split = TextEvalSplit(np.arange(60, dtype=np.uint16), seq_len=4, spec=SPEC)
    whole = list(split.eval_batches(4))
    halves = zip(split.eval_batches(4, slice(0, 2)), split.eval_batches(4, slice(2, 4)))
    for full, (first, second) in zip(whole, halves):
        for name in ("tokens", "mask"):
            np.testing.assert_array_equal(np.concatenate([first[name], second[name]]), full[name])


def test_the_npy_header_leaves_room_for_any_stream_length(tmp_path):
    writer = text._NpyWriter(tmp_path / "t.npy", np.dtype(np.uint32))
    assert len(writer._header(0)) == len(writer._header(2**62))


def test_the_default_cache_is_under_the_datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cfg = DataConfig(source=str(source), text_key="text", seq_len=2, eval_split=None, workers=0)
    load_text_splits(cfg, seed=0)
    assert list(cache_root().glob("tokens-docs.jsonl-train-*"))
