"""Vision towers and the projectors that turn their patch features into a language model's soft tokens (one file
each), built from layers/ and torch; a family that takes images holds one of each (models/gemma3.py)."""
