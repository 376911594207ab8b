"""`switchhead train`: pretrain a SwitchHead / SwitchAll / dense model, resume a run, or run the demo.

    switchhead train --demo                                   # the README demo (stdlib corpus, tiny models)
    switchhead train --preset tiny-switchhead --data ../shared/data/wikitext-2 --output-dir runs/wt2
    switchhead train --output-dir runs/wt2 --resume           # continue from the newest checkpoint
    accelerate launch --num_processes 8 -m switchhead.cli train --preset wt103-47m-switchhead-xl --data DIR
    switchhead train --accelerate-config fsdp2 --num-processes 8 --preset wt103-47m-switchhead-xl --data DIR
    torchrun --nproc_per_node 4 -m switchhead.cli train --preset tiny-switchall --fsdp-size 4 --ep-size 2   # Transformers' engine
"""

from __future__ import annotations

import os
import sys

from .common import UsageError, first_process, parse_field_assignments


# command-line option -> DistributedConfig field of Transformers' distributed engine (TrainingConfig.distributed)
SIZE_OPTIONS: dict[str, str] = {
    "--tp-size": "tensor parallelism over N processes: attention by head, MLPs, embedding and LM head sharded "
                 "(base_model_tp_plan); the processes of a group share their rows of the batch",
    "--fsdp-size": "FSDP2 over N processes: every parameter sharded, each process its own rows of the batch",
    "--ep-size": "expert parallelism: SwitchAll's sigma-MoE experts split over N processes (base_model_ep_plan); "
                 "within the tp x fsdp processes, so it does not add to their count",
}


# command-line option -> TrainingConfig field; options left out keep the preset's (or the resumed run's) value
OPTIONS: dict[str, tuple[str, type, str]] = {
    "--data": ("data", str, "a .txt/.tokens/.jsonl file, a folder of them (train/valid split by file name), or a "
                            "Hub dataset name; default: the Python standard library corpus (no download)"),
    "--valid-data": ("valid_data", str, "a file or folder for validation (default: the data's valid split or a "
                                        "held-out share)"),
    "--text-field": ("text_field", str, "field of .jsonl records / Hub rows holding the text (default: text)"),
    "--valid-fraction": ("valid_fraction", float, "share held out for validation when there is no split (0.05)"),
    "--tokenizer": ("tokenizer", str, "tokenizer folder (e.g. ../shared/data/tokenizers/gpt2); default: train a "
                                      "BPE tokenizer on the training split"),
    "--vocab-size": ("vocab_size", int, "vocabulary of the trained BPE tokenizer (paper: 8000; tiny presets: 2048)"),
    "--block-size": ("block_size", int, "tokens per sequence T (<= the model's max_position_embeddings)"),
    "--batch-size": ("batch_size", int, "sequences per optimizer step over all processes (paper: 64)"),
    "--gradient-accumulation-steps": ("gradient_accumulation_steps", int, "micro-batches per optimizer step"),
    "--learning-rate": ("learning_rate", float, "peak learning rate (paper: 2.5e-4)"),
    "--min-learning-rate": ("min_learning_rate", float, "learning rate at the end of the cosine decay (0)"),
    "--warmup-steps": ("warmup_steps", int, "linear warmup steps"),
    "--max-steps": ("max_steps", int, "optimizer steps (paper: 100000)"),
    "--weight-decay": ("weight_decay", float, "AdamW weight decay (paper: 0)"),
    "--grad-clip": ("grad_clip", float, "gradient-norm clipping kappa; 0 disables it"),
    "--mixed-precision": ("mixed_precision", str, "no, bf16 or fp16 (GPU)"),
    "--seed": ("seed", int, "seed of initialisation and data order"),
    "--eval-every": ("eval_every", int, "steps between validations"),
    "--eval-batches": ("eval_batches", int, "validation segments per evaluation (0: the whole split)"),
    "--log-every": ("log_every", int, "steps between log rows"),
    "--save-every": ("save_every", int, "steps between checkpoints"),
    "--keep-checkpoints": ("keep_checkpoints", int, "newest checkpoints kept"),
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="pretrain a SwitchHead / SwitchAll / dense language model (Accelerate)",
        description="Pretrain a model from a preset with an Accelerate loop: AdamW, warmup + cosine, clipping, "
                    "gradient accumulation, periodic validation, atomic checkpoints with --resume. Run it under "
                    "`accelerate launch` for several GPUs or processes. Options not given keep the preset's "
                    "training settings (the paper's for paper presets).")
    parser.add_argument("--preset", default=None, help="model preset (see --list-presets; default tiny-switchhead)")
    parser.add_argument("--output-dir", default=None, help="run folder (default runs/switchhead, runs/demo for --demo)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                        help="continue the run in --output-dir from its newest intact checkpoint, or from CHECKPOINT")
    parser.add_argument("--overwrite", action="store_true",
                        help="start the run in --output-dir over (only a folder of a previous `switchhead train` "
                             "run; its checkpoints, logs and model are deleted)")
    parser.add_argument("--skip-nonfinite", type=int, default=None, metavar="N",
                        help="skip up to N non-finite updates in a row (counted in log.csv) instead of stopping at "
                             "the first one (exit code 3)")
    parser.add_argument("--inexact-resume", action="store_true",
                        help="resume even when the checkpoint's RNG state is damaged or missing (the continuation "
                             "then differs from an uninterrupted run; written to events.log)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="WARNING: with --resume, fully unpickle an older checkpoint's RNG state "
                             "(random_states_N.pkl) that the restricted loader refuses; this can run code stored in "
                             "the file, so use it only for checkpoints you trust (new checkpoints need no pickle)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a model configuration field, e.g. --set hidden_size=128 (repeatable)")
    for flag, (_, kind, help_text) in OPTIONS.items():
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    parser.add_argument("--accelerate-config", default=None, metavar="FILE",
                        help="run under `accelerate launch --config_file FILE` (started for you, one machine): an "
                             "Accelerate YAML, or a shipped one by name: fsdp2 (full state dicts in checkpoints), "
                             "fsdp2_sharded. Without a GPU, Accelerate runs its processes with DDP over gloo "
                             "(it applies FSDP on accelerators only). Several machines: `accelerate launch` itself")
    parser.add_argument("--num-processes", type=int, default=None, metavar="N",
                        help="with --accelerate-config: processes to start (default: the config's num_processes)")
    sizes = parser.add_argument_group(
        "Transformers' distributed engine",
        "shard the model at load with from_pretrained(..., distributed_config=DistributedConfig(tp_size=, "
        "fsdp_size=, ep_size=)), under torchrun or `accelerate launch --multi_gpu` with tp x fsdp processes (on CPU "
        "they join over gloo). Rank 0 alone writes the run folder; resume on the same sizes. Pipeline parallelism "
        "runs inference only in Transformers, so there is no --pp-size")
    for flag, help_text in SIZE_OPTIONS.items():
        sizes.add_argument(flag, type=int, default=None, metavar="N", help=help_text)
    parser.add_argument("--report-to", default=None, metavar="TRACKERS",
                        help="experiment trackers that get the log rows (Accelerate's): tensorboard (into "
                             "OUTPUT/tensorboard), wandb, mlflow, a comma list of them, all (those installed) or "
                             "none (the default, as Transformers' Trainer); a resume keeps the run's unless given. "
                             "log.csv is always written")
    parser.add_argument("--no-tensorboard", action="store_true",
                        help="deprecated: leaves tensorboard out of --report-to")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list-presets", action="store_true", help="list the model presets and exit")
    parser.add_argument("--demo", action="store_true",
                        help="train a tiny SwitchHead model and its parameter-matched dense baseline on the Python "
                             "standard library corpus, compare them, reload one and generate a sample")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from accelerate import PartialState

    from switchhead import PRESETS
    from switchhead.training.paper import PAPER_TRAINING
    from switchhead.training.checkpoints import find_checkpoint, read_checkpoint_state
    from switchhead.training.trainer import TrainingConfig, TrainingDiverged, train

    if args.list_presets:
        for name in sorted(PRESETS):
            print(f"{name:28s} {'paper training settings' if name in PAPER_TRAINING else 'tiny (CPU)'}")
        return 0
    distributed = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag in SIZE_OPTIONS}
    distributed = {name: value for name, value in distributed.items() if value is not None}
    if distributed and args.demo:
        raise UsageError("--demo runs in one process; drop --tp-size / --fsdp-size / --ep-size")
    if args.accelerate_config is not None:
        if args.demo:
            raise UsageError("--demo runs in one process; drop --accelerate-config")
        return launch_under_accelerate(args, sharded=bool(distributed))
    if args.num_processes is not None:
        raise UsageError("--num-processes goes with --accelerate-config (or use `accelerate launch "
                         "--num_processes N -m switchhead.cli train ...`)")
    explicit = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in OPTIONS.items()}
    explicit = {field: value for field, value in explicit.items() if value is not None}
    if args.report_to is not None:  # it replaces a resumed run's trackers, its old TensorBoard flag included
        explicit.update(report_to=args.report_to, tensorboard=None)
    if args.no_tensorboard:
        if "tensorboard" in [name.strip() for name in (args.report_to or "").split(",")]:
            raise UsageError("--no-tensorboard contradicts --report-to tensorboard: give one")
        explicit["tensorboard"] = False
    if args.no_progress:
        explicit["progress"] = False
    if args.overwrite:
        explicit["overwrite"] = True
    if args.inexact_resume:
        explicit["inexact_resume"] = True
    if args.allow_pickle:
        if not args.resume:
            raise UsageError("--allow-pickle only applies to --resume (it reads an older checkpoint's RNG state)")
        explicit["allow_pickle"] = True
    if args.skip_nonfinite is not None:
        if args.skip_nonfinite < 0:
            raise UsageError(f"--skip-nonfinite must be >= 0, got {args.skip_nonfinite}")
        explicit["skip_nonfinite"] = args.skip_nonfinite
    if distributed:
        explicit["distributed"] = distributed
    model_overrides = parse_field_assignments(args.set)
    for flag in ("--output-dir", "--preset"):  # an empty value would silently mean the default (or the cwd)
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value.strip():
            raise UsageError(f"{flag} is empty; give a {'folder' if flag == '--output-dir' else 'preset name'} "
                             "or leave the option out")

    if args.demo:
        from switchhead.cli.demo import run_demo

        if args.resume:
            raise UsageError("--demo always starts fresh; drop --resume")
        try:
            return run_demo(output_dir=args.output_dir or "runs/demo", **explicit)
        except TrainingDiverged as error:
            raise UsageError(str(error), exit_code=3) from None

    if args.resume:
        output_dir = args.output_dir
        if output_dir is None and args.resume != "latest":  # CHECKPOINT lies in OUTPUT/checkpoints/
            output_dir = os.path.dirname(os.path.dirname(os.path.abspath(args.resume)))
        if args.overwrite:
            raise UsageError("--resume continues a run and --overwrite starts it over: give only one")
        probe = TrainingConfig(output_dir=output_dir or "runs/switchhead", resume=args.resume,
                               inexact_resume=args.inexact_resume, allow_pickle=args.allow_pickle)
        # a run another process is writing: say so before reading its state. Only the main launched process
        # probes: the probe takes the lock for a moment, so a second process of the same launch probing at the
        # same time would find it held by its peer and stop the launch; train() locks it for the run on rank 0.
        if os.path.isdir(probe.output_dir) and first_process():
            from switchhead.integrity import FolderLock

            try:
                FolderLock(probe.output_dir, "train").acquire().release()
            except ValueError as error:
                raise UsageError(f"--output-dir: {error}") from None
        stored = read_checkpoint_state(find_checkpoint(probe))["config"]
        if args.preset is not None:
            explicit["preset"] = args.preset
        if model_overrides:
            explicit["model"] = {**stored["model"], **model_overrides}
        # permissions are this command's, never inherited from the stored run: False unless given now
        explicit.update(inexact_resume=args.inexact_resume, allow_pickle=args.allow_pickle)
        config = TrainingConfig(**{**stored, **explicit, "output_dir": probe.output_dir, "resume": args.resume})
    else:
        config = TrainingConfig.from_preset("tiny-switchhead" if args.preset is None else args.preset,
                                            output_dir="runs/switchhead" if args.output_dir is None
                                            else args.output_dir, model=model_overrides, **explicit)
    from switchhead.training.placement import ProcessesMissing, check_sizes
    from switchhead.training.run_config import build_model_config, check_config, check_settings

    check_sizes(config.distributed)  # in every process, before any process group: sizes that fit no launch
    check_settings(config)  # every setting, before the output folder is touched
    check_config(config, build_model_config(config, None), 1)
    try:
        result = train(config)
    except TrainingDiverged as error:
        raise UsageError(str(error), exit_code=3) from None
    except ProcessesMissing as error:
        if not first_process():  # rank 0 (which reports errors) may be the missing one
            from .common import error_line

            print(error_line("train", error), file=sys.stderr)
            return 2
        raise
    if PartialState().is_main_process:
        print(f"step {result.step}: validation loss {result.valid_loss:.4f}, perplexity {result.valid_perplexity:.2f} "
              f"(unigram {result.unigram_perplexity:.1f}); saved to {result.output_dir}")
    return 0


# `accelerate launch` options of ours, dropped from the command line the launched processes get
_LAUNCH_OPTIONS = ("--accelerate-config", "--num-processes")


def launch_under_accelerate(args, sharded: bool = False) -> int:
    """`switchhead train --accelerate-config FILE ...`: the same command under `accelerate launch --config_file FILE`.

    One machine: the launched processes run `switchhead train` with every other option unchanged, on a free port
    unless the config names one. Without an accelerator, Accelerate 1.x does not form a process group from an
    FSDP (or multi-GPU) config at all: its launcher never sets ACCELERATE_USE_CPU for them, so each process would
    run alone as "process 0 of 1", all writing the same run folder. Here ACCELERATE_USE_CPU=true is set for them:
    they join over gloo (`MULTI_CPU`), and since Accelerate turns FSDP on only for accelerator process groups
    (`AcceleratorState` switches MULTI_GPU / MULTI_XPU / ... to FSDP, never MULTI_CPU), they train with DDP; a note
    says so.
    """
    import os
    import subprocess
    import sys

    import torch
    import yaml

    from switchhead.training.accelerate_configs import CONFIGS, path

    if os.environ.get("LOCAL_RANK") is not None:
        raise UsageError("--accelerate-config starts the processes itself: under `accelerate launch` or torchrun, "
                         "drop it")
    name = args.accelerate_config
    config_file = path(name) if name in CONFIGS else name
    if not os.path.isfile(config_file):
        raise UsageError(f"--accelerate-config: no file {name!r} (or a shipped config: {', '.join(CONFIGS)})")
    try:
        with open(config_file, encoding="utf-8") as handle:
            launch_config = yaml.safe_load(handle)
    except yaml.YAMLError as error:
        raise UsageError(f"--accelerate-config: {config_file} is not YAML ({error})") from None
    if not isinstance(launch_config, dict) or "distributed_type" not in launch_config:
        raise UsageError(f"--accelerate-config: {config_file} is not an Accelerate config (no distributed_type)")
    if args.num_processes is not None and args.num_processes < 1:
        raise UsageError(f"--num-processes must be >= 1, got {args.num_processes}")
    if sharded and launch_config.get("distributed_type") in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise UsageError(f"--accelerate-config {name}: its {launch_config['distributed_type']} would shard the model "
                         "that --tp-size / --fsdp-size / --ep-size shard with Transformers' engine; use torchrun "
                         "--nproc_per_node N -m switchhead.cli train ..., or a MULTI_GPU Accelerate config")
    if int(launch_config.get("num_machines", 1) or 1) > 1:
        raise UsageError("--accelerate-config runs on one machine; for several, run `accelerate launch "
                         "--config_file FILE --machine_rank R ... -m switchhead.cli train ...` on each")

    forwarded, skip = [], False
    for item in args.argv:
        if skip:
            skip = False
        elif item in _LAUNCH_OPTIONS:
            skip = True
        elif not item.startswith(tuple(option + "=" for option in _LAUNCH_OPTIONS)):
            forwarded.append(item)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file]
    if args.num_processes is not None:
        command += ["--num_processes", str(args.num_processes)]
    if launch_config.get("main_process_port") is None:
        command += ["--main_process_port", "0"]  # Accelerate picks a free one
    command += ["-m", "switchhead.cli", *forwarded]
    env = dict(os.environ)
    if not torch.accelerator.is_available() or launch_config.get("use_cpu"):
        env["ACCELERATE_USE_CPU"] = "true"  # the launcher leaves it unset for FSDP / multi-GPU configs
        if launch_config.get("distributed_type") == "FSDP":
            print("switchhead train: no GPU here: Accelerate applies FSDP on accelerators only, so these CPU "
                  "processes (gloo) train with DDP", file=sys.stderr)
    return subprocess.run(command, env=env).returncode
