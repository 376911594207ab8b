"""switchhead.evaluation: zero-shot tasks through lm-eval, perplexity, MAC / memory accounting, analysis plots
and model cards.

The lm-eval task folder ships inside this package: pass `TASKS_DIR` as `--include_path` to `lm-eval run`, or
use `switchhead eval`. Importing this package does not import lm-eval, matplotlib or huggingface_hub.
"""

from pathlib import Path

from .accounting import (attention_macs, attention_memory, cost_report, kv_cache_bytes_per_token, mlp_macs,
                         model_forward_macs)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"

__all__ = ["TASKS_DIR", "attention_macs", "attention_memory", "cost_report", "kv_cache_bytes_per_token",
           "mlp_macs", "model_forward_macs"]
