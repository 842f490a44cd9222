"""Data parallelism: gradients all-reduced in buckets during backward (reducer.py: the
``DataParallelReducer`` and ``LocalGradients`` strategies) and batch norm synchronized over the
data ranks (syncbn.py)."""
