"""Our task folder against the installed lm-eval's own built-in task definitions, document by document.

lm-eval's built-in `lambada_openai`, `blimp` (all its paradigms) and `wikitext` are loaded at test time from the
installed package (its YAML files, `!function` utilities, `include`s and TaskManager/ConfigurableTask machinery,
untouched). Only their dataset source changes: `datasets.load_dataset` is replaced, for these tests, by a reader of
the same local files our tasks read (../shared/data). Both sides then build every request of every document, and
the tests assert that the request strings, targets, choices, target delimiters and the per-document numbers that
feed the metrics are identical. No model is involved. If an lm-eval upgrade changes one of these definitions,
these tests fail and name the document.

Not covered: CBT (lm-eval has no CBT task matching ours, and the CBT files are not in ../shared/data); the raw
WikiText files (`wikitext-2-raw-v1`, what lm-eval's `wikitext` reads) are not here either, so both sides are given
the word-level `.tokens` files: the test proves the two tasks treat a file identically, and the README states that
our WikiText numbers are on the word-level files.

The document-level WikiText dataset (`EleutherAI/wikitext_document_level`) is built by a loading script on the
Hub, which lm-eval does not ship; `reference_wikitext_pages` below re-states its page rule as a plain line loop
(the simple twin of `utils.split_wikitext_pages`), pinned by the expected pages of a synthetic file.
"""

import functools
import json
import logging
import random
from pathlib import Path

import datasets
import pytest

from switchhead.evaluation import TASKS_DIR
from switchhead.evaluation.tasks import utils as task_data

import lm_eval.tasks  # noqa: E402 - lm-eval is in the test extra: a missing one fails, never skips

LM_EVAL_TASKS_DIR = Path(lm_eval.tasks.__file__).resolve().parent
# our tasks and the built-in each test compares it with; CBT has none (and its files are not in ../shared/data)
COVERED = {"switchhead_lambada": "lambada_openai", "switchhead_wikitext2": "wikitext",
           "switchhead_wikitext103": "wikitext (given WikiText-103)", "switchhead_blimp_*": "blimp_*"}
NOT_COVERED = {"switchhead_cbt_cn", "switchhead_cbt_ne"}

SYNTHETIC = " \n = A = \n \n a b . \n \n = B = \n \n c d . \n \n"
SYNTHETIC_PAGES = [" = A = \n \n a b . \n ", " = B = \n \n c d . \n \n"]  # the dataset's definition


@pytest.fixture(autouse=True, scope="module")
def quiet_and_compiled_once():
    """lm-eval logs a warning and draws a progress bar per task: keep the test output readable. It also compiles
    a task's Jinja templates again for every document (milliseconds each, most of the time of this module);
    here each template text is compiled once, in lm-eval's own environment, which changes no rendered string."""
    import lm_eval.utils

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as patch:
        compile_once = functools.lru_cache(maxsize=None)(lm_eval.utils.env.from_string)
        patch.setattr(lm_eval.utils.env, "from_string", compile_once)
        yield
    logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------- WikiText pages
def reference_wikitext_pages(text: str) -> list[str]:
    """The page rule of the document-level WikiText dataset, line by line.

    Lines are the pieces of `text.split("\\n")`. A title line (after collapsing "= = =" to "===" and "= =" to
    "==", stripped, it starts with "= " and ends with " =") closes the lines gathered so far: joined with "\\n"
    they are a page unless they are only whitespace. The lines left at the end are always the last page.
    """
    pages, gathered = [], []
    for line in text.split("\n"):
        squeezed = line.replace("= = =", "===").replace("= =", "==").strip()
        if squeezed.startswith("= ") and squeezed.endswith(" ="):
            candidate = "\n".join(gathered)
            if candidate.strip() != "":
                pages.append(candidate)
            gathered = []
        gathered.append(line)
    pages.append("\n".join(gathered))
    return pages


def test_synthetic_file_pages_match_the_document_level_dataset():
    assert reference_wikitext_pages(SYNTHETIC) == SYNTHETIC_PAGES
    assert task_data.split_wikitext_pages(SYNTHETIC) == SYNTHETIC_PAGES


def test_page_splitting_matches_the_reference_on_random_files():
    pieces = [" = T = ", " = = S = = ", " = = = U = = = ", " ", "", " a b . ", "x = y = z", " = ", "=", " = x = = y = ",
              "\t= W =\t", " = Z = \r"]
    rng = random.Random(0)
    for _ in range(2000):
        text = "\n".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) + rng.choice(["", "\n", "\n\n"])
        assert task_data.split_wikitext_pages(text) == reference_wikitext_pages(text), repr(text)


@pytest.mark.parametrize("corpus", ["wikitext-2", "wikitext-103"])
@pytest.mark.parametrize("split", ["test", "valid"])
def test_real_wikitext_pages_match_the_document_level_dataset(corpus, split, shared_data):
    text = (shared_data / corpus / f"wiki.{split}.tokens").read_text(encoding="utf-8")
    pages = [row["page"] for row in task_data.wikitext_documents(corpus, split, {"data_dir": str(shared_data)})]
    assert pages == reference_wikitext_pages(text)
    if split == "test":
        assert len(pages) == 62  # the test split of both has 62 articles
    # first page: the file's leading " \n" is not part of it; it starts at the title itself
    assert text.startswith(" \n = ") and pages[0].startswith(" = ") and not pages[0].startswith(" \n")
    assert task_data.is_article_title(pages[0].split("\n")[0])
    # last page: ends with the file's final newline
    assert text.endswith(" \n") and pages[-1].endswith(" \n") and text.endswith(pages[-1])
    # every page starts with its title, and the pages with the newline between them rebuild the file
    assert all(task_data.is_article_title(page.split("\n")[0]) for page in pages)
    assert " \n" + "\n".join(pages) == text


# ---------------------------------------------------------------------------------------------------- parity
class LocalHub:
    """Stands in for `datasets.load_dataset`: the Hub datasets of lm-eval's built-in tasks, read from local files.

    Each dataset is served with the splits and fields it has on the Hub, so that the built-in YAML files run
    unchanged. WikiText pages come from `reference_wikitext_pages`, not from the code under test.
    """

    def __init__(self, shared_data: Path, wikitext_corpus: str = "wikitext-2"):
        self.shared_data, self.wikitext_corpus, self.requested = shared_data, wikitext_corpus, []

    def _jsonl(self, path: Path) -> list[dict]:
        with open(path, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def __call__(self, path=None, name=None, **kwargs):
        self.requested.append((path, name))
        if (path, name) == ("EleutherAI/lambada_openai", "default"):
            rows = self._jsonl(self.shared_data / "lambada" / "lambada_test.jsonl")
            return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
        if path == "nyu-mll/blimp":
            rows = self._jsonl(self.shared_data / "blimp" / f"{name}.jsonl")
            return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
        if (path, name) == ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1"):
            folder = self.shared_data / self.wikitext_corpus
            splits = {}
            for split, stem in (("train", "train"), ("validation", "valid"), ("test", "test")):
                file = folder / f"wiki.{stem}.tokens"
                # WikiText-103 train is not in ../shared/data: an empty train split (the built-in task only
                # draws few-shot examples from it, and it runs zero-shot)
                pages = reference_wikitext_pages(file.read_text(encoding="utf-8")) if file.is_file() else []
                splits[split] = datasets.Dataset.from_dict({"page": pages})
            return datasets.DatasetDict(splits)
        raise AssertionError(f"lm-eval asked for an unexpected dataset {path!r} / {name!r}")


def builtin_tasks(monkeypatch, shared_data: Path, names: list[str], wikitext_corpus: str = "wikitext-2") -> dict:
    """lm-eval's own built-in tasks `names` (loaded by its TaskManager), reading the local files."""
    from lm_eval.tasks import TaskManager

    hub = LocalHub(shared_data, wikitext_corpus)
    folders = [LM_EVAL_TASKS_DIR / folder for folder in ("lambada", "blimp", "wikitext")]
    with monkeypatch.context() as patch:
        patch.setattr(datasets, "load_dataset", hub)
        loaded = TaskManager(include_defaults=False, include_path=folders).load(names)
    assert hub.requested, "the built-in tasks did not read through the local source"
    return loaded


def our_tasks(shared_data: Path, names: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_defaults=False, include_path=str(TASKS_DIR), metadata={"data_dir": str(shared_data)})
    return manager.load(names)


def requests_of(task) -> list[tuple]:
    """Every request the task sends to a model: (document index, request type, arguments, choice index)."""
    task.build_all_requests()
    return [(r.doc_id, r.request_type, r.arguments, r.idx) for r in task.instances]


def assert_same_requests(ours, theirs, expected_docs: int):
    assert len(ours.eval_docs) == len(theirs.eval_docs) == expected_docs
    assert ours.OUTPUT_TYPE == theirs.OUTPUT_TYPE
    assert ours.config.target_delimiter == theirs.config.target_delimiter
    assert ours.config.fewshot_delimiter == theirs.config.fewshot_delimiter
    assert (ours.config.num_fewshot or 0) == (theirs.config.num_fewshot or 0) == 0
    mine, reference = requests_of(ours), requests_of(theirs)
    assert len(mine) == len(reference)
    for a, b in zip(mine, reference):
        assert a == b, f"{ours.config.task} vs {theirs.config.task}: document {b[0]} differs: {a} != {b}"


def test_lambada_every_passage_builds_lambada_openai_requests(monkeypatch, shared_data):
    ours = our_tasks(shared_data, ["switchhead_lambada"])["tasks"]["switchhead_lambada"]
    theirs = builtin_tasks(monkeypatch, shared_data, ["lambada_openai"])["tasks"]["lambada_openai"]
    assert_same_requests(ours, theirs, 5153)
    for doc_ours, doc_theirs in zip(ours.eval_docs, theirs.eval_docs):
        assert ours.doc_to_text(doc_ours) == theirs.doc_to_text(doc_theirs)
        assert ours.doc_to_target(doc_ours) == theirs.doc_to_target(doc_theirs)
    assert ours.aggregation() == theirs.aggregation() and list(ours.aggregation()) == ["perplexity", "acc"]
    assert ours.higher_is_better() == theirs.higher_is_better()


@pytest.mark.integration
def test_blimp_every_paradigm_and_pair_builds_the_builtin_requests(monkeypatch, shared_data):
    theirs = builtin_tasks(monkeypatch, shared_data, ["blimp"])
    ours = our_tasks(shared_data, ["switchhead_blimp"])
    paradigms = sorted(name[len("blimp_"):] for name in theirs["tasks"])
    assert len(paradigms) == 67
    assert sorted(name[len("switchhead_blimp_"):] for name in ours["tasks"]) == paradigms
    # the group score: unweighted mean of the paradigms' acc
    assert theirs["groups"]["blimp"].aggregate_metric_list == ours["groups"]["switchhead_blimp"].aggregate_metric_list
    for paradigm in paradigms:
        mine, reference = ours["tasks"][f"switchhead_blimp_{paradigm}"], theirs["tasks"][f"blimp_{paradigm}"]
        # target and choices are the same definition for every pair (the choices' text is in the requests)
        assert mine.config.doc_to_target == reference.config.doc_to_target == 0
        assert mine.config.doc_to_choice == reference.config.doc_to_choice
        assert_same_requests(mine, reference, 1000)
        doc_mine, doc_reference = mine.eval_docs[0], reference.eval_docs[0]
        assert mine.doc_to_choice(doc_mine) == reference.doc_to_choice(doc_reference)
        assert mine.doc_to_target(doc_mine) == reference.doc_to_target(doc_reference) == 0
        assert mine.aggregation() == reference.aggregation()


@pytest.mark.parametrize("ours_name,corpus", [("switchhead_wikitext2", "wikitext-2"),
                                              ("switchhead_wikitext103", "wikitext-103")])
def test_wikitext_every_article_builds_the_builtin_rolling_requests(monkeypatch, shared_data, ours_name, corpus):
    """lm-eval's `wikitext` (WikiText-2); for WikiText-103 the same built-in definition given the 103 files."""
    ours = our_tasks(shared_data, [ours_name])["tasks"][ours_name]
    theirs = builtin_tasks(monkeypatch, shared_data, ["wikitext"], corpus)["tasks"]["wikitext"]
    assert_same_requests(ours, theirs, 62)
    for doc_ours, doc_theirs in zip(ours.eval_docs, theirs.eval_docs):
        assert doc_ours["page"] == doc_theirs["page"]
        # the per-document word and byte counts of the metrics, for any log-likelihood
        assert ours.process_results(doc_ours, [-123.5]) == theirs.process_results(doc_theirs, [-123.5])
    assert ours.aggregation() == theirs.aggregation()
    assert ours.higher_is_better() == theirs.higher_is_better()


def test_every_task_of_our_folder_is_compared_except_cbt():
    from lm_eval.tasks import TaskManager

    ours = set(TaskManager(include_defaults=False, include_path=str(TASKS_DIR)).all_subtasks)
    blimp = {task for task in ours if task.startswith("switchhead_blimp_")}
    assert len(blimp) == 67
    assert ours - blimp == {task for task in COVERED if not task.endswith("*")} | NOT_COVERED
