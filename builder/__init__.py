"""Build-time model baking: one Hugging Face folder plus manifest.json, written atomically."""
