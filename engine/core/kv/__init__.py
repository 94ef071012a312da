"""The KV side of the engine: pages, who holds them, and how many there are.

| file           | holds                                                                                            |
|----------------|--------------------------------------------------------------------------------------------------|
| cache.py       | the per-layer page pools, the reference-counted page allocator and the prefix cache              |
| manager.py     | every sequence's pages across the KV layer groups: allocate, share, copy-on-write, free, windows |
| sizing.py      | pages per layer group from one byte budget                                                       |
| plan.py        | the start-up decision: pages per group and state slots, from the settings, device and model      |
| state_cache.py | recurrent state beside the pages (hybrid models): its slots and its prefix snapshots             |
"""
