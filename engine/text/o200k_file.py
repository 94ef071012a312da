"""The o200k BPE file openai-harmony reads, as it expects it: its name, rank count and sha256.

The bake writes it next to a gpt-oss model (builder/harmony_vocab.py) and the worker points openai-harmony at
it (worker/openai/harmony/encoding.py); both read these constants from here, the one module both may import.
"""

from __future__ import annotations

O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony's expected hash
O200K_RANKS = 199998  # o200k's mergeable tokens; ids from here on are specials
