"""``apply_activation_checkpointing(model, checkpoint_layers)``: recompute chosen blocks in backward.

Each chosen module keeps its place and its name: its ``forward`` is replaced, on the instance, by
one that runs the original under ``shardwise.parallel.activation.recompute.checkpoint``. No wrapper module is
inserted, so ``named_parameters``, ``state_dict`` keys, checkpoints and TP plans that name
modules are unchanged, and the module's own hooks still fire once per call (its children's fire
again in the recompute).

Memory, for a chain of L blocks each saving A bytes of activations for backward from an input
of X bytes: without checkpointing forward keeps L*A; with every block checkpointed it keeps
L*X, plus the A of one block while that block is recomputed in backward. For the example GPT
block, A is about 20 times X (tests/test_activation_checkpointing.py measures it).

With ``partition_group`` (``partition_activations``), each tensor-parallel rank keeps 1/N of a
chosen module's inputs instead of all of it (``shardwise.parallel.tensor.partitioned_activations``).

Applied after tensor parallelism (so a block recomputes its sharded layers and their
collectives) and before the precision cast and ZeRO-3 (whose hooks then fire inside the
recompute, gathering parameters as in the first forward).
"""

from __future__ import annotations

import fnmatch
import types
from typing import TYPE_CHECKING, Any

from torch import nn

from shardwise.config import ConfigError
from shardwise.parallel.activation.recompute import run_checkpointed
from shardwise.rank_log import log_dist

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

_INNER = "_shardwise_checkpointed_forward"  # the original forward, kept on the instance
INNER = _INNER  # what parallel/compile.py replaces to compile inside the checkpoint
_GROUP = "_shardwise_checkpoint_group"  # partition_activations' group (or None), on the instance


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_layers: str | list[str | int] | None,
    key: str = "checkpoint_layers",
    partition_group: ProcessGroup | None = None,
) -> list[str]:
    """Checkpoint the modules ``checkpoint_layers`` chooses; returns their names, in model order.

    ``checkpoint_layers``: "all" (every entry of the block list, see :func:`block_list`), or a
    list of block indices (ints) and module names / patterns (strings; ``*`` and other glob
    characters match within one dotted component). None or [] chooses nothing. A name that
    matches nothing, an index out of range, or a module chosen inside another chosen one raises
    ConfigError naming ``key`` (``initialize`` passes the config key). Applying twice is a no-op
    for modules already checkpointed.

    ``partition_group``: a tensor-parallel group over which the chosen modules' inputs are
    replicated; each rank then keeps 1/N of them (``partition_activations``).
    """
    names = resolve_checkpoint_layers(model, checkpoint_layers, key)
    if names or getattr(model, "activation_checkpoint_interval", 0):
        disable_kv_cache(model)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if _INNER not in module.__dict__:
            # Bound methods: deepcopy(model) rebinds both to the copy, as it should.
            module.__dict__[_INNER] = module.forward
            module.__dict__[_GROUP] = GroupRef(partition_group)
            module.forward = types.MethodType(_checkpointed_forward, module)
    return names


def disable_kv_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every (Hugging Face) module of ``model`` that has it
    on, as Hugging Face does when it checkpoints: a recompute would append each block's keys
    and values to the cache a second time (16 tokens would leave 32 cached positions, and
    attention then reads the doubled keys). Returns the names of the modules changed."""
    changed = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(name or type(module).__name__)
    if changed:
        log_dist(
            f"activation checkpointing: use_cache=True is incompatible, setting use_cache=False "
            f"on {changed[0]}" + (f" and {len(changed) - 1} more" if len(changed) > 1 else ""),
            ranks=[0],
        )
    return changed


def is_checkpointed(module: nn.Module) -> bool:
    """True when ``module``'s forward runs under activation checkpointing."""
    return _INNER in module.__dict__


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return run_checkpointed(self.__dict__[_INNER], args, kwargs, self.__dict__[_GROUP].group)


class GroupRef:
    """A process group held by a module: ``deepcopy(model)`` shares it (groups are not copied)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> GroupRef:
        return self


def resolve_checkpoint_layers(
    model: nn.Module,
    checkpoint_layers: str | list[str | int] | None,
    key: str = "checkpoint_layers",
) -> list[str]:
    """The module names ``checkpoint_layers`` chooses in ``model`` (see
    :func:`apply_activation_checkpointing`), in ``named_modules`` order, each once."""
    if not checkpoint_layers:
        return []
    if checkpoint_layers == "all":
        prefix, blocks = block_list(model, key)
        return [f"{prefix}.{i}" if prefix else str(i) for i in range(len(blocks))]
    if isinstance(checkpoint_layers, str):
        raise ConfigError(
            f'{key}: expected "all" or a list of module names / block indices, got '
            f"{checkpoint_layers!r} (a single name goes in a list: [{checkpoint_layers!r}])",
            key=key,
        )
    names = [n for n, _ in model.named_modules() if n]
    chosen: set[str] = set()
    for item in checkpoint_layers:
        chosen |= _resolve_item(model, names, item, key)
    ordered = [n for n in names if n in chosen]
    for name in ordered:
        outer = [o for o in ordered if name.startswith(o + ".")]
        if outer:
            raise ConfigError(
                f"{key}: {name!r} lies inside {outer[0]!r}, which is checkpointed already; "
                "choose one of them",
                key=key,
            )
    return ordered


def _resolve_item(model: nn.Module, names: list[str], item: Any, key: str) -> set[str]:
    if isinstance(item, int) and not isinstance(item, bool):
        prefix, blocks = block_list(model, key)
        if not 0 <= item < len(blocks):
            raise ConfigError(
                f"{key}: block index {item} is out of range: {prefix or 'the model'} holds "
                f"{len(blocks)} blocks (0..{len(blocks) - 1})",
                key=key,
            )
        return {f"{prefix}.{item}" if prefix else str(item)}
    if not isinstance(item, str) or not item:
        raise ConfigError(
            f"{key}: entries are module names (strings) or block indices (ints), got {item!r}",
            key=key,
        )
    found = {n for n in names if _matches(n, item)}
    if not found:
        raise ConfigError(
            f"{key}: {item!r} matches no module of {type(model).__name__}; its top-level "
            f"modules are {[n for n in names if '.' not in n]} (patterns match one dotted "
            'component per "*", e.g. "blocks.*")',
            key=key,
        )
    return found


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matches ``name`` component by component (``*`` never crosses a dot)."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(
        fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want, strict=True)
    )


def block_list(model: nn.Module, key: str = "checkpoint_layers") -> tuple[str, nn.ModuleList]:
    """The model's block list, (name, ModuleList): its shallowest ``nn.ModuleList`` (GPT's
    ``blocks``, Hugging Face's ``model.layers``). Several at that depth is ambiguous: an error
    lists them so that the user names one (e.g. ``["encoder.*"]``)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ConfigError(
            f"{key}: {type(model).__name__} has no nn.ModuleList of blocks to checkpoint; "
            'name the modules instead, e.g. ["layer1", "layer2"]',
            key=key,
        )
    depth = min(_depth(n) for n, _ in lists)
    shallowest = [(n, m) for n, m in lists if _depth(n) == depth]
    if len(shallowest) > 1:
        options = [n or "(the model)" for n, _ in shallowest]
        raise ConfigError(
            f"{key}: {type(model).__name__} has several block lists {options}; name the "
            f'blocks instead, e.g. ["{shallowest[0][0]}.*"]',
            key=key,
        )
    return shallowest[0]


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1
