"""switchhead.vllm: SwitchHead models for vLLM's model executor (placeholder while being written)."""


def register() -> None:
    from vllm import ModelRegistry

    if "SwitchHeadForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("SwitchHeadForCausalLM", "switchhead.vllm.model:SwitchHeadForCausalLM")
