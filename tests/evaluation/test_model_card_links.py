"""The model card says what made the folder (this package) and links the paper and the paper's code (the authors'
repository) as what they are; its usage section says what happens without `import switchhead`."""

from __future__ import annotations

import re

import pytest

from switchhead import SwitchHeadConfig
from switchhead.model_card import render_card

PAPER = "https://arxiv.org/abs/2312.07987"
AUTHORS_CODE = "https://github.com/RobertCsordas/switchhead"


@pytest.fixture(params=["tiny-switchhead", "tiny-switchall"])
def card(request):
    config = SwitchHeadConfig.from_preset(request.param, vocab_size=256)
    return str(render_card(config, model_name="m", repo_id="me/m"))


def _links(text: str) -> list[tuple[str, str, int]]:
    """(link text, target, offset) of every Markdown link of the card, outside code blocks."""
    prose = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), text, flags=re.S)
    return [(m.group(1), m.group(2), m.start()) for m in re.finditer(r"\[([^\]]+)\]\(([^)\s]+)\)", prose)]


def test_card_links_only_the_paper_and_the_authors_code_each_as_what_it_is(card):
    links = {target: (label, at) for label, target, at in _links(card)}
    assert set(links) == {PAPER, AUTHORS_CODE}, links
    label, at = links[AUTHORS_CODE]
    before, after = card[:at].rsplit(";", 1)[-1], card[at:].split(".\n", 1)[0]  # the clause of the link
    sentence = " ".join((before + after).split())
    assert "the paper's code is the authors' repository" in sentence and "did not" in sentence, sentence
    assert "NeurIPS 2024" in links[PAPER][0]


def test_card_names_this_package_as_what_made_the_folder(card):
    assert "made by the `switchhead` package" in card
    assert "format of the [switchhead]" not in card and "switchhead integration" not in card


def test_card_says_what_happens_without_import_switchhead(card):
    usage = card[card.index("## Usage"):card.index("## Documentation")]
    assert "contains custom code" in usage and "import switchhead" in usage and "trust_remote_code=True" in usage
