"""DeepSpeed's monitoring and profiling blocks, keys and defaults as DeepSpeed's
(``deepspeed/monitor/config.py``, ``comm/config.py``, ``profiling/config.py``, 0.19.8;
the monitor blocks pinned by tests/test_config_defaults.py).
What they do: shardwise/monitor/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from shardwise.config.errors import fail
from shardwise.config.schema import spec

# Collective names comms_logger.prof_ops may list: shardwise's (as comm.stats() names them) and
# DeepSpeed's function names for the same collectives.
COMM_OPS: dict[str, str] = {
    **{
        op: op
        for op in (
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "reduce",
            "gather",
            "scatter",
            "all_to_all",
            "send",
            "recv",
            "barrier",
        )
    },
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "isend": "send",
    "irecv": "recv",
}


@dataclass(frozen=True)
class MonitorConfig:
    """``{"enabled": true, "output_path": "logs/", "job_name": "run1"}``: events go under
    ``output_path/job_name`` ("" output path: the working directory)."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "output_path": "logs/", "job_name": "run1"}'

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    """``"wandb"``: ``wandb.init(project=, group=, entity=team)`` on rank 0."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "project": "my-project"}'

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True)
class CometConfig:
    """``"comet"``: ``comet_ml.start(...)`` on rank 0, a metric every ``samples_log_interval``."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "project": "my-project"}'

    enabled: bool = False
    samples_log_interval: int = spec(100, ge=1)
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


@dataclass(frozen=True)
class CommsLoggerConfig:
    """``"comms_logger"``: time each collective (all of them with ``prof_all``, else those
    named in ``prof_ops``); ``verbose`` logs every call; ``debug`` adds the caller's name."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "prof_all": true}'

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i, op in enumerate(self.prof_ops):
            if op not in COMM_OPS:
                raise fail(
                    f"comms_logger.prof_ops[{i}]",
                    f"unknown collective {op!r}; shardwise times {', '.join(sorted(COMM_OPS))}",
                )


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """``"flops_profiler"``: profile the forward of step ``profile_step`` on rank 0.

    ``profile_step`` is not bounded, as in DeepSpeed: a step the run never reaches (0 or a
    negative one, such as Megatron-DeepSpeed's ``-1``) means nothing is profiled."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "profile_step": 1}'

    enabled: bool = False
    recompute_fwd_factor: float = spec(0.0, ge=0)
    profile_step: int = 1
    module_depth: int = spec(-1, ge=-1)
    top_modules: int = spec(1, ge=1)
    detailed: bool = True
    output_file: str | None = None
