"""mkdocs hooks of the switchhead documentation (`hooks:` in mkdocs.yml): what the pages read from the code and
from the benchmark results, written into the pages and refreshed whenever the site is built.

- API reference: griffe (mkdocstrings-python) reads the package's sources from a tree of links laid out as the
  package installs (`switchhead` <- modeling_switchhead/, `switchhead.kernels` <- kernels/, ... from setup.py's
  SUBPACKAGES: scripts/package_tree.py), built in a temporary folder.
- `<!-- generated: NAME -->` in a page is replaced by a table made from the code: `config-fields` (every field
  of SwitchHeadConfig: type, default, the rule `_FIELD_RULES` holds for it, its docstring entry),
  `config-checks` (the cross-field checks), `presets` (every preset, its shape and parameter count), `cli` (the
  `--help` of every `switchhead` subcommand, from the real parser).
- `<!-- include: benchmarks/results/[FOLDER/]NAME.md -->` is replaced by that results file: its title dropped, its
  section headings as bold lines (out of the page's table of contents), its images pointing at the site's copy.
- `<!-- ratio-table ... -->` is replaced by a table of SwitchHead / dense ratios read from the results' JSON files
  (one row per line: `label | file | RoPE values | XL values | text...`; values are dotted paths into the JSON,
  several joined by ` / `, `FILE:path` for another file; a number indexes a list, as in `pairs.0.ratios`).
- benchmarks/results/*.png and every .md under it become the site's `results/` folder, CHANGELOG.md its
  `changelog.md` page.

What the three markers stand for is also committed in the pages, between the marker and `<!-- end of generated
text -->`, so that a page reads the same on GitHub, in a checkout and on the site: `python docs/_hooks/build.py`
rewrites it, `python docs/_hooks/build.py --check` lists the pages whose copy is out of date (a test runs it). The
site is built from the same functions, so it never shows a stale copy either.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import posixpath
import re
import sys
import tempfile
from pathlib import Path

try:  # the site build; the page rewriting below (`python docs/_hooks/build.py`) needs no mkdocs
    from mkdocs.plugins import event_priority
    from mkdocs.structure.files import File, Files
except ImportError:
    def event_priority(priority):
        return lambda function: function

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import package_tree  # noqa: E402 - scripts/package_tree.py: the package as it installs, as links
RESULTS = REPO / "benchmarks" / "results"
_OPENER = re.compile(r"<!--\s*(?:generated:\s*(?P<generated>[\w-]+)\s*|include:\s*(?P<include>\S+)\s*|"
                     r"ratio-table\s*\n(?P<ratio>.*?))-->", re.S)
END = "<!-- end of generated text -->"
_api_tree: tempfile.TemporaryDirectory | None = None


# --------------------------------------------------------------------------------------------- the API sources
def _build_api_tree() -> str:
    """A folder holding `switchhead/` as it installs (scripts/package_tree.py), for griffe to read statically."""
    global _api_tree
    _api_tree = tempfile.TemporaryDirectory(prefix="switchhead-docs-api-")
    package_tree.link_tree(_api_tree.name)
    return _api_tree.name


@event_priority(100)  # before mkdocstrings creates its Python handler
def on_config(config):
    handlers = config.plugins["mkdocstrings"].config.handlers
    python = handlers.setdefault("python", {})
    python["paths"] = [_build_api_tree()]
    return config


def on_shutdown():
    if _api_tree is not None:
        _api_tree.cleanup()


# ----------------------------------------------------------------------------- results and changelog as files
def on_files(files, config):
    for path in sorted(RESULTS.glob("*.png")) + sorted(RESULTS.rglob("*.md")):  # with the run folders' pages
        files.append(File.generated(config, f"results/{path.relative_to(RESULTS).as_posix()}",
                                    abs_src_path=str(path)))
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "changelog.md", content=changelog))
    return files


# ------------------------------------------------------------------------------------------- generated tables
def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _docstring_args(cls) -> dict[str, str]:
    """The `Args:` entries of a Google-style class docstring, one line each."""
    args, name, inside = {}, None, False
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        if line.strip() == "Args:":
            inside = True
            continue
        if inside:
            entry = re.match(r"^ {4}(\w+): (.*)$", line)
            if entry:
                name, args[entry.group(1)] = entry.group(1), entry.group(2)
            elif line.startswith("        ") and name:
                args[name] += " " + line.strip()
            elif line.strip():
                break
    return args


def _rule_text(rule, name: str) -> str:
    """What a `_FIELD_RULES` rule accepts, in its own message's words ("must be >= 1")."""
    text = (rule.out_of_range or rule.wrong_type).format(name=name, value="VALUE")
    text = re.sub(r",? got 'VALUE'$", "", text)
    return text[text.index("must"):] if "must" in text else text


def _config_fields() -> str:
    from switchhead import configuration_switchhead as module

    cls = module.SwitchHeadConfig
    own = cls.__dict__.get("__annotations__", {})  # the fields this class declares, not PreTrainedConfig's
    described = _docstring_args(cls)
    rows = ["| field | type | default | accepted values | meaning |", "|---|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name not in own:
            continue
        default = field.default if field.default is not dataclasses.MISSING else "(required)"
        rule = module._FIELD_RULES.get(field.name)
        accepted = _rule_text(rule, field.name) if rule else "see the cross-field checks below"
        rows.append(f"| `{field.name}` | {_cell(own[field.name])} | `{default!r}` | {_cell(accepted)} | "
                    f"{_cell(described.get(field.name, '-'))} |")
    return "\n".join(rows)


def _raised_messages(function) -> list[str]:
    """The messages of a function's `raise ValueError(...)`, f-string fields shown as `{expression}`."""
    def text(node) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.JoinedStr):
            return "".join(text(part) for part in node.values)
        if isinstance(node, ast.FormattedValue):
            conversion = {-1: "", 114: "!r", 115: "!s", 97: "!a"}[node.conversion]
            return "{" + ast.unparse(node.value) + conversion + "}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return text(node.left) + text(node.right)
        return "{" + ast.unparse(node) + "}"

    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(function)))
    return [text(node.exc.args[0]) for node in ast.walk(tree)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args]


def _config_checks() -> str:
    from switchhead import configuration_switchhead as module

    lines = []
    for check in module._CROSS_FIELD_CHECKS:
        title = check.__name__.strip("_").replace("_", " ")
        doc = inspect.cleandoc(check.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        lines.append(f"1. **{title}** (`{check.__name__}`)" + (f": {doc}" if doc else ""))
        lines += [f"    - `{_cell(message)}`" for message in _raised_messages(check)]
    return "\n".join(lines)


def _presets() -> str:
    import torch

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.training.paper import PAPER_TRAINING

    rows = ["| preset | attention | positions | MLP | d | L | H | E | k | dh | parameters | paper training "
            "(context, batch, lr, steps, clip) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in SwitchHeadConfig.preset_names():
        config = SwitchHeadConfig.from_preset(name)
        with torch.device("meta"):  # counts parameters without allocating them
            count = sum(p.numel() for p in SwitchHeadForCausalLM(config).parameters())
        moe = config.attention_type == "switchhead"
        mlp = (f"sigma-MoE {config.num_mlp_experts}x{config.mlp_expert_size}, k={config.num_mlp_experts_per_tok}"
               if config.mlp_type == "sigma_moe" else f"dense {config.intermediate_size}")
        training = PAPER_TRAINING.get(name)
        paper = (f"{training['context']}, {training['batch_size']}, {training['learning_rate']:g}, "
                 f"{training['steps']:,}, {training['grad_clip']:g}" if training else "-")
        rows.append(f"| `{name}` | {config.attention_type} | {config.position_encoding} | {mlp} | "
                    f"{config.hidden_size} | {config.num_hidden_layers} | {config.num_attention_heads} | "
                    f"{config.num_attention_experts if moe else '-'} | "
                    f"{config.num_attention_experts_per_tok if moe else '-'} | {config.head_dim} | "
                    f"{count / 1e6:.2f}M | {paper} |")
    return "\n".join(rows)


def _cli() -> str:
    from unittest import mock

    from switchhead.cli import build_parser, serve

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "110"  # argparse wraps the help to this width
    # the help names the install command of the installation it runs from (switchhead.install_command); the page
    # shows a checkout's, whatever environment builds it, so that it reads the same wherever it is regenerated
    checkout = mock.patch.object(serve, "install_command", lambda extra: f'pip install -e ".[{extra}]"')
    try:
        checkout.start()
        parser = build_parser()
        subcommands = parser._subparsers._group_actions[0].choices
        parts = []
        for name, sub in subcommands.items():
            parts.append(f"## switchhead {name}\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    finally:
        checkout.stop()
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


GENERATORS = {"config-fields": _config_fields, "config-checks": _config_checks, "presets": _presets, "cli": _cli}


def _generate(name: str) -> str:
    if name not in GENERATORS:
        raise ValueError(f"unknown generated table {name!r}; one of {', '.join(GENERATORS)}")
    return GENERATORS[name]()


def _include(target: str, page_uri: str) -> str:
    path = (REPO / target).resolve()
    if RESULTS not in path.parents or path.suffix != ".md" or not path.is_file():
        raise ValueError(f"include: {target!r} is not a Markdown file under benchmarks/results/")
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^# .*\n", "", text, count=1, flags=re.M)  # the file's title: the page introduces it
    text = re.sub(r"^#{2,6} (.*)$", r"**\1**", text, flags=re.M)  # its sections: bold lines, not page headings
    # its links as the page in the repository reads them (docs/PAGE -> ../benchmarks/results/...); the site build
    # turns those into its own results/ folder (_site_results_links)
    folder = path.parent.relative_to(REPO).as_posix()
    results = posixpath.relpath(folder, posixpath.dirname(posixpath.join("docs", page_uri)))
    return re.sub(r"\]\(([\w.-]+\.(?:png|md))\)", lambda m: f"]({results}/{m.group(1)})", text)


def _json_value(spec: str, default_file: str):
    file, _, path = spec.rpartition(":") if ":" in spec else (default_file, "", spec)
    value = json.loads((RESULTS / (file or default_file)).read_text(encoding="utf-8"))
    for key in path.strip().split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]  # a list: its index (pairs.0)
    return value


def _ratio_table(body: str) -> str:
    lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
    header = [cell.strip() for cell in lines[0].removeprefix("columns:").split("|")]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for line in lines[1:]:
        label, file, *cells = [cell.strip() for cell in line.split("|")]
        values = [" / ".join(f"{_json_value(spec, file):.2f}" for spec in cell.split(" / ")) for cell in cells[:2]]
        rows.append("| " + " | ".join([label, *values, *cells[2:]]) + " |")
    return "\n".join(rows)


def _site_results_links(markdown: str, page_uri: str) -> str:
    """The pages link results where the repository keeps them (`../benchmarks/results/NAME`, which GitHub renders);
    on the site those files are the generated `results/` folder (on_files)."""
    results = posixpath.relpath("results", posixpath.dirname(page_uri) or ".")
    return re.sub(r"\]\(\.\./benchmarks/results/([\w./-]+\.(?:png|md|json)(?:#[\w-]*)?)\)",
                  lambda m: f"]({results}/{m.group(1)})", markdown)


def fill(markdown: str, page_uri: str) -> str:
    """`markdown` (the page docs/`page_uri`) with what each marker stands for written after it, up to END: the
    copy there before (if any) replaced."""
    parts, position = [], 0
    while (opener := _OPENER.search(markdown, position)) is not None:
        parts.append(markdown[position:opener.end()])
        if opener.group("generated"):
            body = _generate(opener.group("generated"))
        elif opener.group("include"):
            body = _include(opener.group("include"), page_uri)
        else:
            body = _ratio_table(opener.group("ratio"))
        end = markdown.find(END, opener.end())
        following = _OPENER.search(markdown, opener.end())
        old_copy = end != -1 and (following is None or end < following.start())
        parts.append("\n" + body.strip("\n") + "\n" + END)
        position = end + len(END) if old_copy else opener.end()
    return "".join(parts) + markdown[position:]


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    markdown = fill(markdown, uri)
    markdown = _OPENER.sub("", markdown).replace(END, "")  # the site's HTML carries no marker
    return _site_results_links(markdown, uri)


def pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated copies in docs/*.md, or with --check list the pages whose copy is out of date."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        current = fill(text, page.name)
        if current != text:
            stale.append(page.relative_to(REPO).as_posix())
            if not args.check:
                page.write_text(current, encoding="utf-8")
    verb = "out of date" if args.check else "rewritten"
    for name in stale:
        print(f"{name}: {verb}")
    if args.check and stale:
        print("regenerate with: python docs/_hooks/build.py")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
