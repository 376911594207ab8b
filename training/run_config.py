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
from .paper import PAPER_TRAINING


# Training settings of the tiny presets, sized for a CPU.
TINY_TRAINING: dict[str, Any] = dict(block_size=128, batch_size=16, learning_rate=2e-3, max_steps=400,
                                     warmup_steps=40, grad_clip=0.25, vocab_size=2048, eval_every=100,
                                     save_every=200, log_every=10)


# options that may change when a run is resumed: they do not change what is computed, except max_steps, which
# extends (or shortens) the run and so stretches the cosine schedule from the resumed step on
CHANGEABLE_ON_RESUME = ("output_dir", "resume", "eval_every", "save_every", "log_every", "keep_checkpoints",
                        "progress", "tensorboard", "eval_batches", "max_steps", "overwrite", "skip_nonfinite",
                        "inexact_resume", "allow_pickle")


class TrainingError(ValueError):
    """The training run cannot start or continue as asked (one-line reason for the user)."""


class TrainingDiverged(RuntimeError):
    """A non-finite loss / gradient norm (or weights) stopped the run; `last_checkpoint` is the newest good one
    (None when none was written yet). `switchhead train` exits with code 3."""

    def __init__(self, message: str, step: int, last_checkpoint: str | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


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
    tensorboard: bool = True
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
    else:
        vocabulary = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    try:
        return SwitchHeadConfig.from_preset(config.preset, **{**config.model, **vocabulary})
    except (TypeError, ValueError) as error:
        raise TrainingError(f"model configuration: {error}") from None
