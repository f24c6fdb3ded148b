"""`forklift bench memory`: how much KV memory contiguous reservation wastes, and paging saves.

Part A (`figures`) counts a three-request example (3, 5 and 2 tokens, at most 12 each, blocks
of 4) through forklift's own `KVCacheManager`. Part B (`at_scale`) does the same arithmetic
at scale with the real model's config and a mixed workload. Part C (`measured`) measures
reserved against used slots after every step of a real engine run. `run` puts the three
into one report.
"""
