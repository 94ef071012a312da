"""A request's images in the engine's core (preprocessing is engine/image/, the towers engine/model/vision/).

| file            | holds                                                                                 |
|-----------------|---------------------------------------------------------------------------------------|
| intake.py       | images decoded and preprocessed once, hashed, matched to the prompt's image tokens    |
| pan_and_scan.py | Gemma 3's pan-and-scan prompt: one span for the image, one more per crop              |
| broken_rows.py  | Pixtral's prompt layout (Mistral 3): rows of image tokens, a break token after each    |
| positions.py    | a step's rotary positions, with the 3-D positions images give (Qwen-VL's M-RoPE)      |
"""
