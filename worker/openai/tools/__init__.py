"""Tool calling: the tool-call formats models write (one parser each), their pick, checks and prompts."""
