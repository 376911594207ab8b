"""A training run's settings (`TrainingConfig`), what it returns (`TrainResult`), its errors, and what follows
from the settings alone: the learning-rate schedule, the checks of a configuration, the model configuration.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


from .. import PRESETS, SwitchHeadConfig
from ..integrity import UnloadableModel, check_model_size
from .errors import TrainingDiverged, TrainingError  # noqa: F401  (also importable from here)
from .paper import PAPER_TRAINING


# Training settings of the tiny presets, sized for a CPU.
TINY_TRAINING: dict[str, Any] = dict(block_size=128, batch_size=16, learning_rate=2e-3, max_steps=400,
                                     warmup_steps=40, grad_clip=0.25, vocab_size=2048, eval_every=100,
                                     save_every=200, log_every=10)


# options that may change when a run is resumed: they do not change what is computed, except max_steps, which
# extends (or shortens) the run and so stretches the cosine schedule from the resumed step on
CHANGEABLE_ON_RESUME = ("output_dir", "resume", "eval_every", "save_every", "log_every", "keep_checkpoints",
                        "progress", "report_to", "tensorboard", "eval_batches", "max_steps", "overwrite",
                        "skip_nonfinite", "inexact_resume", "allow_pickle")


@dataclass
class TrainingConfig:
    """Everything a pretraining run needs; the defaults are the paper's (per preset:
    `PAPER_TRAINING`, tabulated in docs/configuration.md, "Presets").

    `from_preset(name)` fills in the paper's training settings of a model preset (or the tiny ones); `model`
    overrides single fields of the model preset (e.g. `{"hidden_size": 128}`).
    """

    preset: str = "tiny-switchhead"
    output_dir: str = "runs/switchhead"
    model: dict[str, Any] = field(default_factory=dict)
    # data
    data: str | None = None  # a file, a folder, a Hub dataset name; None: the Python standard library corpus
    valid_data: str | None = None
    text_field: str = "text"
    valid_fraction: float = 0.05
    tokenizer: str | None = None  # a tokenizer folder; None: train a BPE tokenizer on the training split
    vocab_size: int = 8000  # of the BPE tokenizer trained when no tokenizer is given
    block_size: int = 256  # tokens per sequence (T)
    # optimisation
    batch_size: int = 64  # sequences per optimizer step, over all processes and accumulation steps
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2.5e-4
    min_learning_rate: float = 0.0
    warmup_steps: int = 0
    max_steps: int = 100_000
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 0.25  # kappa; 0 disables clipping
    mixed_precision: str = "no"  # "no", "bf16" or "fp16" (GPU)
    seed: int = 0
    # evaluation, logging, checkpoints
    eval_every: int = 500
    eval_batches: int = 50  # validation segments per process and evaluation; 0: the whole split
    log_every: int = 10
    save_every: int = 1000
    keep_checkpoints: int = 2
    # experiment trackers (Accelerate's): "tensorboard", "wandb", "mlflow" (a comma list or a list), "all" (those
    # installed) or "none"; Transformers' TrainingArguments.report_to defaults to "none" too
    report_to: str | list[str] = "none"
    tensorboard: bool | None = None  # deprecated (--no-tensorboard): False leaves TensorBoard out, True adds it
    progress: bool = True
    resume: str | None = None  # "latest" or a checkpoint folder
    overwrite: bool = False  # start the run in output_dir (one of our runs) over, deleting its files
    skip_nonfinite: int = 0  # bad (non-finite) updates in a row to skip before stopping; 0: stop at the first
    inexact_resume: bool = False  # resume even when the checkpoint's RNG state is damaged or missing
    allow_pickle: bool = False  # fully unpickle an older checkpoint's RNG state that the restricted loader refuses
    # Transformers' distributed engine: {"tp_size": N, "fsdp_size": N, "ep_size": N} (DistributedConfig fields);
    # empty: Accelerate places the model (one process, DDP, FSDP)
    distributed: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> "TrainingConfig":
        """The model preset `preset` with its training settings: the paper's (PAPER_TRAINING) or the tiny ones."""
        if preset not in PRESETS:
            raise TrainingError(f"unknown preset {preset!r}; choose one of: {', '.join(sorted(PRESETS))}")
        if preset in PAPER_TRAINING:
            paper = PAPER_TRAINING[preset]
            settings = dict(block_size=paper["context"], batch_size=paper["batch_size"],
                            learning_rate=paper["learning_rate"], max_steps=paper["steps"],
                            grad_clip=paper["grad_clip"])
        else:
            settings = dict(TINY_TRAINING)
        settings.update(overrides)
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TrainingError(f"unknown training option(s): {', '.join(unknown)}")
        return cls(preset=preset, **settings)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainResult:
    output_dir: str
    step: int
    train_loss: float
    valid_loss: float
    valid_perplexity: float
    unigram_perplexity: float
    num_parameters: int
    seconds: float


def learning_rate_at(step: int, config: TrainingConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_learning_rate` at `max_steps`."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_learning_rate + (config.learning_rate - config.min_learning_rate) * cosine


def check_config(config: TrainingConfig, model_config: SwitchHeadConfig, num_processes: int) -> None:
    """Raise TrainingError naming the option and the rule for settings the loop cannot run."""
    check_settings(config)
    for name in ("block_size", "batch_size", "gradient_accumulation_steps", "max_steps", "log_every", "eval_every",
                 "save_every", "keep_checkpoints"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainingError(f"{name} must be an integer >= 1, got {value!r}")
    if config.block_size > model_config.max_position_embeddings:
        raise TrainingError(f"block_size ({config.block_size}) must be <= the model's max_position_embeddings "
                            f"({model_config.max_position_embeddings}); lower --block-size or choose another preset")
    from .placement import check_sizes

    check_sizes(config.distributed, model_config)
    slots = num_processes * config.gradient_accumulation_steps
    if config.batch_size % slots:
        raise TrainingError(f"batch_size ({config.batch_size}) must be divisible by data-parallel processes "
                            f"({num_processes}) x gradient_accumulation_steps ({config.gradient_accumulation_steps})")
    if config.mixed_precision not in ("no", "bf16", "fp16"):
        raise TrainingError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {config.mixed_precision!r}")
    if config.learning_rate <= 0 or config.min_learning_rate < 0 or config.min_learning_rate > config.learning_rate:
        raise TrainingError(f"need 0 <= min_learning_rate ({config.min_learning_rate}) <= learning_rate "
                            f"({config.learning_rate}) and learning_rate > 0")
    if config.warmup_steps < 0 or config.grad_clip < 0 or config.eval_batches < 0:
        raise TrainingError("warmup_steps, grad_clip and eval_batches must be >= 0")
    for name in ("learning_rate", "min_learning_rate", "grad_clip", "weight_decay", "valid_fraction"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TrainingError(f"{name} must be a finite number, got {value!r}")
    if isinstance(config.skip_nonfinite, bool) or not isinstance(config.skip_nonfinite, int) \
            or config.skip_nonfinite < 0:
        raise TrainingError(f"skip_nonfinite must be an integer >= 0, got {config.skip_nonfinite!r}")
    try:  # weights, gradients and AdamW's two moments in fp32: 16 bytes a parameter, before any is allocated
        check_model_size(model_config, bytes_per_parameter=16, what="the model to train")
    except UnloadableModel as error:
        raise TrainingError(str(error)) from None


SEED_LIMIT = 2**32  # NumPy's seeds, which `set_seed` sets with torch's and Python's, are below it
VOCAB_LIMIT = 1 << 22  # BPE vocabularies beyond this are typos (the embedding alone would be huge)


def check_settings(config: TrainingConfig) -> None:
    """The settings that need neither the data nor the model: TrainingError naming the first bad one. Run before
    the output folder is touched, so a typo leaves nothing behind."""
    for name in ("output_dir", "preset", "text_field"):
        value = getattr(config, name)
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise TrainingError(f"{name} must be a non-empty string, got {value!r}")
    for name in ("data", "valid_data", "tokenizer"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip() or "\0" in value):
            raise TrainingError(f"{name} must be a path or a name (leave it out for the default), got {value!r}")
    if config.preset not in PRESETS:
        raise TrainingError(f"unknown preset {config.preset!r}; choose one of: {', '.join(sorted(PRESETS))}")
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or not 0 <= config.seed < SEED_LIMIT:
        raise TrainingError(f"seed must be an integer in [0, {SEED_LIMIT - 1}], got {config.seed!r}")
    if isinstance(config.vocab_size, bool) or not isinstance(config.vocab_size, int) \
            or not 2 <= config.vocab_size <= VOCAB_LIMIT:
        raise TrainingError(f"vocab_size must be an integer in [2, {VOCAB_LIMIT}], got {config.vocab_size!r}")
    fraction = config.valid_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise TrainingError(f"valid_fraction must be a number in (0, 1), got {fraction!r}")
    for name in ("block_size", "batch_size", "gradient_accumulation_steps", "max_steps", "log_every", "eval_every",
                 "save_every", "keep_checkpoints"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainingError(f"{name} must be an integer >= 1, got {value!r}")
    for name in ("warmup_steps", "eval_batches"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TrainingError(f"{name} must be an integer >= 0, got {value!r}")
    for name in ("learning_rate", "min_learning_rate", "grad_clip", "weight_decay"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TrainingError(f"{name} must be a finite number, got {value!r}")
    if config.grad_clip < 0 or config.weight_decay < 0:
        raise TrainingError("grad_clip and weight_decay must be >= 0")
    if config.mixed_precision not in ("no", "bf16", "fp16"):
        raise TrainingError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {config.mixed_precision!r}")
    report_trackers(config)


TRACKERS = ("tensorboard", "wandb", "mlflow")  # the documented choices; Accelerate's other trackers work as well


def reporting_names(value, known, option: str, kind: str, library: str, error: type[Exception]) -> list[str]:
    """`value` (a name, a comma list or a list of names) -> its distinct names: each one `known` to `library`, or
    "all" / "none" standing alone; `error` (naming `option`) for anything else. Shared by `train`'s trackers
    (Accelerate) and `finetune`'s integrations (Trainer)."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise error(f"{option} must be a {kind} name, a comma list or a list of names, got {value!r}")
    names = list(dict.fromkeys(name.strip() for name in names if name.strip()))
    if not names:
        raise error(f"{option} is empty; give none for no {kind}")
    for name in names:
        if name not in ("all", "none") and name not in known:
            raise error(f"{option}: unknown {kind} {name!r}; choose from {', '.join(TRACKERS)}, all or none (or "
                        f"another {kind} {library} knows)")
    if len(names) > 1 and ("all" in names or "none" in names):
        raise error(f"{option}: 'all' and 'none' stand alone, got {','.join(names)!r}")
    return names


def report_trackers(config: TrainingConfig) -> list[str]:
    """The tracker names `config.report_to` asks for ("all": those Accelerate finds installed; "none": no tracker),
    with `config.tensorboard` applied; TrainingError for a name Accelerate does not know. Whether each is
    installed is decided when the run starts."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    names = reporting_names(config.report_to, LOGGER_TYPE_TO_CLASS, "report_to", "tracker", "Accelerate",
                            TrainingError)
    if names == ["none"]:
        names = []
    elif names == ["all"]:
        names = [getattr(tracker, "value", str(tracker)) for tracker in get_available_trackers()]
    names = list(dict.fromkeys(names))
    if config.tensorboard is False:
        names = [name for name in names if name != "tensorboard"]
    elif config.tensorboard is True and "tensorboard" not in names:
        names.append("tensorboard")
    return names


def build_model_config(config: TrainingConfig, tokenizer) -> SwitchHeadConfig:
    """The preset's model configuration with the user's overrides and the tokenizer's vocabulary (None: the
    configured BPE vocabulary size, to check the settings before a tokenizer exists)."""
    import difflib

    known = {f.name for f in dataclasses.fields(SwitchHeadConfig)} | {"rope_theta"}
    for name in config.model:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.5)
            raise TrainingError(f"model configuration: unknown field {name!r}"
                                + (f"; did you mean {' or '.join(close)}?" if close else ""))
    if tokenizer is None:
        vocabulary = dict(vocab_size=config.vocab_size)
        if config.tokenizer:  # the given tokenizer decides; it is checked once loaded
            vocabulary = dict(vocab_size=config.model.get("vocab_size", config.vocab_size))
    else:
        vocabulary = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    for name, value in vocabulary.items():  # the tokenizer's numbers win: a different --set value is a conflict
        if name in config.model and config.model[name] != value:
            source = ("the tokenizer" if tokenizer is not None or config.tokenizer
                      else "--vocab-size (the BPE tokenizer trained for the run)")
            raise TrainingError(f"model configuration: {name}={config.model[name]!r} conflicts with {value!r} from "
                                f"{source}; drop the --set {name} (use --vocab-size for the vocabulary)")
    try:
        return SwitchHeadConfig.from_preset(config.preset, **{**config.model, **vocabulary})
    except (TypeError, ValueError) as error:
        raise TrainingError(f"model configuration: {error}") from None
