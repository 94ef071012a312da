"""After each step, the output side of every sequence.

| file         | holds                                                                                      |
|--------------|--------------------------------------------------------------------------------------------|
| processor.py | sampled tokens appended, choices forked, beams advanced, stops found, RequestOutputs built |
| state.py     | one sequence's output side: detokenizer, grammar, stop reader, RNG stream, penalty counts  |
| pooling.py   | embedding and score requests: the final hidden states pooled                               |
"""
