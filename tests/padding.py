"""Left-padded batches, as `generate()` sees them, for the caching and backend tests."""

import torch


def left_padded_batch(vocab: int, lengths=(7, 4, 5), seed: int = 3):
    """A batch with different amounts of left padding: ids and mask, each `[len(lengths), max(lengths)]`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
        ids[row, : width - length] = 0
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate()` makes them: counting real tokens from 0 (padding gets 1, and is masked)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
