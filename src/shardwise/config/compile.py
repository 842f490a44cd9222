"""The ``compile`` block: torch.compile over each block of the model (docs/compile.md).

    "compile": {"enabled": true, "backend": "inductor", "kwargs": {"mode": "default"}}

``enabled`` (default false): ``initialize`` compiles the model, one region per block, as
``engine.compile(backend, compile_kwargs=kwargs)`` does when called by hand. ``backend``
(default "inductor"): a name from ``torch._dynamo.list_backends()`` ("inductor",
"aot_eager", "eager", ...) or a dotted path ``package.module.fn`` imported at compile time.
``kwargs`` (default {}): more arguments of ``torch.compile`` (``mode``, ``fullgraph``,
``dynamic``, ``options``).

Where these keys come from: DeepSpeed 0.14.0-0.14.3's ``CompileConfig`` had exactly
``enabled`` (False), ``backend`` ("inductor") and ``kwargs`` ({}); DeepSpeed 0.14.4 removed
them, and DeepSpeed 0.19's block holds only DeepCompile's switches (``deepcompile`` and its
options, all off by default) and compiles nothing until ``engine.compile()`` is called (its
default backend is the accelerator's, "inductor" on CPU and CUDA). Both sets are read here:
the older three keys, and 0.19's, of which ``deepcompile: true`` is refused (DeepCompile's
graph passes are not implemented) and the rest, which only DeepCompile reads, are accepted
and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardwise.config.errors import Notes, fail, show
from shardwise.config.schema import build

# The keys of DeepSpeed 0.19's CompileConfig that only DeepCompile reads (deepspeed/compile/config.py).
_DEEPCOMPILE_ONLY = (
    "free_activation",
    "free_activation_threshold",
    "offload_activation",
    "offload_activation_pin_memory",
    "offload_opt_states",
    "double_buffer",
    "symmetric_memory",
    "debug_log",
    "offload_parameters",
    "sync_before_reduce",
    "sync_after_reduce",
    "sync_before_allgather",
    "sync_after_allgather",
    "keep_int_input_tensors",
    "keep_all_input_tensors",
    "passes",
)
# torch.compile's keyword arguments besides model and backend (torch/__init__.py, torch 2.x).
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")


@dataclass(frozen=True)
class CompileConfig:
    """``"compile"``: the module docstring gives each key."""

    EXAMPLE: ClassVar[str] = '{"enabled": true, "backend": "inductor"}'
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        k: "read by DeepSpeed's DeepCompile only" for k in _DEEPCOMPILE_ONLY
    }

    enabled: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = field(default_factory=dict)
    deepcompile: bool = False


def parse_compile(raw: object, notes: Notes) -> CompileConfig:
    """Build ``CompileConfig``; refuse DeepCompile and keyword arguments torch.compile lacks."""
    path = "compile"
    if not isinstance(raw, dict):
        raise fail(path, f"expected an object like {CompileConfig.EXAMPLE}, got {show(raw)}")
    block = build(CompileConfig, raw, path, notes)
    if block.deepcompile:
        raise fail(
            "compile.deepcompile",
            "DeepSpeed's DeepCompile (graph passes that schedule ZeRO's collectives) is not "
            'implemented; set it to false and use "enabled": true, which compiles each block '
            "with shardwise's hooks kept outside the compiled regions (docs/compile.md)",
        )
    check_compile_kwargs(block.kwargs, "compile.kwargs")
    return block


def check_compile_kwargs(kwargs: dict[str, Any], key: str) -> None:
    """ValueError naming ``key`` for an argument torch.compile does not take (``backend``
    has its own key)."""
    for name in kwargs:
        if name == "backend":
            raise fail(f"{key}.backend", 'give the backend as "compile.backend", not in kwargs')
        if name not in COMPILE_KWARGS:
            raise fail(
                f"{key}.{name}",
                f"torch.compile takes no argument {name!r}; it takes {', '.join(COMPILE_KWARGS)}",
            )
