"""Local-file loaders of the switchhead lm-eval tasks (the YAML files' `!function` module).

lm-eval calls each `custom_dataset` loader with the task's metadata (the TaskManager / `--metadata` JSON, and
with `lm-eval run` also the model arguments) plus the task's `dataset_kwargs`. Where a file is looked up, first
match wins:

1. a metadata key: `lambada_path`, `blimp_dir`, `wikitext2_dir`, `wikitext103_dir`, `cbt_dir`;
2. the environment variable of the same name in capitals with a `SWITCHHEAD_` prefix (`SWITCHHEAD_LAMBADA_PATH`);
3. the standard layout under `data_dir` (metadata) or `SWITCHHEAD_DATA_DIR` (environment);
4. the standard layout under `../../../shared/data` (the data folder beside a source checkout).

Relative paths are resolved relative to this folder. Everything is read offline.

This file is loaded by file path (lm-eval's `!function`), so it imports only the standard library and
`datasets`; `switchhead.evaluation.zero_shot` reuses the same readers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = "../../../shared/data"

# metadata key -> path under the data folder
STANDARD_LAYOUT = {
    "lambada_path": "lambada/lambada_test.jsonl",
    "blimp_dir": "blimp",
    "wikitext2_dir": "wikitext-2",
    "wikitext103_dir": "wikitext-103",
    "cbt_dir": "cbt",
}
CBT_FILES = {"CN": "cbtest_CN_test_2500ex.txt", "NE": "cbtest_NE_test_2500ex.txt"}
CBT_BLANK = "XXXXX"


def data_path(key: str, metadata: dict | None = None) -> Path:
    """Where the file or folder `key` (see STANDARD_LAYOUT) is, following the lookup order of the module doc."""
    metadata = metadata or {}
    env_name = "SWITCHHEAD_" + key.upper()
    value = metadata.get(key) or os.environ.get(env_name)
    if not value:
        base = metadata.get("data_dir") or os.environ.get("SWITCHHEAD_DATA_DIR") or DEFAULT_DATA_DIR
        value = os.path.join(str(base), STANDARD_LAYOUT[key])
    path = Path(os.path.expanduser(str(value)))
    if not path.is_absolute():
        path = (TASK_DIR / path).resolve()
    if not path.exists():
        layout = ", ".join(STANDARD_LAYOUT[name] for name in ("lambada_path", "blimp_dir", "wikitext2_dir"))
        fetcher = TASK_DIR.parent.parent / "scripts" / "fetch_test_data.py"
        fetch = (" (from a checkout, `python scripts/fetch_test_data.py` downloads it into ../shared/data beside "
                 "the checkout)" if fetcher.is_file() else "")
        raise FileNotFoundError(
            f"{path} does not exist; give its location with the metadata key {key!r} (lm-eval --metadata JSON or "
            f"switchhead eval --data-dir), the environment variable {env_name}, or SWITCHHEAD_DATA_DIR: a folder "
            f"holding {layout}{fetch}")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _as_split(rows: list[dict], split: str = "test"):
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


# ---------------------------------------------------------------------------------------------------- LAMBADA
def lambada_rows(metadata: dict | None = None) -> list[dict]:
    """OpenAI LAMBADA passages: `{"text": ...}`; the target is the last space-separated word."""
    return [{"text": row["text"]} for row in _read_jsonl(data_path("lambada_path", metadata))]


def load_lambada(**metadata):
    return _as_split(lambada_rows(metadata))


# ---------------------------------------------------------------------------------------------------- BLiMP
def blimp_paradigms(metadata: dict | None = None) -> list[str]:
    return sorted(path.stem for path in data_path("blimp_dir", metadata).glob("*.jsonl"))


def blimp_rows(paradigm: str, metadata: dict | None = None) -> list[dict]:
    """One paradigm's minimal pairs: `{"sentence_good", "sentence_bad"}`."""
    path = data_path("blimp_dir", metadata) / f"{paradigm}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no BLiMP paradigm file {path}")
    return [{"sentence_good": row["sentence_good"], "sentence_bad": row["sentence_bad"]} for row in _read_jsonl(path)]


def load_blimp(paradigm: str, **metadata):
    return _as_split(blimp_rows(paradigm, metadata))


# ---------------------------------------------------------------------------------------------------- WikiText
def is_article_title(line: str) -> bool:
    """A level-1 heading line (` = Title = `), tested as the document-level WikiText dataset does.

    Runs of `= = =` and `= =` are first collapsed to `===` / `==`, so that sub-headings (` = = Section = = `) do
    not count; then the stripped line must start with "= " and end with " =".
    """
    collapsed = line.replace("= = =", "===").replace("= =", "==").strip()
    return collapsed.startswith("= ") and collapsed.endswith(" =")


def split_wikitext_pages(text: str) -> list[str]:
    """Cut a WikiText file into articles exactly as `EleutherAI/wikitext_document_level` defines its pages.

    That dataset (the one lm-eval's `wikitext` task loads) splits the file on "\n" and starts a page at every
    article title line. The lines before a title, re-joined with "\n", form the previous page, which is kept
    only if it has a non-whitespace character (so the file's leading " \n" before the first title is dropped,
    not glued to the first page); the newline between a page and the next title belongs to neither. The last
    page is always kept and ends with the file's final "\n" (the empty string after the last "\n" is its
    last line).
    """
    lines = text.split("\n")
    titles = [number for number, line in enumerate(lines) if is_article_title(line)]
    starts, ends = [0] + titles, titles + [len(lines)]
    pages = []
    for start, end in zip(starts, ends):
        page = "\n".join(lines[start:end])
        if end == len(lines) or page.strip():
            pages.append(page)
    return pages


def wikitext_documents(corpus: str, split: str = "test", metadata: dict | None = None) -> list[dict]:
    """Articles of a WikiText `.tokens` file as `{"page": text}` rows (see `split_wikitext_pages`)."""
    keys = {"wikitext-2": "wikitext2_dir", "wikitext-103": "wikitext103_dir"}
    if corpus not in keys:
        raise ValueError(f"corpus must be one of {', '.join(keys)}, got {corpus!r}")
    key = keys[corpus]
    path = data_path(key, metadata) / f"wiki.{split}.tokens"
    if not path.exists():
        raise FileNotFoundError(f"no WikiText file {path}")
    # text mode, as the dataset reads it (universal newlines)
    return [{"page": page} for page in split_wikitext_pages(path.read_text(encoding="utf-8"))]


def load_wikitext(corpus: str = "wikitext-2", split: str = "test", **metadata):
    return _as_split(wikitext_documents(corpus, split, metadata))


# ---------------------------------------------------------------------------------------------------- CBT
def cbt_rows(kind: str, metadata: dict | None = None) -> list[dict]:
    """Children's Book Test questions in the original CBTest text format.

    Each example is 20 numbered context lines and a 21st line `21 question<TAB>answer<TAB><TAB>c1|c2|...|c10`,
    examples separated by blank lines. Returns `{"context", "question", "options", "choices", "label"}`, where
    `choices` are the question with the blank (`XXXXX`) replaced by each option.
    """
    if kind not in CBT_FILES:
        raise ValueError(f"CBT kind must be one of {', '.join(CBT_FILES)}, got {kind!r}")
    path = data_path("cbt_dir", metadata) / CBT_FILES[kind]
    if not path.exists():
        raise FileNotFoundError(f"no CBT file {path} (CBT is not shipped; download CBTest and set cbt_dir)")
    rows, context = [], []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            index, _, text = line.partition(" ")
            if "\t" not in text:
                context.append(text)
                continue
            fields = text.split("\t")
            if len(fields) < 4 or CBT_BLANK not in fields[0]:
                raise ValueError(f"{path}:{number}: expected 'question<TAB>answer<TAB><TAB>options' with {CBT_BLANK}")
            question, answer, options = fields[0], fields[1], [o for o in fields[3].split("|") if o]
            if answer not in options:
                raise ValueError(f"{path}:{number}: answer {answer!r} is not among the options {options}")
            rows.append({"context": " ".join(context), "question": question, "options": options,
                         "choices": [question.replace(CBT_BLANK, option) for option in options],
                         "label": options.index(answer)})
            context = []
    return rows


def load_cbt(kind: str = "CN", **metadata):
    return _as_split(cbt_rows(kind, metadata))
