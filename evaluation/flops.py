"""MAC and memory accounting (`switchhead flops`): re-exported from `switchhead.accounting`.

The formulas live beside the configuration they read, so that training (which must not depend on evaluation)
uses the same code; see `switchhead.accounting` for the two labelled formulas.
"""

from switchhead.accounting import (  # noqa: F401
    DTYPE_BYTES,
    FORMULAS,
    CostReport,
    attention_macs,
    attention_memory,
    cost_report,
    default_context,
    default_memory_chunks,
    format_count,
    format_report,
    kv_cache_bytes_per_token,
    mlp_macs,
    model_forward_macs,
)
