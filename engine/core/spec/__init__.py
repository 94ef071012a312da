"""Speculative decoding: proposers (n-gram lookup, a draft model) guess tokens; the runner verifies them in one
forward."""
