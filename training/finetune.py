"""LoRA fine-tuning of SwitchHead, SwitchAll and dense models with PEFT, through the Transformers `Trainer`.

What LoRA can reach (`lora_targets(model, lm_head=True)`, the keyword arguments of PEFT's `LoraConfig`):

- dense projections, through `target_modules`: `q_proj`, `k_proj`, `position_key_proj` (XL), the dense baseline's
  `v_proj` / `o_proj`, the dense MLP's `up_proj` / `down_proj`, and `lm_head`;
- the expert tensors, through `target_parameters`: SwitchHead's `value_experts` `[H*E, d, dh]` and
  `output_experts` `[H*E, dh, d]`, and the sigma-MoE MLP's `expert_keys` `[E, d, S]` and `expert_values`
  `[E, S, d]`. Each expert gets its own rank-r update. The modules holding them say `is_transposed = True`
  (`[experts, in, out]`), the flag PEFT reads for this orientation.

PEFT reaches all of them (a `target_modules` list copied from a Llama recipe reaches only `q_proj` / `k_proj`
of SwitchHead, whose value and output projections are expert tensors):

    from peft import LoraConfig, get_peft_model
    from switchhead.training.finetune import lora_targets, register_switchhead_modules
    model = get_peft_model(model, register_switchhead_modules(LoraConfig(r=8, **lora_targets(model))))

One catch of PEFT 0.21: `merge_and_unload` skips LoRA layers inside a module that is itself wrapped, so the LoRA on
`q_proj` / `k_proj` of an attention layer whose experts are adapted too stays unmerged (and still active) after one
call; a second call merges it. PEFT 0.22 wraps the expert tensors first and then cannot find `q_proj` / `k_proj`
inside the wrapper: stock `get_peft_model` with `lora_targets(model)` fails there ("ParamWrapper has no attribute
`q_proj`") on SwitchHead attention. `apply_lora` / `load_lora` (or `register_switchhead_modules(LoraConfig(...))`
with stock PEFT) register `AttentionParamWrapper` for SwitchHead attention (PEFT's custom-module hook), which
handles both: it unloads those children in the same call and lets PEFT 0.22 reach them.

    from switchhead.training.finetune import apply_lora, load_lora
    model = apply_lora(AutoModelForCausalLM.from_pretrained("runs/wt2"), r=8)   # a PeftModel
    ... Trainer(model=model, ...).train()
    model.save_pretrained("adapter", save_embedding_layers=False)                # the adapter only (see below)
    model = load_lora(AutoModelForCausalLM.from_pretrained("runs/wt2"), "adapter")
    plain = model.merge_and_unload()                                              # a SwitchHeadForCausalLM again

`save_embedding_layers=False`: PEFT otherwise also saves the full `lm_head` weight whenever `lm_head` is a target.
Adapters saved before the sigma-MoE tensors were renamed (`target_parameters` `keys` / `values`) load with
`load_lora`, which reads those names as today's.
Quantised bases: `load_quantized` (bitsandbytes / torchao on the dense projections; experts stay full precision).

CLI: `switchhead finetune MODEL_DIR --data ... --output-dir ... [--quantize bnb-nf4]`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from switchhead import SwitchHeadConfig
from switchhead.checkpoint_format import RENAMED_MLP_PARAMETERS

from .run_config import reporting_names

DENSE_MODULES = ("q_proj", "k_proj", "position_key_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head")
EXPERT_PARAMETERS = ("value_experts", "output_experts", "expert_keys", "expert_values")


class FinetuneError(ValueError):
    """Bad fine-tuning input: the message says what to change."""


class FinetuneDiverged(RuntimeError):
    """The training loss or the LoRA weights became non-finite: nothing was saved (`switchhead finetune` exits with
    code 3, as `switchhead train` does on divergence)."""


def check_finetune_settings(output_dir, data, r, lora_alpha, max_steps: int, batch_size: int, block_size,
                            learning_rate: float, warmup_steps: int, seed: int) -> None:
    """FinetuneError naming the first setting no run can use, before anything is loaded or written (an infinite
    learning rate trained to NaN weights and exited 0; an empty output folder name meant the current folder)."""
    for name, value in (("output folder", output_dir), ("data", data)):
        if not isinstance(value, str) or not value.strip() or "\0" in value:
            raise FinetuneError(f"{name} must be a non-empty path, got {value!r}")
    for name, value, low in (("--max-steps", max_steps, 1), ("--batch-size", batch_size, 1), ("--rank", r, 1),
                             ("--warmup-steps", warmup_steps, 0), ("--seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise FinetuneError(f"{name} must be an integer >= {low}, got {value!r}")
    if seed >= 2**32:  # NumPy's seeds, which set_seed sets too, are below 2**32
        raise FinetuneError(f"--seed must be below 2**32, got {seed}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2):
        raise FinetuneError(f"--block-size must be an integer >= 2 (a next-token loss needs two tokens), got "
                            f"{block_size!r}")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) \
            or not math.isfinite(learning_rate) or learning_rate <= 0:
        raise FinetuneError(f"--learning-rate must be a finite number > 0, got {learning_rate!r}")
    if lora_alpha is not None and (isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float))
                                   or not math.isfinite(lora_alpha) or lora_alpha <= 0):
        raise FinetuneError(f"LoRA alpha must be a finite number > 0 (--alpha), got {lora_alpha!r}")


def _require_peft():
    try:
        import peft
    except ImportError:
        from switchhead import install_command

        raise FinetuneError(f"LoRA needs PEFT (the [peft] extra): {install_command('peft')}") from None
    return peft


def default_lora_targets(config: SwitchHeadConfig) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) covering every projection `config`'s architecture has."""
    modules = ["q_proj", "k_proj", "lm_head"]
    parameters = []
    if config.position_encoding == "xl":
        modules.append("position_key_proj")
    if config.attention_type == "dense":
        modules += ["v_proj", "o_proj"]
    else:  # SwitchHead; the value-only / output-only ablation has a dense v_proj or o_proj on the other side
        sides = getattr(config, "attention_expert_routers", ("value", "output"))
        modules += [f"{side[0]}_proj" for side in ("value", "output") if side not in sides]
        parameters += [f"{side}_experts" for side in ("value", "output") if side in sides]
    if config.mlp_type == "dense":
        modules += ["up_proj", "down_proj"]
    else:
        parameters += ["expert_keys", "expert_values"]
    return modules, parameters


def lora_targets(model_or_config, lm_head: bool = False) -> dict[str, list[str]]:
    """`target_modules` and `target_parameters` covering every projection of a SwitchHead model (or config), as the
    keyword arguments of PEFT's `LoraConfig`: `register_switchhead_modules(LoraConfig(r=8, **lora_targets(model)))`
    (the registration is needed from PEFT 0.22 on). `lm_head=True` adds the output layer (`switchhead finetune`
    adapts it; TRL's trainers refuse a LoRA on it)."""
    modules, parameters = default_lora_targets(getattr(model_or_config, "config", model_or_config))
    modules = [name for name in modules if lm_head or name != "lm_head"]
    return {"target_modules": modules, "target_parameters": parameters}


def _attention_param_wrapper_class():
    from peft.tuners.lora.layer import ParamWrapper

    class AttentionParamWrapper(ParamWrapper):
        """PEFT's `ParamWrapper` for SwitchHead attention, which holds expert tensors and child projections at once.

        - Its unload also unloads (and merges) the LoRA layers inside the wrapped module: PEFT's `merge_and_unload`
          skips modules inside a tuner layer, so the LoRA on `q_proj` / `k_proj` of an attention layer whose experts
          are adapted too would stay behind.
        - The wrapped attention's child modules are reached, and replaced, through the wrapper: PEFT 0.22 wraps the
          expert tensors before it adapts `target_modules`, then looks `...self_attn.q_proj` up by its name in the
          unwrapped model. The LoRA layer lands inside the attention, where PEFT 0.21 (modules first) put it, so
          adapters keep the same tensor names under both.
        """

        def _wrapped_child(self, name: str):
            """The child module `name` of the innermost wrapped module, or None (also while being built)."""
            module = self
            while isinstance(module, ParamWrapper):
                module = module.__dict__.get("_modules", {}).get("base_layer")
            if module is None or name in self.__dict__.get("_modules", {}):
                return None
            return module.__dict__.get("_modules", {}).get(name)

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                child = self._wrapped_child(name)
                if child is None:
                    raise
                return child

        def __setattr__(self, name: str, value) -> None:
            if isinstance(value, torch.nn.Module) and self._wrapped_child(name) is not None:
                module = self.get_base_layer()  # the attention: the LoRA layer replaces its own child
                setattr(module, name, value)
            else:
                super().__setattr__(name, value)

        def unload_and_optionally_merge_module(self, merge, safe_merge, adapter_names):
            base = super().unload_and_optionally_merge_module(merge, safe_merge, adapter_names)
            _unload_children(base, merge, safe_merge, adapter_names)
            return base

    # PEFT recognises parameter wrappers (to nest them, one per parameter of a module) by the class name
    AttentionParamWrapper.__name__ = "ParamWrapper"
    return AttentionParamWrapper


def _unload_children(module, merge: bool, safe_merge: bool, adapter_names) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, child in list(module.named_children()):
        if isinstance(child, BaseTunerLayer):
            if hasattr(child, "unload_and_optionally_merge_module"):
                replacement = child.unload_and_optionally_merge_module(merge=merge, safe_merge=safe_merge,
                                                                       adapter_names=adapter_names)
            else:
                if merge:
                    child.merge(safe_merge=safe_merge, adapter_names=adapter_names)
                replacement = child.get_base_layer()
            setattr(module, name, replacement)
        else:
            _unload_children(child, merge, safe_merge, adapter_names)


_WRAPPER = None


def attention_param_wrapper():
    """The `AttentionParamWrapper` class (built on first use, so that importing this module does not need PEFT)."""
    global _WRAPPER
    if _WRAPPER is None:
        _require_peft()
        _WRAPPER = _attention_param_wrapper_class()
    return _WRAPPER


def register_switchhead_modules(lora_config):
    """Register `AttentionParamWrapper` for SwitchHead attention on a `LoraConfig` (in place)."""
    from switchhead.modeling_switchhead import SwitchHeadAttention

    lora_config._register_custom_module({SwitchHeadAttention: attention_param_wrapper()})
    return lora_config


def lora_config(config: SwitchHeadConfig, r: int = 8, lora_alpha: float | None = None,
                target_modules: list[str] | None = None, target_parameters: list[str] | None = None, **kwargs):
    """A PEFT `LoraConfig` for a causal LM of `config`, targeting everything by default (`lora_targets`).

    Names not in the architecture are refused (PEFT would otherwise fail later, or silently adapt nothing).
    `lora_dropout` must stay 0 when expert tensors are targeted (PEFT cannot factor dropout out of a weight update).
    """
    peft = _require_peft()
    defaults = lora_targets(config, lm_head=True)
    default_modules, default_parameters = defaults["target_modules"], defaults["target_parameters"]
    modules = list(default_modules if target_modules is None else target_modules)
    parameters = list(default_parameters if target_parameters is None else target_parameters)
    for name in modules:
        if name not in default_modules:
            raise FinetuneError(f"target module {name!r} is not in this {config.attention_type}/{config.mlp_type} "
                                f"model; choose from {', '.join(default_modules)}")
    for name in parameters:
        if name not in default_parameters:
            raise FinetuneError(f"target parameter {name!r} is not in this {config.attention_type}/{config.mlp_type} "
                                f"model; choose from {', '.join(default_parameters) or '(none)'}")
    if not modules and not parameters:
        raise FinetuneError("LoRA needs at least one target module or parameter")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise FinetuneError(f"LoRA rank must be >= 1 (an integer), got {r!r}")
    if r > config.hidden_size:  # a rank above the width adds factors that can only be redundant
        raise FinetuneError(f"LoRA rank {r} exceeds the model width (hidden_size {config.hidden_size}); choose a "
                            f"rank <= {config.hidden_size}")
    if lora_alpha is not None and (isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float))
                                   or not math.isfinite(lora_alpha) or lora_alpha <= 0):
        raise FinetuneError(f"LoRA alpha must be a finite number > 0 (the update is scaled by alpha / rank; 0 trains "
                            f"nothing), got {lora_alpha!r}")
    if parameters and kwargs.get("lora_dropout", 0.0):
        raise FinetuneError("lora_dropout must be 0 when expert tensors are targeted (target_parameters)")
    result = peft.LoraConfig(r=r, lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
                             target_modules=modules or None, target_parameters=parameters or None,
                             task_type="CAUSAL_LM", **kwargs)
    return register_switchhead_modules(result)


def apply_lora(model, r: int = 8, lora_alpha: float | None = None, target_modules: list[str] | None = None,
               target_parameters: list[str] | None = None, **kwargs):
    """Wrap a SwitchHead causal LM in a trainable `PeftModel` (base weights frozen, LoRA factors trainable)."""
    peft = _require_peft()
    config = lora_config(model.config, r, lora_alpha, target_modules, target_parameters, **kwargs)
    return peft.get_peft_model(model, config)


def load_lora(model, adapter_dir: str, is_trainable: bool = False, adapter_name: str = "default"):
    """`PeftModel.from_pretrained` for an adapter saved from `apply_lora` (re-registers the attention wrapper; the
    sigma-MoE tensors' names before their rename are read as today's)."""
    peft = _require_peft()
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise FinetuneError(f"{adapter_dir} has no adapter_config.json: not a saved LoRA adapter")
    config = register_switchhead_modules(peft.LoraConfig.from_pretrained(adapter_dir))
    key_mapping = None  # PEFT's default
    if config.target_parameters and set(config.target_parameters) & set(RENAMED_MLP_PARAMETERS):
        config.target_parameters = [RENAMED_MLP_PARAMETERS.get(name, name) for name in config.target_parameters]
        # the renamed tensors moved from the MLP into its `experts` child, and their LoRA tensors are named by the
        # module that holds the tensor (`...mlp.lora_A`, `...mlp.base_layer.lora_A` for the inner of two): without
        # this mapping PEFT finds none of them and leaves the MLP's LoRA at its initialisation, with only a warning
        key_mapping = {r"\.mlp\.((?:base_layer\.)*lora_)": r".mlp.experts.\1"}
    return peft.PeftModel.from_pretrained(model, adapter_dir, adapter_name=adapter_name, is_trainable=is_trainable,
                                          config=config, key_mapping=key_mapping)


# ============================================================================================ quantised loading
QUANTIZATIONS = ("bnb-int8", "bnb-nf4", "torchao-int8")


def quantization_config(name: str, compute_dtype: torch.dtype | None = None):
    """A Transformers quantization config for `from_pretrained(..., quantization_config=...)`.

    - `bnb-int8`: bitsandbytes LLM.int8 (`BitsAndBytesConfig(load_in_8bit=True)`);
    - `bnb-nf4`: bitsandbytes 4-bit NF4 (QLoRA's base), compute in `compute_dtype` (bf16 on CUDA, fp32 on CPU);
    - `torchao-int8`: torchao int8 weight-only (`TorchAoConfig(Int8WeightOnlyConfig())`).

    Each quantises the dense `nn.Linear` projections (q/k, XL's position keys, the dense baseline's v/o, the dense
    MLP); `lm_head` stays in full precision (Transformers skips the output layer). The expert tensors (SwitchHead's
    value/output experts, the sigma-MoE keys/values) and the routers are `nn.Parameter`s, not `Linear`s: neither
    library touches them, so they stay in the checkpoint's precision. bitsandbytes runs on CPU (its CPU backend) and
    CUDA; torchao's int8 weight-only runs on both.
    """
    if name not in QUANTIZATIONS:
        raise FinetuneError(f"unknown quantization {name!r}; choose from {', '.join(QUANTIZATIONS)}")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if name.startswith("bnb"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            from switchhead import install_command

            raise FinetuneError(f"{name} needs bitsandbytes (the [quant] extra): {install_command('quant')}") from None
        from transformers import BitsAndBytesConfig

        if name == "bnb-int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                                  bnb_4bit_use_double_quant=True)
    try:
        from torchao.quantization import Int8WeightOnlyConfig
    except ImportError:
        from switchhead import install_command

        raise FinetuneError(f"{name} needs torchao (the [quant] extra): {install_command('quant')}") from None
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


def load_quantized(model_dir: str, name: str, device_map: str | None = None, compute_dtype: torch.dtype | None = None):
    """`AutoModelForCausalLM.from_pretrained(model_dir)` with the dense projections quantised (`quantization_config`).

    `device_map` defaults to "auto" with CUDA and "cpu" without."""
    from transformers import AutoModelForCausalLM

    config = quantization_config(name, compute_dtype)
    device_map = device_map or ("auto" if torch.cuda.is_available() else "cpu")
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=config, device_map=device_map,
                                                trust_remote_code=False)


# ============================================================================================ fine-tuning run
@dataclass
class FinetuneResult:
    steps: int
    train_losses: list[float]
    valid_loss_before: float
    valid_loss_after: float
    trainable_parameters: int
    total_parameters: int
    output_dir: str

    @property
    def valid_perplexity_before(self) -> float:
        return math.exp(self.valid_loss_before)

    @property
    def valid_perplexity_after(self) -> float:
        return math.exp(self.valid_loss_after)


def _blocks(ids: torch.Tensor, block_size: int, limit: int | None = None) -> torch.Tensor:
    count = ids.numel() // block_size
    if limit:
        count = min(count, limit)
    return ids[: count * block_size].view(count, block_size)


@torch.no_grad()
def _mean_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    for module in model.modules():
        # bitsandbytes 0.50 repacks 4-bit weights for its CPU inference kernel on the first eval-mode forward and
        # cannot train them afterwards; left in training mode, its layers compute the same product unrepacked
        if type(module).__name__ == "Linear4bit":
            module.train()
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start: start + batch_size]
        out = model(input_ids=batch, labels=batch, use_cache=False)
        tokens = batch[:, 1:].numel()
        total += out.loss.item() * tokens
        count += tokens
    return total / max(count, 1)


def finetune(model_dir: str, data: str, output_dir: str, r: int = 8, lora_alpha: float | None = None,
             target_modules: list[str] | None = None, target_parameters: list[str] | None = None,
             max_steps: int = 100, batch_size: int = 8, block_size: int | None = None, learning_rate: float = 1e-3,
             warmup_steps: int = 0, valid_blocks: int = 32, seed: int = 0, merge: bool = False,
             logging_steps: int = 10, quantize: str | None = None, verify: bool = True,
             report_to: str | list[str] = "none", progress: bool = True) -> FinetuneResult:
    """LoRA-fine-tune the model in `model_dir` (with its tokenizer) on `data` with the Transformers `Trainer`.

    Writes the adapter only to `output_dir` (plus `finetune.json` with the losses); with `merge`, also the merged
    plain model to `output_dir/merged`. `data` is what `switchhead train --data` takes (file or folder).
    `quantize` (one of `QUANTIZATIONS`) loads the base quantised and trains LoRA on top (QLoRA with `bnb-nf4`).
    `output_dir` is locked for the run (`switchhead.integrity.FolderLock`): a second writer is refused. The base
    folder is checked first (`switchhead.integrity.check_saved_model`; `verify=False` skips its manifest).
    `report_to` is Trainer's (`report_integrations`; TensorBoard writes into `output_dir/tensorboard` unless
    TENSORBOARD_LOGGING_DIR says otherwise); `progress` shows Trainer's progress bar, as `switchhead train` does.
    """
    from ..integrity import LOCK_NAME, FolderLock, check_saved_model

    check_finetune_settings(output_dir, data, r, lora_alpha, max_steps, batch_size, block_size, learning_rate,
                            warmup_steps, seed)
    integrations, missing = report_integrations(report_to)
    _require_peft()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FinetuneError(f"{model_dir} is not a saved model folder (no config.json)")
    check_saved_model(model_dir, verify=verify)
    if os.path.isfile(output_dir):
        raise FinetuneError(f"output {output_dir} is a file; choose a new folder")
    with FolderLock(output_dir, "finetune"):
        if [name for name in os.listdir(output_dir) if name != LOCK_NAME]:
            raise FinetuneError(f"output folder {output_dir} already exists and is not empty; choose another")
        try:
            return _finetune(model_dir, data, output_dir, r, lora_alpha, target_modules, target_parameters,
                             max_steps, batch_size, block_size, learning_rate, warmup_steps, valid_blocks, seed,
                             merge, logging_steps, quantize, integrations, progress, missing)
        except BaseException as error:  # a full disk, Ctrl-C: no half-written adapter stays (the folder was empty)
            _remove_written(output_dir, LOCK_NAME)
            from ..integrity.files import write_error

            failure = write_error(error, output_dir)
            if failure is not error:
                raise failure from None
            raise


def report_integrations(report_to: str | list[str]) -> tuple[list[str], list[str]]:
    """(the Trainer integrations `report_to` names that are installed, those whose package is not): a name, a comma
    list or a list; "all" is every installed one, "none" none. FinetuneError for a name Trainer does not know."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

    names = reporting_names(report_to, INTEGRATION_TO_CALLBACK, "--report-to", "integration", "Trainer",
                            FinetuneError)
    available = get_available_reporting_integrations()
    if names == ["all"]:
        return list(available), []
    if names == ["none"]:
        return [], []
    return [name for name in names if name in available], [name for name in names if name not in available]


class _tensorboard_folder:
    """Trainer's TensorBoard callback writes into TENSORBOARD_LOGGING_DIR, else under Trainer's output folder (which
    is deleted at the end): point it at `output_dir/tensorboard`, a folder created here (never a link), while the
    callback is built, unless the user set the variable."""

    def __init__(self, output_dir: str, wanted: bool):
        self.folder = os.path.join(output_dir, "tensorboard") if wanted and \
            "TENSORBOARD_LOGGING_DIR" not in os.environ else None

    def __enter__(self):
        if self.folder is not None:
            from ..integrity import make_folder

            os.environ["TENSORBOARD_LOGGING_DIR"] = make_folder(self.folder)

    def __exit__(self, *exc):
        if self.folder is not None:
            os.environ.pop("TENSORBOARD_LOGGING_DIR", None)


def _remove_written(output_dir: str, keep: str) -> None:
    """Delete what a failed run wrote into `output_dir` (empty but for `keep` when it began); links are removed, never
    followed."""
    import shutil

    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if name == keep:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _finetune(model_dir, data, output_dir, r, lora_alpha, target_modules, target_parameters, max_steps, batch_size,
              block_size, learning_rate, warmup_steps, valid_blocks, seed, merge, logging_steps,
              quantize, integrations=(), progress=True, missing=()) -> FinetuneResult:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, set_seed

    from .data import load_documents, load_tokenizer, tokenize_documents

    if max_steps < 1 or batch_size < 1:
        raise FinetuneError("--max-steps and --batch-size must be >= 1")
    lora_config(SwitchHeadConfig.from_pretrained(model_dir), r, lora_alpha, target_modules, target_parameters)
    if quantize is not None:
        if merge:
            raise FinetuneError("--merge with --quantize would round the merged weights to the quantised base; "
                                "merge the adapter into the full-precision model instead "
                                "(load_lora + merge_and_unload)")
        quantization_config(quantize)  # fails early when the library is missing
    tokenizer = load_tokenizer(model_dir)
    set_seed(seed)
    if quantize is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False)
    else:
        model = load_quantized(model_dir, quantize)
    block_size = block_size or min(model.config.max_position_embeddings, 256)
    if block_size > model.config.max_position_embeddings:
        raise FinetuneError(f"--block-size {block_size} exceeds the model's max_position_embeddings "
                            f"{model.config.max_position_embeddings}")
    if len(tokenizer) > model.config.vocab_size:
        raise FinetuneError(f"the tokenizer in {model_dir} has {len(tokenizer)} tokens, the model "
                            f"{model.config.vocab_size}")
    train_docs, valid_docs = load_documents(data)
    needed = max_steps * batch_size * block_size * 2  # a little more than one pass; the rest is not tokenized
    train_ids = tokenize_documents(tokenizer, _take_characters(train_docs, needed * 8))
    valid = _blocks(tokenize_documents(tokenizer, _take_characters(valid_docs, valid_blocks * block_size * 8)),
                    block_size, valid_blocks)
    train = _blocks(train_ids, block_size)
    if len(train) < batch_size or len(valid) == 0:
        raise FinetuneError(f"{data} is too small for batches of {batch_size} x {block_size} tokens")

    peft_model = apply_lora(model, r, lora_alpha, target_modules, target_parameters)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    before = _mean_loss(peft_model, valid, batch_size)
    args = TrainingArguments(
        output_dir=os.path.join(output_dir, "trainer"), per_device_train_batch_size=batch_size, max_steps=max_steps,
        learning_rate=learning_rate, warmup_steps=warmup_steps, lr_scheduler_type="cosine",
        logging_steps=logging_steps, save_strategy="no", report_to=list(integrations), seed=seed,
        dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=not progress,
    )
    dataset = Dataset.from_dict({"input_ids": train.tolist(), "labels": train.tolist()})
    if missing:  # a note, not an error: the run goes on without them
        import sys

        print(f"switchhead finetune: note: {' and '.join(missing)} not installed (pip install {' '.join(missing)}); "
              f"fine-tuning without {'it' if len(missing) == 1 else 'them'}", file=sys.stderr)
    with _tensorboard_folder(output_dir, "tensorboard" in integrations):  # read when Trainer builds its callbacks
        trainer = Trainer(model=peft_model, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    after = _mean_loss(peft_model, valid, batch_size)
    _check_finite(peft_model, losses, after, learning_rate)  # before anything is saved

    from .run_card import with_context

    with_context(tokenizer, model.config)  # the saved tokenizers truncate to what the model reads
    from ..integrity.files import new_folder_mode, save_into, staging_folder, write_bytes

    def save_adapter(folder: str) -> None:
        peft_model.save_pretrained(folder, save_embedding_layers=False)  # the adapter only, even with lm_head
        tokenizer.save_pretrained(folder)

    # every output through integrity.files: written in a private folder, renamed into place by descriptor, so that
    # nothing planted in output_dir meanwhile (a link at a file's name or at merged/) receives a byte
    save_into(output_dir, save_adapter)
    result = FinetuneResult(max_steps, losses, before, after, trainable, total, output_dir)
    settings = dict(data=data, rank=r, lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
                    target_modules=target_modules or "default",
                    max_steps=max_steps, batch_size=batch_size, block_size=block_size,
                    learning_rate=learning_rate, warmup_steps=warmup_steps, seed=seed, quantize=quantize)
    if merge:
        merged = peft_model.merge_and_unload()
        with staging_folder(output_dir, ".tmp-merged-") as staged:
            merged.save_pretrained(staged.here)
            tokenizer.save_pretrained(staged.here)
            _write_cards(output_dir, staged.here, model_dir, model.config, losses, before, after, settings)
            staged.publish_as("merged", mode=new_folder_mode())
    else:
        _write_cards(output_dir, None, model_dir, model.config, losses, before, after, settings)
    write_bytes(os.path.join(output_dir, "finetune.json"),
                json.dumps({"base_model": os.path.abspath(model_dir), "data": data, "rank": r, "steps": max_steps,
                            "quantize": quantize,
                            "train_losses": losses, "valid_loss_before": before, "valid_loss_after": after,
                            "trainable_parameters": trainable, "total_parameters": total}, indent=2))
    import shutil

    shutil.rmtree(os.path.join(output_dir, "trainer"), ignore_errors=True)
    return result


def _write_cards(output_dir, merged_dir, model_dir, config, losses, before, after, settings) -> None:
    """README.md of the adapter folder (in place of PEFT's placeholder card) and of the merged model (written into
    `merged_dir`, its folder before it is renamed into place; None without --merge)."""
    from .run_card import finetune_card, write_card

    name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    folders = [(output_dir, name, True)] + ([(merged_dir, f"{name}-merged", False)] if merged_dir else [])
    for folder, title, adapter in folders:
        write_card(folder, finetune_card(config, name=title, base_model=model_dir, settings=settings, losses=losses,
                                         valid_before=before, valid_after=after, adapter=adapter), replace=True)


def _check_finite(model, losses: list[float], valid_loss: float, learning_rate: float) -> None:
    """FinetuneDiverged when a logged training loss, the validation loss or a trained (LoRA) weight is not finite:
    such an adapter is never saved."""
    bad = [name for name, parameter in model.named_parameters()
           if parameter.requires_grad and not bool(torch.isfinite(parameter).all())]
    if bad or not all(math.isfinite(loss) for loss in losses) or not math.isfinite(valid_loss):
        what = f"{len(bad)} trained weight tensor(s) (e.g. {bad[0]})" if bad else "the loss"
        raise FinetuneDiverged(f"fine-tuning diverged: {what} became non-finite (learning rate {learning_rate!r}); "
                               f"nothing was saved; lower --learning-rate")


def _take_characters(documents: list[str], characters: int) -> list[str]:
    """The leading documents up to about `characters` characters (the last one cut)."""
    taken, count = [], 0
    for document in documents:
        if count >= characters:
            break
        taken.append(document[: characters - count])
        count += len(taken[-1])
    return taken


__all__ = ["DENSE_MODULES", "EXPERT_PARAMETERS", "FinetuneDiverged", "FinetuneError", "FinetuneResult", "QUANTIZATIONS", "apply_lora",
           "load_quantized", "quantization_config",
           "attention_param_wrapper", "default_lora_targets", "finetune", "load_lora", "lora_config", "lora_targets",
           "register_switchhead_modules"]
