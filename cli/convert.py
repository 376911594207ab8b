"""`switchhead convert`: the authors' checkpoints to `save_pretrained` folders and back.

    switchhead convert authors-to-hf model-100000.pth out/          # training-code checkpoint -> folder
    switchhead convert hf-to-authors out/ model.pth                 # folder -> training-code checkpoint
    switchhead convert module-to-hf my.pt out/ --preset tiny-switchhead-xl \\
        --layer-prefix 'blocks.{i}.attn.' --map 'blocks.{i}.ln1.=model.layers.{i}.input_layernorm.' ...
    switchhead convert hf-to-module out/ my.pt --layer-prefix 'blocks.{i}.attn.' --map ...
    switchhead convert moeut-to-hf moeutlm.pt out/ --moeut-args args.json   # the authors' MoEUTLM -> folder
    switchhead convert moeut-to-hf moeutlm.pt out/ --profile MoEUT_244M     # ... built from profiles.py
    switchhead convert hf-to-moeut out/ moeutlm.pt --args-output args.json  # folder -> MoEUTLM state dict

MoEUT (RobertCsordas/moeut): the file is `torch.save(model.state_dict())` of their `MoEUTLM` (or .safetensors).
Its architecture is given as the JSON object of the keyword arguments it was built with, n_tokens included
({"n_tokens": 8000, "d_model": 1024, "n_layers": 18, ...}; left-out arguments take the constructor's defaults), or
as the name of a profiles.py dict (MoEUT_44M ... MoEUT_1B), n_tokens then read from the embedding. hf-to-moeut
prints those arguments as JSON and writes them to --args-output.

The module layout also covers the one-expert module (n_experts=1: `v`, `o`, `sel_o`), described by a config with
attention_type='dense' and attention_output_gate=true.

Loading uses `torch.load(weights_only=True)`. `--allow-pickle` fully unpickles files that need it: that runs
any code stored in the file, so only use it for checkpoints from a source you trust.
"""

from __future__ import annotations

import argparse
import os

from .common import UsageError


def _common(parser: argparse.ArgumentParser, reads_pickle: bool, writes_folder: bool) -> None:
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"],
                        help="convert floating-point tensors to this dtype on the way out (default: keep)")
    if reads_pickle:
        parser.add_argument("--allow-pickle", action="store_true",
                            help="WARNING: fully unpickle inputs that a safe load refuses; this can execute code "
                                 "stored in the file, so use it only for files you trust")
    if writes_folder:
        parser.add_argument("--max-shard-size", default="5GB",
                            help="largest safetensors shard, e.g. 500MB or 2GB (default 5GB)")


def _module_layout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layer-prefix", required=True,
                        help="prefix of the SwitchHead module of layer {i} in your state dict, e.g. 'blocks.{i}.attn.'")
    parser.add_argument("--map", action="append", default=[], metavar="THEIRS=OURS",
                        help="prefix rename for the rest of your model, e.g. 'tok_emb.=model.embed_tokens.' or "
                             "'blocks.{i}.ln1.=model.layers.{i}.input_layernorm.' (repeatable)")


def register(subparsers) -> None:
    parser = subparsers.add_parser("convert", help="convert the authors' checkpoints to/from save_pretrained folders",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)

    p = directions.add_parser("authors-to-hf", help="the authors' training checkpoint -> save_pretrained folder")
    p.add_argument("input", help="training checkpoint (.pth) with 'model' and run_invariants['args']")
    p.add_argument("output", help="new folder to write")
    _common(p, reads_pickle=True, writes_folder=True)

    p = directions.add_parser("hf-to-authors", help="save_pretrained folder -> the authors' training checkpoint")
    p.add_argument("input", help="save_pretrained folder")
    p.add_argument("output", help="new .pth file to write")
    _common(p, reads_pickle=False, writes_folder=False)

    p = directions.add_parser("module-to-hf", help="model around the authors' SwitchHead module -> folder")
    p.add_argument("input", help="your state dict (.pt/.pth or .safetensors)")
    p.add_argument("output", help="new folder to write")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="config.json (SwitchHeadConfig fields) or a saved model folder "
                                         "describing your model")
    source.add_argument("--preset", help="a SwitchHeadConfig preset name describing your model")
    _module_layout(p)
    _common(p, reads_pickle=True, writes_folder=True)

    p = directions.add_parser("hf-to-module", help="save_pretrained folder -> state dict for your model")
    p.add_argument("input", help="save_pretrained folder")
    p.add_argument("output", help="new file to write (.safetensors, else torch.save)")
    _module_layout(p)
    _common(p, reads_pickle=False, writes_folder=False)

    p = directions.add_parser("moeut-to-hf", help="the authors' MoEUTLM state dict -> save_pretrained folder")
    p.add_argument("input", help="their MoEUTLM state dict (torch.save of model.state_dict(), or .safetensors)")
    p.add_argument("output", help="new folder to write")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--moeut-args", metavar="JSON", help="JSON file: the MoEUTLM keyword arguments the model was "
                                                              "built with, n_tokens included")
    source.add_argument("--profile", help="the profiles.py dict it was built with (MoEUT_44M, MoEUT_126M, MoEUT_244M, "
                                          "MoEUT_318M, MoEUT_727M, MoEUT_1B); n_tokens from the embedding")
    _common(p, reads_pickle=True, writes_folder=True)

    p = directions.add_parser("hf-to-moeut", help="save_pretrained folder -> the authors' MoEUTLM state dict")
    p.add_argument("input", help="save_pretrained folder of a MoEUT configuration")
    p.add_argument("output", help="new file to write (.safetensors, else torch.save)")
    p.add_argument("--args-output", metavar="JSON", help="also write the MoEUTLM keyword arguments to this new file")
    _common(p, reads_pickle=False, writes_folder=False)

    parser.set_defaults(handler=run)
    _register_upcycle(subparsers)


def _register_upcycle(subparsers) -> None:
    from .common import module_docstring  # the module itself imports the model stack: read, not imported, for --help

    parser = subparsers.add_parser("upcycle", help="turn a dense model (ours or GPT-2 style) into a SwitchHead one",
                                   description=module_docstring("switchhead.conversion.upcycle"), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dense", help="save_pretrained folder of a dense model of this package, or of GPT-2")
    parser.add_argument("output", help="new folder to write")
    parser.add_argument("--heads", type=int, required=True, help="SwitchHead heads H (must divide the dense heads)")
    parser.add_argument("--experts", type=int, required=True, help="experts per head E")
    parser.add_argument("--k", type=int, required=True, help="active experts per head")
    parser.add_argument("--expert-init", choices=["svd", "heads"], default="svd",
                        help="experts from the group's rank-dh SVD (svd, default) or one dense head each (heads)")
    parser.add_argument("--router-noise", type=float, default=0.01,
                        help="std of the initial router logits (0.01); 0 makes every gate exactly 1/2")
    parser.add_argument("--seed", type=int, default=0, help="seed of the router initialisation")
    parser.add_argument("--no-verify", action="store_true",
                        help="read a training run's folder even when its SHA-256 manifest does not verify")
    parser.set_defaults(handler=run_upcycle)


def run_upcycle(args) -> int:
    from switchhead.conversion.checkpoint_io import ConversionError
    from switchhead.conversion.upcycle import upcycle

    try:
        with _output_lock(args.output, "upcycle"):
            result, difference = upcycle(args.dense, args.output, args.heads, args.experts, args.k,
                                         args.expert_init, args.router_noise, args.seed, verify=not args.no_verify)
    except ConversionError as error:
        raise UsageError(str(error)) from None
    for note in result.notes:
        print(f"note: {note}")
    if result.dropped:
        print(f"dropped {len(result.dropped)} source tensors: {', '.join(result.dropped[:6])}"
              f"{' ...' if len(result.dropped) > 6 else ''}")
    print(f"wrote {args.output}: first-forward max |logit difference| to the dense model {difference:.3g}")
    return 0


def _output_lock(output: str, command: str):
    """One writer per output path: the lock file sits beside OUTPUT (which appears only when the finished
    temporary folder or file is renamed into place), so a second convert / upcycle to the same path is refused
    naming the first instead of racing it to the rename."""
    from switchhead.integrity import FolderLock

    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise UsageError(f"the folder of the output, {parent}, does not exist")
    return FolderLock(output, command, inside=False)


def _config(args):
    from switchhead import SwitchHeadConfig

    try:
        if args.preset:
            return SwitchHeadConfig.from_preset(args.preset)
        if os.path.isdir(args.config):  # a saved model folder
            return SwitchHeadConfig.from_pretrained(args.config)
        if not os.path.isfile(args.config):
            raise UsageError(f"--config {args.config} does not exist")
        return SwitchHeadConfig.from_json_file(args.config)
    except (ValueError, TypeError, OSError) as error:
        raise UsageError(f"invalid model description: {error}") from None


def run(args) -> int:
    if os.path.isfile(args.output) or (os.path.isdir(args.output) and os.listdir(args.output)):
        raise UsageError(f"output {args.output} already exists; choose a new path or delete it first")
    extra = getattr(args, "args_output", None)
    if extra is not None and (os.path.lexists(extra) or os.path.abspath(extra) == os.path.abspath(args.output)):
        raise UsageError(f"--args-output {extra} already exists or is the output; choose a new path")
    with _output_lock(args.output, f"convert {args.direction}"):
        return _run_locked(args)


def _moeut_args(path: str | None):
    """The JSON object of --moeut-args (None without the option)."""
    from switchhead.integrity.user_json import read_json_object

    if path is None:
        return None
    if not os.path.isfile(path):
        raise UsageError(f"--moeut-args {path} does not exist")
    try:
        return read_json_object(path, f"--moeut-args {path}")
    except (ValueError, OSError) as error:
        raise UsageError(str(error)) from None


def _export_moeut(convert, args, dtype) -> None:
    import json

    from switchhead.integrity.files import write_bytes

    moeut_args = convert.export_moeut_checkpoint(args.input, args.output, dtype)
    text = json.dumps(moeut_args)
    if args.args_output is not None:
        write_bytes(args.args_output, text + "\n", overwrite=False, option="a new --args-output path")
    print(f"wrote {args.output}{' and ' + args.args_output if args.args_output else ''}; build it with "
          f"MoEUTLM(**{text})")


def _run_locked(args) -> int:
    from switchhead.conversion import convert
    from switchhead.conversion.authors_format import parse_renames
    from switchhead.conversion.checkpoint_io import ConversionError, parse_dtype

    try:
        dtype = parse_dtype(args.dtype)
        if args.direction == "authors-to-hf":
            config = convert.convert_authors_checkpoint(args.input, args.output, args.allow_pickle, dtype,
                                                        args.max_shard_size)
            print(f"wrote {args.output} ({config.attention_type}, {config.position_encoding}, {config.mlp_type} MLP, "
                  f"{config.num_hidden_layers} layers)")
        elif args.direction == "hf-to-authors":
            convert.export_authors_checkpoint(args.input, args.output, dtype)
            print(f"wrote {args.output}")
        elif args.direction == "module-to-hf":
            convert.convert_module_checkpoint(args.input, args.output, _config(args), args.layer_prefix,
                                              parse_renames(args.map), args.allow_pickle, dtype, args.max_shard_size)
            print(f"wrote {args.output}")
        elif args.direction == "hf-to-module":
            convert.export_module_checkpoint(args.input, args.output, args.layer_prefix, parse_renames(args.map),
                                             dtype)
            print(f"wrote {args.output}")
        elif args.direction == "moeut-to-hf":
            config, _ = convert.convert_moeut_checkpoint(args.input, args.output, _moeut_args(args.moeut_args),
                                                         args.profile, args.allow_pickle, dtype, args.max_shard_size)
            print(f"wrote {args.output} (MoEUT: {config.layer_group_size} distinct blocks applied "
                  f"{config.num_layer_groups} times, {config.num_hidden_layers} layers)")
        else:
            _export_moeut(convert, args, dtype)
    except ConversionError as error:
        raise UsageError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - a damaged .safetensors input: name the file
        if type(error).__name__ != "SafetensorError":
            raise
        raise UsageError(f"{args.input} is a damaged or unreadable .safetensors file ({error})") from None
    return 0
