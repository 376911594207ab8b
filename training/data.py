"""Training data: documents in, a BPE tokenizer, one token stream per split, and deterministic batches out.

Pipeline: `load_documents` (local .txt / .tokens / .jsonl files, folders of them, a Hub dataset name, or the
embedded Python standard library corpus) -> `train_tokenizer` or `load_tokenizer` -> `tokenize_documents` (one
flat int64 stream, documents separated by the end-of-text token) -> `TokenBatches` (fixed-length blocks).

`TokenBatches` makes the batch of every optimizer step a pure function of (seed, step): resuming at step s needs
no saved iterator, and every process of a distributed run can cut its share out of the same global batch.
"""

from __future__ import annotations

import contextlib
import glob
import os
from array import array
from pathlib import Path
import sysconfig

import torch

END_OF_TEXT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".tokens", ".raw", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
STDLIB_CORPUS = "python-stdlib"


class DataError(ValueError):
    """The data or tokenizer the user pointed at cannot be used (one-line reason)."""


# ================================================================================================ documents
def stdlib_documents() -> list[str]:
    """The embedded default corpus every Python installation has: the standard library's reference documentation
    (the `pydoc_data` topics: English prose about the language) and the top-level standard library modules' sources.

    Returns one string per topic and per module, in a fixed (sorted) order.
    """
    from pydoc_data.topics import topics

    documents = [topics[name] for name in sorted(topics)]
    stdlib = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as handle:
            documents.append(handle.read())
    return documents


def _data_files(path: str) -> list[str]:
    """The readable files behind `path` (a file or a folder, searched recursively), sorted."""
    if os.path.isfile(path):
        return [path]
    files = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(path)
        for name in names
        if name.endswith(TEXT_SUFFIXES + JSON_SUFFIXES)
    )
    if not files:
        raise DataError(f"data folder {path!r} holds no {'/'.join(TEXT_SUFFIXES + JSON_SUFFIXES)} files")
    return files


def _split_of(path: str) -> str | None:
    """'train' / 'validation' / 'test' when a file name says so (wiki.valid.tokens, valid.jsonl), else None."""
    name = os.path.basename(path).lower()
    for split, words in (("validation", ("valid", "validation", "val", "dev")), ("test", ("test",)),
                         ("train", ("train",))):
        if any(part in words for part in name.replace("-", ".").replace("_", ".").split(".")):
            return split
    return None


def _read_file(path: str, text_field: str) -> list[str]:
    """Documents of one local file through `datasets`: a .jsonl record, or a whole text file, is one document."""
    import datasets

    if os.path.getsize(path) == 0:
        raise DataError(f"data file {path!r} is empty")
    _check_text(path)
    # datasets' own progress bar and error log would add lines to our one-line error; its failure is reported below
    bars_were_on = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        if path.endswith(JSON_SUFFIXES):
            table = datasets.load_dataset("json", data_files=path, split="train")
        else:
            table = datasets.load_dataset("text", data_files=path, split="train", sample_by="document",
                                          keep_linebreaks=True)
    except Exception as error:  # noqa: BLE001 - datasets wraps the reader's error (bad JSON, bad bytes, ...)
        cause = error.__cause__ or error.__context__ or error
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        kind = "JSON lines" if path.endswith(JSON_SUFFIXES) else "text"
        raise DataError(f"data file {path!r} cannot be read as {kind} ({type(cause).__name__}"
                        f"{': ' + text[:200] if text else ''})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()
    if path.endswith(JSON_SUFFIXES):
        if text_field not in table.column_names:
            raise DataError(f"{path!r} has no field {text_field!r} (fields: {', '.join(table.column_names)}); "
                            "choose one with --text-field")
        documents = [text for text in table[text_field] if text]
        other = next((text for text in documents if not isinstance(text, str)), None)
        if other is not None:  # {"text": 5}, {"text": ["a"]}: training reads strings only
            raise DataError(f"{path!r}: field {text_field!r} holds {type(other).__name__} values (e.g. "
                            f"{repr(other)[:40]}), not text; choose the text field with --text-field")
    else:
        documents = [text for text in table["text"] if text]
    if not any(text.strip() for text in documents):
        raise DataError(f"data file {path!r} holds no text")
    return documents


def _check_text(path: str, sample: int = 1 << 16) -> None:
    """DataError when the start of `path` is not UTF-8 text (a NUL byte or an invalid sequence): a binary file
    given as --data is refused by name before `datasets` tries to read it."""
    with open(path, "rb") as handle:
        head = handle.read(sample)
    if b"\0" in head:
        raise DataError(f"data file {path!r} is binary (it holds NUL bytes), not UTF-8 text")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 4:  # not merely a multi-byte character cut by the sample's end
            raise DataError(f"data file {path!r} is not UTF-8 text (invalid byte at offset {error.start})") from None


def missing_data_hint() -> str:
    """What to do about a data path that does not exist: what it may hold and, from a checkout, how to get the
    WikiText the README's examples train on."""
    hint = ("give a .txt, .tokens or .jsonl file, a folder of them (WikiText: wiki.train.tokens, wiki.valid.tokens, "
            "wiki.test.tokens), or a Hub dataset name")
    fetcher = Path(__file__).resolve().parent.parent / "scripts" / "fetch_test_data.py"
    if fetcher.is_file():  # a checkout: its data folder is ../shared/data beside it
        hint += (f"; the README's examples use the test data, which `python {fetcher.parent.name}/{fetcher.name}` "
                 "(from the checkout) downloads into ../shared/data")
    return hint


def load_documents(data: str | None, text_field: str = "text", valid_data: str | None = None,
                   valid_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """Train and validation documents.

    Args:
        data: a file, a folder, a Hub dataset name (online only), or None / "python-stdlib" for the embedded corpus.
            In a folder, files named like `*train*` / `*valid*` (e.g. WikiText's `wiki.train.tokens`) give the
            splits and `*test*` files are left out; without such names every file is training data.
        text_field: the field of .jsonl records (and Hub rows) that holds the text.
        valid_data: a file or folder used as the validation split instead.
        valid_fraction: when no validation split is given, this share of the documents (spread evenly, or of the
            end of a single document) is held out.

    Returns:
        (train documents, validation documents), each a non-empty list of strings.
    """
    train: list[str]
    valid: list[str] = []
    if data is None or data == STDLIB_CORPUS:
        train = stdlib_documents()
    elif os.path.exists(data):
        by_split: dict[str | None, list[str]] = {}
        for path in _data_files(data):
            by_split.setdefault(_split_of(path) if os.path.isdir(data) else None, []).extend(
                _read_file(path, text_field))
        train = by_split.get("train", []) + by_split.get(None, [])
        valid = by_split.get("validation", [])
        if not train:
            raise DataError(f"data {data!r} has validation/test files but no training file")
    elif data.startswith((".", "/", "~")) or data.endswith(TEXT_SUFFIXES + JSON_SUFFIXES):
        raise DataError(f"data path {data!r} does not exist; {missing_data_hint()}")
    else:
        train, valid = _hub_documents(data, text_field)

    if valid_data is not None:
        if not os.path.exists(valid_data):
            raise DataError(f"validation data path {valid_data!r} does not exist; {missing_data_hint()}")
        valid = [doc for path in _data_files(valid_data) for doc in _read_file(path, text_field)]
    if not valid:
        train, valid = _hold_out(train, valid_fraction)
    return train, valid


def _hub_documents(name: str, text_field: str) -> tuple[list[str], list[str]]:
    import datasets

    try:
        with _quiet_hub():
            splits = datasets.load_dataset(name)
    except Exception as error:  # noqa: BLE001 - offline, unknown name, ...: one line for the user
        raise DataError(f"data {name!r} is neither a local path nor a loadable Hub dataset "
                        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    if "train" not in splits:
        raise DataError(f"Hub dataset {name!r} has no 'train' split (splits: {', '.join(splits)})")
    if text_field not in splits["train"].column_names:
        raise DataError(f"Hub dataset {name!r} has no field {text_field!r}; choose one with --text-field")
    valid_split = next((s for s in ("validation", "valid", "test") if s in splits), None)
    valid = [t for t in splits[valid_split][text_field] if t] if valid_split else []
    return [t for t in splits["train"][text_field] if t], valid


@contextlib.contextmanager
def _quiet_hub():
    """The Hub client's and Datasets' warnings held back during a download: without a network each of the five
    retries logged two lines before the one error line that says the dataset cannot be reached."""
    import logging

    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "fsspec", "urllib3")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _hold_out(documents: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Every (1/fraction)-th document goes to validation; a single document gives up its tail instead."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"valid_fraction ({fraction}) must be in (0, 1) when there is no validation split")
    if len(documents) * fraction >= 1.0:
        every = max(2, round(1.0 / fraction))
        return ([d for i, d in enumerate(documents) if i % every != every - 1],
                [d for i, d in enumerate(documents) if i % every == every - 1])
    text = "\n".join(documents)
    cut = int(len(text) * (1.0 - fraction))
    cut = text.rfind("\n", 0, cut) + 1 or cut  # cut at a line break when there is one
    return [text[:cut]], [text[cut:]]


# ================================================================================================ tokenizer
def train_tokenizer(documents: list[str], vocab_size: int = 8000):
    """A byte-level BPE tokenizer (digits split one by one, like the paper's) trained on `documents`.

    Returns a `PreTrainedTokenizerFast` whose `<|endoftext|>` token is bos, eos and pad, so that a saved model
    folder loads with `AutoTokenizer`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise DataError(f"vocab_size ({vocab_size}) must be >= 300: byte-level BPE starts from 256 byte tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def lines():  # short pieces keep the trainer's memory small on big corpora
        for document in documents:
            yield from document.splitlines(keepends=True)

    tokenizer.train_from_iterator(lines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT)


def load_tokenizer(path: str):
    """A tokenizer from a folder: a `save_pretrained` folder, a bare `tokenizer.json`, or GPT-2 style
    `vocab.json` + `merges.txt`. It gets an end-of-text token (used between documents) if it has none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not os.path.isdir(path):
        raise DataError(f"tokenizer folder {path!r} does not exist")
    files = set(os.listdir(path))
    if not ({"tokenizer_config.json", "tokenizer.json"} & files or {"vocab.json", "merges.txt"} <= files):
        raise DataError(f"tokenizer folder {path!r} has neither tokenizer.json nor vocab.json + merges.txt")
    from ..integrity import check_remote_code

    check_remote_code(path)  # a tokenizer of the folder's own code (auto_map) is refused: no code from it runs
    try:
        if "tokenizer_config.json" in files:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        elif "tokenizer.json" in files:
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
        else:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers

            bpe = models.BPE.from_file(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
            backend = Tokenizer(bpe)
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    except Exception as error:  # noqa: BLE001 - damaged JSON, a wrong class name, ...: name the folder
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise DataError(f"tokenizer folder {path!r} does not load ({type(error).__name__}"
                        f"{': ' + text if text else ''})") from None
    if tokenizer.eos_token is None:
        eos = END_OF_TEXT if END_OF_TEXT in tokenizer.get_vocab() else None
        if eos is None:
            tokenizer.add_special_tokens({"eos_token": END_OF_TEXT})
        else:
            tokenizer.eos_token = eos
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_documents(tokenizer, documents: list[str], batch_lines: int = 2048) -> torch.Tensor:
    """All documents as one int64 stream `[N]`, each document followed by the end-of-text token.

    Documents are encoded line by line (lines keep their line breaks, so nothing is lost at the joins), in
    batches, which lets the Rust tokenizer use every core.
    """
    backend = tokenizer.backend_tokenizer
    eos = tokenizer.eos_token_id
    ids = array("i")  # a compact buffer: a Python list would take ~9x the memory on a large corpus
    pending: list[str] = []

    def flush():
        for encoding in backend.encode_batch(pending, add_special_tokens=False):
            ids.extend(encoding.ids)
        pending.clear()

    for document in documents:
        for line in document.splitlines(keepends=True):
            pending.append(line)
            if len(pending) >= batch_lines:
                flush()
        flush()
        ids.append(eos)
    return torch.frombuffer(ids, dtype=torch.int32).long() if ids else torch.zeros(0, dtype=torch.long)


def unigram_perplexity(train_ids: torch.Tensor, valid_ids: torch.Tensor, vocab_size: int) -> float:
    """Perplexity of the validation stream under the training unigram distribution (add-one smoothed): the level a
    language model must get well below to have learnt anything about context."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(torch.exp(-log_probs[valid_ids].mean()))


# ================================================================================================ batches
class TokenBatches:
    """Fixed-length blocks of a token stream, cut into deterministic global batches.

    Two orders:
      * shuffled (RoPE models): the stream is cut into blocks `[n, T]`; each epoch visits them in a random
        permutation seeded by (seed, epoch); step s of the epoch takes `rows` consecutive entries of it.
      * ordered (XL models): the stream is cut into `rows` contiguous streams `[rows, L]` and step s takes
        segment s of every stream, so row r of step s+1 continues row r of step s and the XL memory carries
        real context (Transformer-XL's language-model iterator). An epoch ends when the streams run out.

    `micro_batch(step, micro, process, num_processes, accumulation)` is this process's share: the global batch's
    rows are dealt out to (micro step, process) pairs in equal consecutive slices, so the same global batch gives
    the same gradient whatever the number of processes.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, rows: int, seed: int = 0, ordered: bool = False):
        self.block_size, self.rows, self.seed, self.ordered = block_size, rows, seed, ordered
        if ordered:
            length = tokens.numel() // rows
            self.steps_per_epoch = length // block_size
            self.streams = tokens[: rows * length].view(rows, length)
        else:
            self.blocks = tokens[: tokens.numel() // block_size * block_size].view(-1, block_size)
            self.steps_per_epoch = self.blocks.shape[0] // rows
        if self.steps_per_epoch < 1:
            raise DataError(f"{tokens.numel()} tokens are too few for one batch of {rows} x {block_size} tokens: "
                            "use more data, or lower batch_size or block_size")

    def segment_index(self, step: int) -> int:
        """Position of `step` within its epoch (0 means: a new pass starts, XL memory must be reset)."""
        return step % self.steps_per_epoch

    def global_batch(self, step: int) -> torch.Tensor:
        """Token ids `[rows, block_size]` of optimizer step `step`."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if self.ordered:
            start = index * self.block_size
            return self.streams[:, start : start + self.block_size]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.blocks.shape[0], generator=generator)
        return self.blocks[order[index * self.rows : (index + 1) * self.rows]]

    def micro_batch(self, step: int, micro: int, process: int, num_processes: int, accumulation: int) -> torch.Tensor:
        """This process's rows `[rows / (num_processes * accumulation), block_size]` for one micro step."""
        share = self.rows // (num_processes * accumulation)
        slot = micro * num_processes + process
        return self.global_batch(step)[slot * share : (slot + 1) * share]

    def __len__(self) -> int:
        return self.steps_per_epoch


__all__ = ["DataError", "END_OF_TEXT", "STDLIB_CORPUS", "TokenBatches", "load_documents", "load_tokenizer",
           "stdlib_documents", "tokenize_documents", "train_tokenizer", "unigram_perplexity"]
