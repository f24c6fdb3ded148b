"""`forklift bench memory`: how much KV memory contiguous reservation wastes, and paging saves.

Part A (`figures`) replays the seed article's Figures 1 and 2 through forklift's own
`KVCacheManager`. Part B (`at_scale`) does the same arithmetic at scale with the real model's
config and a mixed workload. Part C (`measured`) measures reserved against used slots after
every step of a real engine run. `run` puts the three into one report.
"""
