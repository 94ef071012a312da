"""Grammar constraints (structured outputs): the request's spec as plain data, a compile cache that works off
the engine loop, one matcher per sequence, and the token bitmask applied to the logits before sampling."""

from engine.sample.structured.spec import StructuredSpec

__all__ = ["StructuredSpec"]
