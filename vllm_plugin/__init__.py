"""switchhead.vllm: SwitchHead / SwitchAll / dense baseline checkpoints on vLLM, with no flags.

    from vllm import LLM
    llm = LLM(model="path/to/saved_folder")        # or: vllm serve path/to/saved_folder

Installing this package declares the `vllm.general_plugins` entry point `switchhead = switchhead.vllm:register`;
vLLM calls `register()` in every process it starts. It registers our config with Transformers' AutoConfig
(`import switchhead`, so config.json loads without trust_remote_code) and `SwitchHeadForCausalLM`
(`switchhead.vllm.model`, vLLM's model executor) with vLLM's ModelRegistry, which then picks it for the
`architectures` our checkpoints save. `switchhead.vllm.support` says what is covered and what each model costs in
the KV cache. The model package never imports this one.
"""

ARCHITECTURE = "SwitchHeadForCausalLM"
MODEL_CLASS = "switchhead.vllm.model:SwitchHeadForCausalLM"


def register() -> None:
    """The plugin's entry point (idempotent: vLLM may call it several times in one process)."""
    import switchhead  # noqa: F401 - registers SwitchHeadConfig (model_type "switchhead") with AutoConfig
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


__all__ = ["ARCHITECTURE", "MODEL_CLASS", "register"]
