"""switchhead: SwitchHead (MoE attention) and SwitchAll language models for Hugging Face Transformers.

Importing the package registers the model with AutoConfig, AutoModel, AutoModelForCausalLM and the task-head Auto
classes (sequence and token classification, question answering), and marks the classes so that `save_pretrained`
writes an `auto_map` and copies the model files: a saved folder then loads with `trust_remote_code=True` where this
package is not installed. The model file registers our expert projections ("cvmm", "switchhead_batched",
"switchhead_grouped") as Transformers experts implementations (`switchhead.experts_integration`), usable by any MoE
model.
"""

import logging as _logging
import os as _os
import signal as _signal
import sys as _sys
import threading as _threading


def _early_stop(number, frame):
    """SIGTERM while the `switchhead` command line is still importing (torch and Transformers take seconds): end as
    the command does on SIGTERM once it runs (one line, exit code 143), not killed silently with -15. Nothing has
    been written yet, so there is nothing to clean up. The command line replaces this handler with its own."""
    command = next((item for item in _sys.argv[1:] if not item.startswith("-")), "")
    _sys.stderr.write(f"switchhead{' ' + command if command else ''}: terminated\n")
    _sys.stderr.flush()
    _os._exit(143)


if _sys.argv and _os.path.basename(_sys.argv[0]) == "switchhead" \
        and _threading.current_thread() is _threading.main_thread() \
        and _signal.getsignal(_signal.SIGTERM) is _signal.SIG_DFL:
    _signal.signal(_signal.SIGTERM, _early_stop)


class _OptionalLibraryNoise(_logging.Filter):
    """Drops two known import-time warnings of optional libraries that Transformers imports when it is installed:
    torchao's 'Failed to load .../torchao/_C*.so' (its CUDA-only extensions, absent on a CPU build) and torch's
    'is an Enum subclass and is now natively supported' (torchao registering its enums as pytree constants).
    Every other record of those loggers passes; the filter is attached only while this package imports."""

    def filter(self, record: _logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load ") and "torchao" in message and "_C" in message)
        return "is an Enum subclass and is now natively supported" not in message


_noise = _OptionalLibraryNoise()
_noisy_loggers = [_logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
for _logger in _noisy_loggers:
    _logger.addFilter(_noise)
try:
    # Transformers' modeling utilities import its quantizers, which import torchao when it is installed
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    from .configuration_switchhead import PRESETS, SwitchHeadConfig
    from .modeling_switchhead import (
        SwitchHeadForCausalLM,
        SwitchHeadForQuestionAnswering,
        SwitchHeadForSequenceClassification,
        SwitchHeadForTokenClassification,
        SwitchHeadModel,
        SwitchHeadPreTrainedModel,
    )
    from .expert_ops import expert_projection
finally:
    for _logger in _noisy_loggers:
        _logger.removeFilter(_noise)
    del _logger, _noisy_loggers, _noise

__version__ = "0.1.0"

AutoConfig.register(SwitchHeadConfig.model_type, SwitchHeadConfig, exist_ok=True)
_AUTO_CLASSES = {AutoModel: SwitchHeadModel, AutoModelForCausalLM: SwitchHeadForCausalLM,
                 AutoModelForSequenceClassification: SwitchHeadForSequenceClassification,
                 AutoModelForTokenClassification: SwitchHeadForTokenClassification,
                 AutoModelForQuestionAnswering: SwitchHeadForQuestionAnswering}
SwitchHeadConfig.register_for_auto_class()
for _auto_class, _model_class in _AUTO_CLASSES.items():
    _auto_class.register(SwitchHeadConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
del _auto_class, _model_class

__all__ = [
    "SwitchHeadConfig",
    "SwitchHeadModel",
    "SwitchHeadForCausalLM",
    "SwitchHeadForSequenceClassification",
    "SwitchHeadForTokenClassification",
    "SwitchHeadForQuestionAnswering",
    "SwitchHeadPreTrainedModel",
    "PRESETS",
    "expert_projection",
    "__version__",
]

# The drop-in layers for any Transformer (`switchhead.layers`: the authors' interface on these layers), imported on
# first use only: `import switchhead` stays as light as before, and the model files never import them.
_LAYER_NAMES = ("AttentionMask", "SigmaMoE", "SwitchHeadRope", "SwitchHeadXL")


def __getattr__(name: str):
    if name in _LAYER_NAMES:
        from . import layers

        return getattr(layers, name)
    raise AttributeError(f"module 'switchhead' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAYER_NAMES])
