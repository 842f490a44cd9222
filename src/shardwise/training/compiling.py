"""DeepSpeed's ``engine.compile`` and ``engine.is_compiled``, as a mixin of the engine.

``engine.compile(backend, compile_kwargs)`` compiles each block of the model on its own
(parallel/compile.py says which regions and where the communication stays); the config block
``"compile": {"enabled": true}`` does the same inside ``initialize``. DeepSpeed 0.19's
signature: ``schedule`` (a DeepCompile pass schedule) and ``compiled_autograd_enabled`` are
refused when given, since neither DeepCompile nor compiled autograd is implemented (compiled
autograd would trace the gradient hooks that launch the reductions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.parallel.compile import compile_blocks, compile_regions, is_compiled
from shardwise.parallel.zero.partition import gathers_nothing

if TYPE_CHECKING:  # annotations only
    from shardwise.config import Config
    from shardwise.topology import ProcessMesh

logger = logging.getLogger("shardwise")

DEFAULT_BACKEND = (
    "inductor"  # DeepSpeed 0.19: get_accelerator().get_compile_backend(), CPU and CUDA
)


def whole_model(cfg: Config, model: nn.Module) -> bool:
    """True when the layout keeps nothing eager between blocks: no ZeRO-3 gathers (stages
    0-2, or a ZeRO-3 that keeps every parameter of ``model`` whole, each under
    ``stage3_param_persistence_threshold``); tensor parallelism's collectives are custom ops
    and its input cache is emptied at the region's entry. Then the model may compile as one
    region (parallel/compile.py; a module hook or checkpoint inside still makes it per
    block; a pipeline stage is always per layer)."""
    zero = cfg.zero_optimization
    if zero.stage < 3:
        return True
    return gathers_nothing(
        model, zero.stage3_param_persistence_threshold, zero.stage3_model_persistence_threshold
    )


class CompileMethods:
    """``compile`` and ``is_compiled`` for an object with ``module`` and ``strategy``."""

    module: Any
    strategy: Any
    config: Config
    mesh: ProcessMesh

    def compile(
        self,
        backend: str | Callable = DEFAULT_BACKEND,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile each block of the model with ``torch.compile(backend=backend,
        **compile_kwargs)``; a second call does nothing (DeepSpeed's rule)."""
        if schedule is not None:
            raise ValueError(
                "engine.compile(schedule=...): DeepCompile pass schedules are not implemented; "
                "leave schedule=None"
            )
        if compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(compiled_autograd_enabled=True) is not supported: compiled "
                "autograd would trace the gradient hooks that launch shardwise's reductions; "
                "leave it False (the backward of each compiled block is compiled anyway)"
            )
        if self.is_compiled:
            return
        names = compile_blocks(
            self.module, backend, compile_kwargs, whole_model(self.config, self.module)
        )
        regroup = getattr(self.strategy, "regroup_for_compile", None)
        if regroup is not None:  # ZeRO-3: gathers move from modules to the compiled regions
            regroup()
        logger.info("compiled %d regions with backend %s", len(names), backend)

    @property
    def is_compiled(self) -> bool:
        """True once every region of the model is compiled (``engine.compile`` or the config)."""
        regions = compile_regions(self.module, whole_model(self.config, self.module))
        return all(is_compiled(m) for _, m in regions)
