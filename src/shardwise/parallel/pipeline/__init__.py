"""Pipeline parallelism: module.py (PipelineModule, specs), partition.py, schedule.py
(schedules as data), executor.py (the executor), train_batch.py (the engine's pipeline strategy)."""
