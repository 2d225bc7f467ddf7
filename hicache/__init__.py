"""The cache hierarchy: one radix tree over three tiers (L1 device, L2 pinned host, L3 storage).

Knows nothing of requests or models: it stores pages of KV bytes keyed by token ids.
"""
