"""`switchhead eval`, `switchhead flops`, `switchhead card` and `switchhead publish`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .common import UsageError, check_device, parse_field_assignments, refuse_existing_output


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help="zero-shot tasks (lm-eval), perplexity and analysis plots for a saved model",
        description="Evaluate a save_pretrained folder: zero-shot LAMBADA / BLiMP / CBT / WikiText through lm-eval "
                    "with the task folder shipped in this package (or the authors' protocol), perplexity / bits per "
                    "byte on a text file, and attention / expert-selection plots. Everything runs offline.")
    parser.add_argument("model", nargs="?", help="model folder (with its tokenizer)")
    parser.add_argument("--tasks", nargs="?", const="list", metavar="NAMES",
                        help="comma-separated zero-shot tasks: lambada (lm-eval's lambada_openai), blimp (blimp, 67 "
                             "paradigms), wikitext (lm-eval's wikitext: WikiText-2 test; wikitext2 is the same), "
                             "wikitext103, cbt, cbt_cn, cbt_ne (no lm-eval counterpart), or switchhead_* task names; "
                             "'none' for none. Default: lambada,blimp,wikitext, but no zero-shot tasks when "
                             "--perplexity or --plots is given. '--tasks' alone or '--tasks list' prints each name "
                             "with its lm-eval counterpart and the data it reads, and exits")
    parser.add_argument("--blimp-paradigms", help="comma-separated BLiMP paradigms instead of all 67")
    parser.add_argument("--protocol", choices=("lm-eval", "paper"), default="lm-eval",
                        help="'paper': the authors' scoring for LAMBADA, BLiMP and CBT (CBT: mean log-probability "
                             "per token); WikiText always uses lm-eval")
    parser.add_argument("--limit", type=_limit, help="examples per task (an integer, or a fraction < 1)")
    parser.add_argument("--data-dir", help="folder with lambada/, blimp/, wikitext-2/, wikitext-103/, cbt/ "
                                           "(default: $SWITCHHEAD_DATA_DIR, else the checkout's ../shared/data)")
    parser.add_argument("--cbt-dir", help="folder with cbtest_CN_test_2500ex.txt and cbtest_NE_test_2500ex.txt")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="sequences scored per forward pass, for the tasks and perplexity (8)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N, mps (cpu)")
    parser.add_argument("--perplexity", action="append", default=[], metavar="FILE",
                        help="text file (.txt, .tokens, .jsonl 'text' field) to score; repeatable")
    parser.add_argument("--ppl-protocol", choices=("sliding", "chunked"), default="sliding",
                        help="perplexity windows: 'sliding' (overlapping, each token scored once with as much "
                             "context as --stride leaves) or 'chunked' (disjoint blocks of --context tokens)")
    parser.add_argument("--context", type=int, help="perplexity window (default: max_position_embeddings)")
    parser.add_argument("--stride", type=int, help="sliding-window stride (default: context / 2)")
    parser.add_argument("--plots", metavar="DIR", help="write attention and expert-selection PNGs for --text here")
    parser.add_argument("--text", default="The cat sat on the mat because it was tired of standing.",
                        help="text for --plots")
    parser.add_argument("--output", metavar="FILE", help="write the results as JSON (input of `switchhead card`)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output file and existing --plots PNGs of the same names")
    parser.add_argument("--no-verify", action="store_true",
                        help="evaluate a training run's folder even when its SHA-256 manifest does not verify")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the folder's own Python files (an auto_map in its config or tokenizer config); "
                             "without it such a folder is refused")
    parser.add_argument("--task-dir", action="store_true", help="print the lm-eval task folder (for "
                                                                "--include_path) and exit")
    parser.set_defaults(handler=run_eval)

    parser = subparsers.add_parser(
        "flops", help="per-layer attention MACs / memory (the paper's accounting), model MACs, KV cache",
        description="MAC and memory accounting of a configuration, per attention layer and sequence, with the "
                    "formula the paper's tables used and the printed Eq. 13 labelled, plus whole-model forward "
                    "MACs and KV-cache bytes per token.")
    parser.add_argument("config", help="a preset name (`switchhead train --list-presets` lists them), a "
                                       "config.json, or a model folder")
    parser.add_argument("--context", type=int, help="sequence length T (default: max_position_embeddings)")
    parser.add_argument("--memory-chunks", type=int,
                        help="previous chunks attended to, C - 1 (default: the XL memory of the config, 0 for RoPE)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a config field, e.g. --set num_attention_heads=2 --set head_dim=206")
    parser.add_argument("--dtype", default="float32", help="KV-cache element type: float32, bfloat16, float16")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(handler=run_flops)

    for name, text in (("card", "render the model card (README.md) of a saved model"),
                       ("publish", "push a saved model folder and its model card to the Hugging Face Hub")):
        parser = subparsers.add_parser(name, help=text, description=text + ".")
        parser.add_argument("model", help="model folder")
        if name == "publish":
            parser.add_argument("repo", help="Hub repository id, owner/name")
            parser.add_argument("--private", action="store_true", help="create the repository as private")
            parser.add_argument("--token", help="Hub token (default: the logged-in one)")
            parser.add_argument("--upload-results", action="store_true",
                                help="also upload the --results file, as eval_results.json (default: only the "
                                     "card shows its numbers)")
        else:
            parser.add_argument("--repo-id", help="Hub repository id shown in the usage snippet")
            parser.add_argument("--output", help="where to write the card (default: MODEL/README.md; '-' for stdout)")
            parser.add_argument("--overwrite", action="store_true", help="replace an existing card file")
        parser.add_argument("--results", help="JSON written by `switchhead eval --output`")
        parser.add_argument("--training-data", help="one paragraph on the training data")
        parser.add_argument("--dataset", action="append", default=[],
                            help="Hub dataset id for the metadata; repeatable")
        parser.add_argument("--license", help="Hub licence id of the model, e.g. apache-2.0 or mit (default: the "
                                              "switchhead package's licence, apache-2.0)")
        parser.set_defaults(handler=run_card if name == "card" else run_publish)


def _limit(value: str) -> int | float:
    """--limit: a whole number of examples per task, or a fraction in (0, 1) of each task; anything else (1.5) is
    refused rather than rounded."""
    import argparse
    import math

    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"--limit must be > 0 (a whole number of examples, or a fraction < 1), "
                                         f"got {value!r}")
    if number < 1:
        return number
    if number != int(number):
        raise argparse.ArgumentTypeError(f"--limit {value} is neither a whole number of examples nor a fraction < 1")
    return int(number)


# ---------------------------------------------------------------------------------------------------- eval
def run_eval(args) -> int:
    from switchhead.evaluation import TASKS_DIR

    if args.task_dir:
        print(TASKS_DIR)
        return 0
    if args.tasks is not None and args.tasks.strip().lower() == "list":
        from switchhead.evaluation.zero_shot import describe_tasks

        print(describe_tasks())
        return 0
    if not args.model or not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"model folder {args.model!r} has no config.json; give a save_pretrained folder")
    if args.output:
        refuse_existing_output(args.output, args.overwrite, model=args.model)
        if os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
            from switchhead.integrity.files import check_writable

            check_writable(args.output)  # a read-only or full disk is found now, not after the whole evaluation
    if args.batch_size < 1:
        raise UsageError("--batch-size must be >= 1")
    if not args.perplexity:  # refused, not ignored: they shape perplexity windows only
        for flag in ("context", "stride"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag} applies to --perplexity only; give a --perplexity FILE or leave "
                                 f"--{flag} out")
    device = check_device(args.device)
    from switchhead.evaluation.zero_shot import DEFAULT_TASKS, expand_tasks

    if args.tasks is None:  # plots or perplexity alone run no zero-shot tasks
        names = [] if args.perplexity or args.plots else list(DEFAULT_TASKS)
    elif args.tasks.strip().lower() == "none":
        names = []
    else:
        names = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not names:  # '' or ',,,' would silently evaluate nothing
            raise UsageError(f"--tasks {args.tasks!r} names no task; give comma-separated names, 'none' or 'list'")
    paradigms = [p.strip() for p in args.blimp_paradigms.split(",")] if args.blimp_paradigms else None
    tasks = expand_tasks(names, paradigms)
    if any(args.protocol != "paper" or t.startswith("switchhead_wikitext") for t in tasks):
        import importlib.util

        if importlib.util.find_spec("lm_eval") is None:  # lm-eval runs these tasks
            from switchhead import install_command

            raise UsageError(f"--tasks needs lm-eval (the [eval] extra): {install_command('eval')}")
    metadata = {}
    if args.data_dir:
        metadata["data_dir"] = str(Path(args.data_dir).resolve())
    if args.cbt_dir:
        metadata["cbt_dir"] = str(Path(args.cbt_dir).resolve())
    for path in args.perplexity:
        if not Path(path).is_file():
            raise UsageError(f"--perplexity file {path!r} does not exist")
    for flag in ("context", "stride"):
        value = getattr(args, flag)
        if value is not None and value < 1:  # refused, not taken as 'use the default'
            raise UsageError(f"--{flag} must be >= 1, got {value}")
    from switchhead.integrity import check_saved_model

    trust = check_saved_model(args.model, verify=not args.no_verify, trust_remote_code=args.trust_remote_code)
    if args.plots:  # refused before any evaluation runs: an existing PNG (without --overwrite), a link, a device
        from transformers import AutoConfig

        import switchhead  # noqa: F401 - registers the config class
        from switchhead.evaluation.analysis import plot_names
        from switchhead.integrity import check_target

        try:  # never the folder's own code; a config that does not load is reported where the model loads
            names = plot_names(AutoConfig.from_pretrained(args.model, trust_remote_code=False))
        except (ValueError, OSError, AttributeError, TypeError):
            names = []
        for name in names:
            check_target(os.path.join(args.plots, name), args.overwrite)
    if args.perplexity and args.context is not None:
        from transformers import AutoConfig

        import switchhead  # noqa: F401 - registers the config class

        limit = getattr(AutoConfig.from_pretrained(args.model, trust_remote_code=trust), "max_position_embeddings",
                        None)
        if limit is not None and args.context > limit:
            raise UsageError(f"--context {args.context} is longer than the model reads ({limit}, "
                               "max_position_embeddings); give at most that")
        if args.stride is not None and args.stride > args.context:
            raise UsageError(f"--stride {args.stride} is longer than --context {args.context}: the windows would "
                               "skip tokens")

    report: dict = {"model": args.model, "protocol": args.protocol, "limit": args.limit,
                    "results": {}, "perplexity": []}
    lm_eval_tasks = tasks
    model = tokenizer = None
    if args.protocol == "paper" or args.perplexity or args.plots:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import switchhead  # noqa: F401 - registers the Auto classes

        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=trust).to(device).eval()
    if args.protocol == "paper":
        from switchhead.evaluation.zero_shot import run_paper_protocol

        paper_tasks = [t for t in tasks if not t.startswith("switchhead_wikitext")]
        lm_eval_tasks = [t for t in tasks if t.startswith("switchhead_wikitext")]
        report["results"].update(run_paper_protocol(model, tokenizer, paper_tasks, limit=args.limit,
                                                    metadata=metadata, batch_size=args.batch_size))
    if lm_eval_tasks:
        from switchhead.evaluation.zero_shot import blimp_mean, run_lm_eval, summarize

        summary = summarize(run_lm_eval(args.model, lm_eval_tasks, limit=args.limit, batch_size=args.batch_size,
                                        device=device, metadata=metadata, trust_remote_code=trust))
        if "switchhead_blimp" not in summary and blimp_mean(summary) is not None and paradigms:
            summary["switchhead_blimp"] = {"acc": blimp_mean(summary)}
        report["results"].update(summary)
    for path in args.perplexity:
        from switchhead.evaluation.perplexity import evaluate_perplexity, read_text

        result = evaluate_perplexity(model, tokenizer, read_text(path), context=args.context, stride=args.stride,
                                     protocol=args.ppl_protocol, batch_size=args.batch_size)
        report["perplexity"].append({"data": Path(path).name, **result.as_dict()})
    if args.plots:
        from switchhead.evaluation.analysis import analyse
        from switchhead.integrity import FolderLock

        with FolderLock(args.plots, "eval --plots"):  # one writer of the plots folder at a time
            written = analyse(model, tokenizer, args.text, args.plots, overwrite=args.overwrite)
        report["plots"] = [str(path) for path in written]

    for task, metrics in sorted(report["results"].items()):
        print(f"{task:60s} " + "  ".join(f"{name}={value:.4f}" for name, value in sorted(metrics.items())))
    for run in report["perplexity"]:
        print(f"{run['data']}: perplexity {run['perplexity']:.3f}, bits/byte {run['bits_per_byte']:.4f} "
              f"({run['protocol']}, context {run['context']}, stride {run['stride']}, {run['scored_tokens']} tokens)")
    for path in report.get("plots", []):
        print(f"wrote {path}")
    if args.output:
        from switchhead.integrity import atomic_file

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(args.output, args.overwrite) as temporary:  # replaced only once this one is complete
            Path(temporary).write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


# ---------------------------------------------------------------------------------------------------- flops
def load_config(spec: str, assignments: list[str]):
    """A SwitchHeadConfig from a preset name, a config.json or a model folder, with FIELD=VALUE overrides."""
    from switchhead import PRESETS, SwitchHeadConfig

    from switchhead.integrity.user_json import check_config_numbers, read_json_object

    overrides = parse_field_assignments(assignments)
    check_config_numbers(overrides, "--set")
    if spec in PRESETS:
        return SwitchHeadConfig.from_preset(spec, **overrides)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(f"{spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config file/folder")
    fields = read_json_object(path, str(path))  # a list, a cut-short file, 10^5 levels: one line
    check_config_numbers(fields, str(path))
    if fields.get("model_type", "switchhead") != "switchhead":
        raise UsageError(f"{path} describes a {fields['model_type']!r} model, not a switchhead one")
    fields.update(overrides)
    for key in ("auto_map", "architectures", "transformers_version", "model_type"):
        fields.pop(key, None)
    return SwitchHeadConfig(**fields)


def run_flops(args) -> int:
    from switchhead.evaluation.accounting import cost_report, format_report

    config = load_config(args.config, args.set)
    if args.context is not None and args.context < 1:
        raise UsageError("--context must be >= 1")
    if args.memory_chunks is not None and args.memory_chunks < 0:
        raise UsageError("--memory-chunks must be >= 0")
    report = cost_report(config, args.context, args.memory_chunks, args.dtype)
    if args.json:
        print(json.dumps({"config": args.config, "overrides": args.set, **report.as_dict()}, indent=2))
    else:
        print(format_report(args.config, config, report))
    return 0


# ---------------------------------------------------------------------------------------------------- card
def _card(args, repo_id):
    from switchhead.evaluation.card import build_card, load_results
    from switchhead.integrity import check_remote_code

    from switchhead.integrity.user_json import check_folder_json

    try:  # JSON Transformers would fail on with a traceback: cut short, 10^5 levels, a 401-digit size, ...
        check_folder_json(args.model)
    except ValueError as error:
        raise UsageError(str(error)) from None
    check_remote_code(args.model)  # a card reads config.json only: never with the folder's own code

    evaluation = load_results(args.results) if args.results else None
    return build_card(args.model, evaluation, repo_id=repo_id, training_data=args.training_data,
                      datasets=args.dataset or None, license=args.license)


def run_card(args) -> int:
    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"model folder {args.model!r} has no config.json; give a save_pretrained folder")
    card = _card(args, args.repo_id)
    if args.output == "-":
        sys.stdout.write(str(card))
        return 0
    output = Path(args.output or os.path.join(args.model, "README.md"))
    # the card a training run wrote into its folder is replaced like a missing one; the new card is the user's
    replace = args.overwrite or (args.output is None and _written_by_training(output))
    refuse_existing_output(str(output), replace, model=args.model)
    from switchhead.integrity import atomic_file

    with atomic_file(str(output), replace) as temporary:  # no link, device or FIFO is written through
        Path(temporary).write_text(str(card), encoding="utf-8")
    print(f"wrote {output}")
    return 0


def _written_by_training(path: Path) -> bool:
    """Whether `path` is the card `switchhead train` / `finetune` wrote (a plain file ending with its marker)."""
    from switchhead.training.run_card import CARD_MARKER

    if path.is_symlink() or not path.is_file():
        return False
    return path.read_text(encoding="utf-8", errors="replace").rstrip().endswith(CARD_MARKER)


def run_publish(args, api=None) -> int:
    from switchhead.evaluation.card import publish

    if not (Path(args.model) / "config.json").is_file():
        raise UsageError(f"model folder {args.model!r} has no config.json; give a save_pretrained folder")
    if getattr(args, "upload_results", False) and not args.results:
        raise UsageError("--upload-results needs --results FILE")
    from switchhead.evaluation.card import publish_files

    try:
        names = publish_files(args.model)
    except (OSError, ValueError) as error:
        raise UsageError(str(error)) from None
    card = _card(args, args.repo)
    print(f"uploading {', '.join(names)}, README.md (the card)"
          + (", eval_results.json" if getattr(args, "upload_results", False) else ""))
    try:
        url = publish(args.model, args.repo, card, api=api, private=args.private, token=args.token,
                      results=args.results if getattr(args, "upload_results", False) else None)
    except Exception as error:  # noqa: BLE001 - the Hub unreachable, offline mode, refused credentials
        if type(error).__module__.split(".")[0] not in ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3") \
                and not isinstance(error, (ConnectionError, TimeoutError)):
            raise
        if type(error).__name__ == "OfflineModeIsEnabled":
            raise UsageError("cannot publish: HF_HUB_OFFLINE is set (unset it to reach the Hub)") from None
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UsageError(f"cannot publish to the Hub ({type(error).__name__}: {first})") from None
    print(f"published {args.model} to {url}")
    return 0
