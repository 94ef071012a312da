"""Text: the tokenizer and chat templates (no transformers at run time) and the incremental detokenizer."""
