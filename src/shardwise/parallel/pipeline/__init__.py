"""Pipeline parallelism: module.py (PipelineModule, specs), partition.py, schedule.py
(schedules as data), runtime.py (the executor), runner.py (the engine's pipeline strategy)."""
