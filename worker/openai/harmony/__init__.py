"""OpenAI's harmony format for gpt-oss: prompts rendered and answers parsed by the openai-harmony library."""
