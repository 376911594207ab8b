"""switchhead: SwitchHead (MoE attention) and SwitchAll language models for Hugging Face Transformers.

Importing the package registers the model with AutoConfig, AutoModel, AutoModelForCausalLM and the task-head Auto
classes (sequence and token classification, question answering), and marks the classes so that `save_pretrained`
writes an `auto_map` and copies the model files: a saved folder then loads with `trust_remote_code=True` where this
package is not installed. Our expert projections ("cvmm", "switchhead_batched", "switchhead_grouped") join
Transformers' experts implementations (`switchhead.experts_integration`), usable by any MoE model. Each of these
happens when the Transformers module it writes to loads, and the model classes import on first use (below).
"""

import functools as _functools
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
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

# Nothing heavy at import: not torch, not Transformers. The registrations happen when Transformers' Auto classes
# load (at once where they are loaded already), through an import hook: AutoConfig knows "switchhead" before any
# code can ask it. The model stack (modeling_switchhead.py, Transformers' modeling utilities, torch._dynamo) loads on
# first use: a model class read from this package, or the first SwitchHeadConfig made (every Auto lookup of a model
# class starts from a config). So `switchhead --help` answers before torch imports, as Transformers' own
# `_LazyModule` defers its models.
__version__ = "0.1.0"

_LAZY = {"SwitchHeadConfig": "configuration_switchhead", "PRESETS": "configuration_switchhead",
         "SwitchHeadModel": "modeling_switchhead", "SwitchHeadForCausalLM": "modeling_switchhead",
         "SwitchHeadForSequenceClassification": "modeling_switchhead",
         "SwitchHeadForTokenClassification": "modeling_switchhead",
         "SwitchHeadForQuestionAnswering": "modeling_switchhead", "SwitchHeadPreTrainedModel": "modeling_switchhead",
         "expert_projection": "expert_ops"}
_AUTO_CLASSES = {"AutoModel": "SwitchHeadModel", "AutoModelForCausalLM": "SwitchHeadForCausalLM",
                 "AutoModelForSequenceClassification": "SwitchHeadForSequenceClassification",
                 "AutoModelForTokenClassification": "SwitchHeadForTokenClassification",
                 "AutoModelForQuestionAnswering": "SwitchHeadForQuestionAnswering"}


class _OptionalLibraryNoise(_logging.Filter):
    """Drops two known import-time warnings of optional libraries that Transformers imports when it is installed:
    torchao's 'Failed to load .../torchao/_C*.so' (its CUDA-only extensions, absent on a CPU build) and torch's
    'is an Enum subclass and is now natively supported' (torchao registering its enums as pytree constants).
    Every other record of those loggers passes. The filter stays attached from `import switchhead` on (a logger
    costs nothing to look up): the model stack may be imported through any of the package's modules, the drop-in
    layers' or `switchhead.modeling_switchhead` directly, and torchao loads once, whenever that is."""

    def filter(self, record: _logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load ") and "torchao" in message and "_C" in message)
        return "is an Enum subclass and is now natively supported" not in message


for _noisy in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_noisy).addFilter(_OptionalLibraryNoise())


@_functools.cache
def _configuration():
    """Import the configuration, register it with AutoConfig and have its first instance load the models; once."""
    import transformers

    from . import configuration_switchhead as configuration
    config_class = configuration.SwitchHeadConfig
    post_init = config_class.__post_init__

    @_functools.wraps(post_init)
    def post_init_with_models(self, *args, **kwargs):
        _model_stack()  # an Auto class asked for this config's model finds it registered
        return post_init(self, *args, **kwargs)

    config_class.__post_init__ = post_init_with_models
    transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    config_class.register_for_auto_class()
    return configuration


@_functools.cache
def _model_stack():
    """Import the model file (Transformers' modeling utilities import its quantizers, which import torchao when it is
    installed) and register the model classes with the Auto classes; once."""
    import transformers

    config_class = _configuration().SwitchHeadConfig
    from . import modeling_switchhead as modeling
    for auto_name, name in _AUTO_CLASSES.items():
        model_class = getattr(modeling, name)
        getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto_name)
    return modeling


# The drop-in layers for any Transformer (`switchhead.layers`: the authors' interface on these layers), imported on
# first use only: the model files never import them.
_LAYER_NAMES = ("AttentionMask", "SigmaMoE", "SwitchHeadRope", "SwitchHeadXL")


def __getattr__(name):
    if name in _LAYER_NAMES:
        _model_stack()  # the model file they wrap, imported once under the filter above and registered
        from . import layers

        return getattr(layers, name)
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _LAZY[name] == "expert_ops":
        from . import expert_ops as module
    else:
        module = _configuration() if _LAZY[name] == "configuration_switchhead" else _model_stack()
    value = getattr(module, name)
    globals()[name] = value  # the next read is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAYER_NAMES))


def install_command(extra: str) -> str:
    """The pip command that adds the optional dependencies `extra` (setup.py's extras_require) where this package
    was installed from: a checkout (`pip install -e "PATH[extra]"`, "." when it is the working folder), a local
    archive (its path), else the package index (`pip install 'switchhead[extra]'`)."""
    import json
    import os
    from importlib import metadata
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    def checkout(path, editable=True):
        path = Path(path)
        shown = "." if path.resolve() == Path.cwd().resolve() else str(path)
        return f'pip install {"-e " if editable else ""}"{shown}[{extra}]"'

    try:
        distribution = metadata.distribution("switchhead")
    except metadata.PackageNotFoundError:  # imported from a checkout without installing it
        here = Path(__file__).resolve().parent.parent
        return checkout(here) if (here / "setup.py").is_file() else f"pip install 'switchhead[{extra}]'"
    direct = json.loads(distribution.read_text("direct_url.json") or "null")  # PEP 610: how pip installed it
    if direct and urlparse(direct.get("url", "")).scheme == "file":
        path = unquote(urlparse(direct["url"]).path)
        if "dir_info" in direct:
            return checkout(path, editable=direct["dir_info"].get("editable", False))
        if os.path.exists(path):
            return f'pip install "{path}[{extra}]"'
    return f"pip install 'switchhead[{extra}]'"


class _AfterImport(_importlib_abc.MetaPathFinder):
    """Runs `then()` right after the module `name` is first imported, or at once where it is imported already: the
    registrations happen when the Transformers module they write to loads, without importing it here."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    @classmethod
    def hook(cls, name, then):
        if name in _sys.modules:
            then()
        else:
            _sys.meta_path.insert(0, cls(name, then))

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        _sys.meta_path.remove(self)
        spec = _importlib_util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then()
        spec.loader.exec_module = exec_then
        return spec


def _register_experts_functions():
    from .experts_integration import register

    register()


# AutoConfig knows the model type "switchhead"; our expert projections ("cvmm", ...) join Transformers' experts
# functions, for any MoE model
_AfterImport.hook("transformers.models.auto.configuration_auto", _configuration)
_AfterImport.hook("transformers.integrations.moe", _register_experts_functions)

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
