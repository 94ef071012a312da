"""Choosing tokens: sampling parameters, logits processing, the sampler, beam search and grammars (structured/)."""
