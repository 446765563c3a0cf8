"""Building a token stream: the bytes tokenizer versus a BPE tokenizer in this process and in worker processes.

Tokenizes the training split of a text dataset (default: the shakespeare
works in ../shared/data/shakespeare, repeated `--times` times) into a fresh
cache three ways and prints each build's time relative to `bytes` measured in
the same run: `bytes` in this process; a byte-level BPE (trained here on the
same text, `--vocab` ids) in this process, where the `tokenizers` library
uses its own threads; the same BPE in `--workers` spawned worker processes.

    python benchmarks/text_tokenize.py [--source ../shared/data/shakespeare] [--times 1] [--workers 2]
"""

import argparse
import tempfile
import time
from pathlib import Path

from nnx_cli.config import DataConfig
from nnx_cli.data import text


def train_bpe(documents: list[str], vocab: int, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", default=str(Path(__file__).parents[2] / "shared" / "data" / "shakespeare"))
    parser.add_argument("--times", type=int, default=1, help="repeat the corpus this many times")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()

    import datasets

    datasets.disable_progress_bars()
    train = datasets.load_dataset(args.source)["train"]
    work = Path(tempfile.mkdtemp(prefix="nnx-text-bench-"))
    corpus = work / "corpus.parquet"
    datasets.concatenate_datasets([train.select_columns(["text"])] * args.times).to_parquet(str(corpus))
    tokenizer = str(train_bpe(train["text"], args.vocab, work / "tokenizer.json"))
    text._PARALLEL_MIN_BYTES = 0  # let workers run on a corpus of any size
    text._TASK_BYTES = min(text._TASK_BYTES, corpus.stat().st_size // (4 * args.workers) + 1)

    def build(name: str, **options) -> float:
        cfg = DataConfig(source=str(corpus), text_key="text", eval_split=None, cache_dir=str(work / name), **options)
        started = time.perf_counter()
        tokens = text.load_text_splits(cfg, seed=0, splits=["train"]).train.tokens
        seconds = time.perf_counter() - started
        print(f"{name:28s} {seconds:7.2f} s  {len(tokens):>11,} tokens", flush=True)
        return seconds

    megabytes = corpus.stat().st_size / 1e6
    print(f"{args.source} x{args.times}: {megabytes:.1f} MB of parquet")
    baseline = build("bytes", workers=0)
    threads = build("bpe, this process", tokenizer=tokenizer, workers=0)
    workers = build(f"bpe, {args.workers} worker processes", tokenizer=tokenizer, workers=args.workers)
    print(f"bpe / bytes: {threads / baseline:.1f}x in this process, {workers / baseline:.1f}x with workers")
    print(f"workers / this process: {workers / threads:.2f}x")


if __name__ == "__main__":
    main()
