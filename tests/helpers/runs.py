"""Real text for training runs: WikiText-2's validation file from ../shared/data and a BPE tokenizer trained on it
once per test module."""

import pytest

from switchhead.training import train_tokenizer
from switchhead.training.data import load_documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from helpers.data import require

    data = require("wikitext-2") / "wikitext-2" / "wiki.valid.tokens"
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(load_documents(str(data))[0], 512).save_pretrained(folder)
    return str(data), str(folder)
