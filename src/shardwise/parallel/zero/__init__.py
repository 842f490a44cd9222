"""ZeRO (arXiv 1910.02054): optimizer states and gradients sharded over data ranks (stage12.py),
parameters too (stage3.py, with gathering.py: the units and the hooks that gather them around
each forward and backward), master weights (masters.py), and parameters partitioned at
construction under DeepSpeed's ``zero.Init`` / ``GatheredParameters`` (partition.py;
``shardwise.zero`` re-exports it). The flat shard layout is ``parallel/flat.py``, shared with
data parallelism's buckets."""
