"""Requests in, and what runs in each step.

| file            | holds                                                                                    |
|-----------------|------------------------------------------------------------------------------------------|
| requests.py     | a request checked against the engine's limits, then made into a SequenceGroup            |
| sequence.py     | SequenceGroup (one request) and Sequence (one choice, sample or beam)                    |
| grammar_wait.py | requests whose grammar is still compiling, held outside the scheduler                    |
| scheduler.py    | continuous batching: which sequences run next and how many tokens each; preemption       |
| step.py         | what a step passes along: the scheduler's plan and the runner's result (neutral ground)  |
"""
