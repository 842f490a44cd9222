"""Ray Train (``ray[train]``) on shardwise: metrics and sharded checkpoints (docs/ray.md).

    def train_loop_per_worker(config):
        engine, *_ = shardwise.initialize(model=..., config=ds_config)  # Ray's process group
        shardwise_ray.load_checkpoint(engine)  # ray.train.get_checkpoint(), if any
        while engine.global_steps < steps:
            ...
            shardwise_ray.report({"loss": loss}, engine, checkpoint=engine.global_steps % 100 == 0)

    TorchTrainer(train_loop_per_worker, scaling_config=ScalingConfig(num_workers=2)).fit()

``shardwise.initialize`` inside ``train_loop_per_worker`` finds the world Ray's ``TorchTrainer``
set up (``torch.distributed`` already initialized) and builds its mesh on it; it never makes a
second one. A checkpoint is shardwise's own sharded format (``engine.save_checkpoint``) inside
a Ray ``Checkpoint``, every worker uploading the file it wrote; it loads at any
``num_workers`` and any layout. An optional extra: ``pip install shardwise[ray]``; nothing else
in shardwise imports it.
"""

from __future__ import annotations

try:
    import ray.train  # noqa: F401 - the extra's presence, checked once here
except ImportError as e:  # the optional extra is missing
    raise ImportError(
        "shardwise.integrations.ray needs Ray Train: pip install shardwise[ray]"
    ) from e

from shardwise.integrations.ray.train import load_checkpoint, report

__all__ = ["load_checkpoint", "report"]
