"""Images for vision-language models: decoded with Pillow, then resized, rescaled, normalised and cut into patches
as the model's own processor settings (its baked preprocessor_config.json) say, with the same numbers as
transformers' image processors, and without transformers at run time."""
