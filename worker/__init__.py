"""The RunPod + OpenAI layer: settings, job parsing, OpenAI routes and the local endpoint (no torch here)."""
