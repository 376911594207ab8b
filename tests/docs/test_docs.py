"""The documentation is checked, not just written: the README and the site under docs/ (mkdocs.yml).

- `mkdocs build --strict` passes: no broken link or anchor, no missing page, no API reference that fails to
  resolve, no generated table (docs/_hooks/build.py) that fails to build.
- The built HTML references only files that exist (images, stylesheets, scripts, pages).
- Every picture a page shows names the command that regenerates it.
- Every fenced Python example marked `<!-- runnable -->` (the line before its fence) in README.md and docs/ runs,
  offline, in a fresh folder, in a process of its own (tests/docs/examples_runner.py).
- Every `switchhead ...` command line shown (shell code blocks, parsed in full; inline code, its options) is
  accepted by the real parser of that subcommand (`switchhead.cli.build_parser`): parsed, not run.
- Relative links of README.md point at files that exist.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
RUNNABLE = "<!-- runnable -->"
EXAMPLE_TIMEOUT = 240  # seconds per example (a tiny Trainer run is the slowest, a few seconds alone)
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}


def documentation_files() -> list[Path]:
    """Every Markdown file under docs/, then README.md (whose quickstart repeats the home page's)."""
    return [*sorted(DOCS.rglob("*.md"), key=str), REPO / "README.md"]


def fenced_blocks(path: Path):
    """(language, first line number, code, marked runnable) of each fenced block of a Markdown file; fences may be
    indented (inside a list) and use ``` or ~~~."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        yield language.lower(), i + 2, "\n".join(body) + "\n", previous == RUNNABLE
        i = j + 1


def runnable_examples() -> list[dict]:
    """The runnable examples, each once (the README repeats the home page's quickstart)."""
    examples, seen = [], set()
    for path in documentation_files():
        for language, line, code, runnable in fenced_blocks(path):
            if runnable and code not in seen:
                assert language == "python", f"{path}:{line}: only Python examples can be marked runnable"
                seen.add(code)
                examples.append({"name": f"{path.relative_to(REPO)}:{line}", "code": code})
    return examples


EXAMPLES = runnable_examples()


# --------------------------------------------------------------------------------------------- the site build
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(site_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    problems = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or [done.stderr[-4000:]])
    return site_dir


@pytest.mark.integration
def test_site_builds_strictly_with_every_page_of_the_nav(site):
    import yaml

    config = yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    pages = [next(iter(entry.values())) for entry in config["nav"]]
    for page in pages:
        assert (site / page.replace(".md", ".html")).is_file(), page
    # the generated parts were filled in: the configuration reference lists the fields, the CLI page every command
    configuration = (site / "configuration.html").read_text(encoding="utf-8")
    assert "num_attention_experts_per_tok" in configuration and "wt103-47m-switchhead-xl" in configuration
    assert "usage: switchhead serve" in (site / "cli.html").read_text(encoding="utf-8")
    html = "".join(p.read_text(encoding="utf-8") for p in site.glob("*.html"))
    assert not re.search(r"<!--\s*(generated:|include:|ratio-table)", html), "a marker was left unfilled"


class _References(HTMLParser):
    """The local files an HTML page points at: img/script src, link href, a href (without #fragments)."""

    ATTRIBUTES = {"img": "src", "script": "src", "link": "href", "a": "href", "source": "src"}

    def __init__(self):
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
        value = dict(attrs).get(self.ATTRIBUTES.get(tag, ""))
        if value:
            self.targets.append(value)


@pytest.mark.integration
def test_built_html_references_only_files_that_exist(site):
    missing, checked = [], 0
    for page in site.rglob("*.html"):
        parser = _References()
        parser.feed(page.read_text(encoding="utf-8"))
        for target in parser.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or not parts.path:  # another site, mailto:, data:, or #anchor only
                continue
            base = site if parts.path.startswith("/") else page.parent  # 404.html links from the site's root
            path = (base / unquote(parts.path).lstrip("/")).resolve()
            checked += 1
            if not (path.is_file() or (path / "index.html").is_file()):
                missing.append(f"{page.relative_to(site)} -> {target}")
    assert checked > 100
    assert not missing, "the built site references files that do not exist:\n" + "\n".join(missing)


def test_every_picture_names_the_command_that_regenerates_it():
    unexplained = []
    for path in sorted(DOCS.glob("*.md")):
        sections = re.split(r"^#{1,6} ", path.read_text(encoding="utf-8"), flags=re.M)
        for section in sections:
            for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section):
                if not re.search(r"`(python|bash|switchhead)\s[^`]+`", section):
                    unexplained.append(f"{path.name}: {image}")
    assert not unexplained, "pictures without the command that regenerates them:\n" + "\n".join(unexplained)


def test_every_picture_renders_where_the_repository_is_read():
    """A page read on GitHub resolves its pictures against the repository, not the built site (whose `results/`
    folder is generated): every picture is a file relative to its page."""
    broken = [f"{path.name}: {image}" for path in sorted(DOCS.glob("*.md"))
              for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", path.read_text(encoding="utf-8"))
              if not urlsplit(image).scheme and not (path.parent / unquote(urlsplit(image).path)).is_file()]
    assert not broken, "pictures that do not exist beside their page:\n" + "\n".join(broken)


# ------------------------------------------------------------------------------------------ runnable examples
@pytest.fixture(scope="module")
def example_results(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("examples")
    (folder / "examples.json").write_text(json.dumps(EXAMPLES), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(Path(__file__).with_name("examples_runner.py")), str(folder / "examples.json"),
                    str(folder / "results.json"), str(EXAMPLE_TIMEOUT)],
                   cwd=folder, env=env, check=True, timeout=EXAMPLE_TIMEOUT * (len(EXAMPLES) + 1))
    return json.loads((folder / "results.json").read_text(encoding="utf-8"))


def test_the_docs_have_runnable_examples():
    names = " ".join(example["name"] for example in EXAMPLES)
    for page in ("index.md", "model.md", "configuration.md", "kernels.md", "serving.md"):
        assert page in names, f"docs/{page} has no runnable example"


@pytest.mark.integration
@pytest.mark.parametrize("name", [example["name"] for example in EXAMPLES])
def test_runnable_example_runs(name, example_results):
    result = example_results[name]
    assert result["status"] == "passed", f"{name} {result['status']} after {result['seconds']} s:\n{result['output']}"


# ------------------------------------------------------------------------------------------ command lines
def _logical_lines(code: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    return code.replace("\\\n", " ").splitlines()


def _commands_in_shell_line(line: str) -> list[list[str]]:
    """The argument lists after `switchhead` (or `-m switchhead.cli`) in one shell line, `$(...)` included."""
    found = [argv for inner in re.findall(r"\$\((switchhead [^)]*)\)", line) for argv in _commands_in_shell_line(inner)]
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # unbalanced quotes: not a command line
        return found
    for i, token in enumerate(tokens):
        if token == "switchhead" or (token == "switchhead.cli" and i and tokens[i - 1] == "-m"):
            argv = []
            for word in tokens[i + 1:]:
                if word in {";", "&&", "||", "|", ">", "2>"}:
                    break
                argv.append(word)
            found.append(argv)
    return found


def shown_commands() -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """(where, argv) of full command lines in shell blocks, and of inline `switchhead ...` code spans."""
    full, inline = [], []
    for path in documentation_files():
        name = path.relative_to(REPO)
        for language, line, code, _ in fenced_blocks(path):
            if language in SHELL_FENCES:
                for offset, text in enumerate(_logical_lines(code)):
                    full += [(f"{name}:{line + offset}", argv) for argv in _commands_in_shell_line(text)]
        text = re.sub(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
        for span in re.findall(r"`(switchhead [^`]+)`", text):
            argv = shlex.split(span, comments=False) if span.count('"') % 2 == 0 else span.split()
            if len(argv) > 1 and re.fullmatch(r"[a-z][a-z-]*", argv[1]):
                inline.append((f"{name}: `{span}`", argv[1:]))
    return full, inline


@pytest.fixture(scope="module")
def parser():
    from switchhead.cli import build_parser

    return build_parser()


def _subparsers(parser) -> dict:
    return parser._subparsers._group_actions[0].choices if parser._subparsers else {}


def _parse(parser, argv: list[str]) -> str | None:
    """None when the parser accepts argv, else its one-line error."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as stop:
        if stop.code:
            return stderr.getvalue().strip() or f"exit {stop.code}"
    return None


def _options(parser) -> set[str]:
    """Every option string of a (sub)command, and of its own subcommands (convert's directions)."""
    options = set(parser._option_string_actions)
    for child in _subparsers(parser).values():
        options |= _options(child)
    return options


FULL_COMMANDS, INLINE_COMMANDS = shown_commands()


def test_the_docs_show_command_lines():
    assert len(FULL_COMMANDS) > 30 and len(INLINE_COMMANDS) > 10


@pytest.mark.parametrize("where, argv", FULL_COMMANDS, ids=[where for where, _ in FULL_COMMANDS])
def test_shown_command_line_is_accepted_by_the_parser(where, argv, parser):
    assert argv and argv[0] in _subparsers(parser), f"{where}: unknown subcommand in `switchhead {' '.join(argv)}`"
    error = _parse(parser, argv)
    assert error is None, f"{where}: `switchhead {' '.join(argv)}` is refused by the parser: {error}"


@pytest.mark.parametrize("where, argv", INLINE_COMMANDS, ids=[where for where, _ in INLINE_COMMANDS])
def test_inline_command_uses_only_options_of_its_subcommand(where, argv, parser):
    subcommands = _subparsers(parser)
    assert argv[0] in subcommands, f"{where}: `switchhead {argv[0]}` is not a subcommand"
    known = _options(subcommands[argv[0]])
    unknown = [word.split("=")[0] for word in argv[1:] if word.startswith("-") and word.split("=")[0] not in known]
    assert not unknown, f"{where}: options unknown to `switchhead {argv[0]}`: {', '.join(unknown)}"


# ---------------------------------------------------------------------------------------------- the README
def test_readme_links_point_at_files_that_exist():
    document = "README.md"
    path = REPO / document
    text = re.sub(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or not parts.path:
            continue
        if not (REPO / unquote(parts.path)).exists():  # read from the repository root, where the README lives
            missing.append(target)
    assert not missing, f"{document} links to files that do not exist: {', '.join(missing)}"
