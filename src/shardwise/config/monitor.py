"""DeepSpeed's monitor blocks: ``tensorboard`` and ``csv_monitor`` (keys and defaults as
DeepSpeed's ``deepspeed/monitor/config.py``). What they write: shardwise/monitor/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class MonitorConfig:
    """``{"enabled": true, "output_path": "logs/", "job_name": "run1"}``: events go under
    ``output_path/job_name`` ("" output path: the working directory)."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "output_path": "logs/", "job_name": "run1"}'

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"
