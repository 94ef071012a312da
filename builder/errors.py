"""The one error the baker reports: a single line saying what is wrong and what to do."""

from __future__ import annotations


class BakeError(Exception):
    pass
