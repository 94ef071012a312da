"""OpenAI-compatible routes: protocol models, chat, completions, models, streaming and errors; responses/: the
Responses API."""
