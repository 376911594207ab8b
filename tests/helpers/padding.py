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


def generate_cached_and_uncached(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int):
    """Greedy `generate()` of the batch with and without the KV cache; asserts equal tokens and step logits
    (1e-5), and returns the cached run (sequences and per-step logits) for further checks."""
    common = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **common)
    uncached = model.generate(ids, use_cache=False, **common)
    assert torch.equal(cached.sequences, uncached.sequences)
    for step_cached, step_uncached in zip(cached.logits, uncached.logits):
        torch.testing.assert_close(step_cached, step_uncached, atol=1e-5, rtol=0)
    return cached
