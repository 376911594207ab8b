"""What differs between the Transformers releases this model supports, in one place.

The model files run on every release from `OLDEST_SUPPORTED` to `NEWEST_TESTED` (the test command runs a
compatibility subset on the oldest, on 5.19, the release vLLM's CPU build needs, and on the newest published).
Outside that range importing the model warns once; a release that lacks what the model imports raises an
ImportError that names the releases to install (`incompatible_release`). This file is shipped with the model files
to the Hub and, like them, imports only torch, transformers and packaging (a dependency of transformers).

Transformers 5.24 renamed the key-value cache argument from `past_key_values` to `cache`, everywhere at once: in
every model's `forward` (so `generate()` now passes `cache=`), in the masking functions, in the model outputs'
field, and in `GradientCheckpointingLayer` (which drops the cache by that name when checkpointing). The same release
moved the update of the paged (continuous batching) cache from the paged attention functions into the models'
attention layers, as `cache.update(key, value, layer_idx, kwargs=kwargs)`. Before 5.24, continuous batching
already passed its paged cache as `cache=`, to travel through `**kwargs` to the paged attention function.

Inside, the model names the cache `cache` from the top-level forward down to the attention layers. The top-level
forwards accept `past_key_values` as well (`accepts_past_key_values`) and hand the cache to Transformers' masking
functions and outputs under the installed release's name (`transformers_cache`); `model_cache` makes the decoder
stack's cache, and `update_cache` is the attention layer's `cache.update`, which also decides who updates a paged
cache. Nothing else in the model looks at the Transformers version or names a paged cache. `cache_kwarg` and
`output_cache` do the same renaming for code that calls a model (tests, benchmarks).
"""

import functools
import inspect
import warnings
from typing import NamedTuple

import torch
import transformers
from packaging.version import Version
from transformers import masking_utils
from transformers.cache_utils import DynamicCache
from transformers.utils.deprecation import deprecate_kwarg

try:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
except ImportError:  # continuous batching not in this build: no paged cache can reach the model
    PagedAttentionCache = ()

OLDEST_SUPPORTED = "5.17.0"
NEWEST_TESTED = "5.24.0"  # the newest release the compatibility run has passed on
# the pip requirement that matches the two above (setup.py declares the same range)
SUPPORTED_RANGE = ">=5.17,<5.25"

# The installed release's name for the cache, read from the masking function's signature rather than the version
# number, so that a release candidate or a development build is read by what it does.
_MASK_ARGUMENTS = inspect.signature(masking_utils.create_causal_mask).parameters
CACHE_NAME = "cache" if "cache" in _MASK_ARGUMENTS else "past_key_values"
# 5.24 made both changes in one release: with the new name, models update the paged cache themselves.
MODEL_UPDATES_PAGED_CACHE = CACHE_NAME == "cache"


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Warn once where the installed release is outside the tested range (it may work: nothing checked it)."""
    installed, oldest, newest = Version(version), Version(OLDEST_SUPPORTED), Version(NEWEST_TESTED)
    if installed < oldest or installed.release[:2] > newest.release[:2]:
        warnings.warn(
            f"SwitchHead models are tested with transformers {OLDEST_SUPPORTED} to {NEWEST_TESTED}, and transformers "
            f"{version} is installed: check generation against use_cache=False, or run "
            f"pip install 'transformers{SUPPORTED_RANGE}'",
            UserWarning,
            stacklevel=2,
        )


def incompatible_release(error: ImportError) -> ImportError:
    """The error for a release that lacks what the model imports from Transformers: it says what to install."""
    return ImportError(
        f"transformers {transformers.__version__} lacks what SwitchHead models use ({error}). "
        f"Run: pip install 'transformers{SUPPORTED_RANGE}'"
    )


check_transformers_version()


def accepts_past_key_values(forward):
    """Let `forward(..., cache=...)` also be called with the cache as `past_key_values=` (its name before 5.24).

    From 5.24 the old name is deprecated as on Transformers' own models (its `deprecate_kwarg`: a FutureWarning,
    and Transformers' common tests check for it); before, it is the name `generate()` uses, so it passes silently.
    """
    if CACHE_NAME == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache", raise_if_both_names=True)(forward)

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        old = kwargs.pop("past_key_values", None)
        if old is not None:  # None under the one name leaves the other as given (a paged cache rides as `cache`)
            if kwargs.get("cache") is not None and kwargs["cache"] is not old:
                raise ValueError("pass the key-value cache once: as `cache` or as `past_key_values`, not both")
            kwargs["cache"] = old
        return forward(*args, **kwargs)

    return wrapper


def cache_kwarg(cache) -> dict:
    """`{name: cache}` under the installed release's name, for Transformers' functions and output classes."""
    return {CACHE_NAME: cache}


def output_cache(outputs):
    """The cache field of a Transformers model output, under the installed release's name."""
    return getattr(outputs, CACHE_NAME)


def is_paged(cache) -> bool:
    return isinstance(cache, PagedAttentionCache)


def transformers_cache(cache) -> dict:
    """`{name: cache}` for Transformers' masking functions and output classes, under the installed release's name:
    a paged cache only where the release's models update it (before 5.24 the paged attention function does, and
    the model hands it only that)."""
    if is_paged(cache) and not MODEL_UPDATES_PAGED_CACHE:
        cache = None
    return {CACHE_NAME: cache}


def model_cache(cache, use_cache: bool | None, config) -> tuple:
    """The decoder stack's cache -> `(cache, packed)`: the given one, or a new `DynamicCache` when `use_cache` asks
    for one; `packed`: whether this is a continuous-batching call (requests packed into one row, keys read from a
    paged cache)."""
    packed = is_paged(cache)
    if use_cache and cache is None:
        cache = DynamicCache(config=config)
    return cache, packed


class CacheStep(NamedTuple):
    key: torch.Tensor  # every key of the layer `[B, H, Tk, dh]`: the cached ones, then this step's
    value: torch.Tensor
    past_length: int | torch.Tensor | None  # what the cache held before this step (None: no cache, or packed)
    packed: bool  # a continuous-batching call: positions come from the packed layout (`paged_key_distances`)


def update_cache(cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict) -> CacheStep:
    """The attention layer's `cache.update`, as Transformers' own attention layers call it, on any release; `kwargs`
    are the keyword arguments the layer passes on to the attention function.

    A paged cache is updated here from 5.24 (which also writes into `kwargs` what the attention call needs for this
    layer: its key lengths, and the block table on the flash path); before, it is passed on as `kwargs["cache"]` to
    the paged attention function, which updates it. Any other cache reports its length before the update (a static
    cache's counter is cloned, as `update` bumps it in place).
    """
    if cache is None:
        return CacheStep(key, value, None, False)
    if is_paged(cache):
        if not MODEL_UPDATES_PAGED_CACHE:
            kwargs["cache"] = cache
            return CacheStep(key, value, None, True)
        return CacheStep(*cache.update(key, value, layer_idx, kwargs=kwargs), None, True)
    past_length = cache.get_seq_length(layer_idx)
    if isinstance(past_length, torch.Tensor):
        past_length = past_length.clone()
    return CacheStep(*cache.update(key, value, layer_idx), past_length, False)


# Devices where sdpa's fused kernels refuse a masked call whose head width is not a multiple of 8 (16 bytes of bf16):
# CUDA's cuDNN and memory-efficient kernels do, and flash takes no mask, so PyTorch falls back to its math kernel,
# which casts the keys and values to fp32 and materialises the scores: on an H100 that was 24 of SwitchHead 262M's
# (heads of 100) 28 ms decoding step at batch 32 over an 8k static cache (benchmarks/results/gpu/matrices/).
SDPA_PADDED_DEVICES = ("cuda",)


def sdpa_head_padding(implementation: str | None, query: torch.Tensor, masked: bool) -> int:
    """Zero columns to append to each head of q, k and v before a masked sdpa call so that its fused kernels take
    it; 0 where none are needed. Exact: zero columns add nothing to q . k (the scale is passed explicitly, from the
    true width) and give zero output columns, which the caller drops."""
    if implementation != "sdpa" or not masked or query.device.type not in SDPA_PADDED_DEVICES:
        return 0
    return -query.shape[-1] % 8


def install_output_hooks(model: torch.nn.Module, config) -> None:
    """Install Transformers' output-recording hooks at construction where the model will record router logits (the
    sigma-MoE's entropy loss, or `output_router_logits`): installed on the first call instead, they are installed
    under a lock that torch.compile(fullgraph=True) cannot enter. Releases without the function install none."""
    from transformers.utils import output_capturing

    install = getattr(output_capturing, "maybe_install_capturing_hooks", None)
    records = config.mlp_type == "sigma_moe" and config.entropy_reg_coef > 0
    if install is not None and (records or config.output_router_logits):
        install(model)
