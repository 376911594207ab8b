"""The paper's training settings for each of its presets (docs/configuration.md, "Presets", lists them): what `switchhead train --preset`
trains with, and what the docs and benchmarks quote."""

from __future__ import annotations

from typing import Any

from .. import PRESETS

PAPER_TRAINING: dict[str, dict[str, Any]] = {
    name: dict(context=fields["max_position_embeddings"], batch_size=64, learning_rate=2.5e-4, steps=100_000,
               grad_clip=0.1 if ("47m" in name or "45m" in name) and "switchall" not in name else 0.25)
    for name, fields in PRESETS.items() if not name.startswith("tiny")
}


__all__ = ["PAPER_TRAINING"]
