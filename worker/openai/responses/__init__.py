"""The Responses API (/v1/responses and its resources): request, input items, output items, the response object,
the store, truncation and compaction, run on the chat path (route.py)."""
