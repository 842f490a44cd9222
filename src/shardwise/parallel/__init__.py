"""The parallelisms, one folder each: ``data/`` (bucketed all-reduce, SyncBatchNorm), ``zero/``
(stages 1-3), ``tensor/`` (Megatron layers, ``parallelize``), ``pipeline/`` (PipelineModule,
schedules, executor) and ``activation/`` (recompute). What several of them share stays here: the
gradient-strategy contract (strategy_contract.py) and its table (strategy_table.py), flat buffers (flat.py)
and user parameter lists remapped after a rewrite (remap.py). Nothing here imports the
DeepSpeed-named modules at the package root, which only re-export this mechanism."""
