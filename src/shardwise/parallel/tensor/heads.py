"""Attention heads and packed parts: what a tensor-parallel split must keep whole.

A module with both column- and row-split children (attention, an MLP) hands each rank
out/n of its column layers' outputs. When it is attention, those must be whole heads: with
``head_dim`` d, (out / n) % d == 0. Its head-count attributes (``n_head``, ``num_heads``, ...)
are divided by n, so that its forward reshapes by the local heads; a ``split_size`` (GPT-2's
width of one packed q/k/v part) too when its column layer is packed.
"""

from __future__ import annotations

from torch import nn

from shardwise.parallel.tensor.layers import linear_dims

HEAD_ATTRS = (
    "n_head",
    "n_heads",
    "num_heads",
    "num_attention_heads",
    "n_kv_heads",
    "num_kv_heads",
    "num_key_value_heads",
)


def packs_of(model: nn.Module, name: str) -> int:
    """How many parts end to end a linear layer's outputs hold: its parent's ``split_size``
    parts (GPT-2 attention splits c_attn's output by it), 2 for a fused gate|up (a name with
    "gate_up": Hugging Face's convention, its parent chunks the output in two), else 1 (plain)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    width = getattr(parent, "split_size", None)
    dims = linear_dims(model.get_submodule(name))
    out = dims[1] if dims is not None else 0
    if isinstance(width, int) and 0 < width < out and out % width == 0:
        return out // width
    return 2 if "gate_up" in child and out % 2 == 0 else 1


def _attention_parents(model: nn.Module, matches: dict[str, str]) -> dict[str, list[str]]:
    """Modules with both column and row children (attention, MLP) -> their column children."""
    cols: dict[str, list[str]] = {}
    rows = set()
    for name, style in matches.items():
        parent = name.rpartition(".")[0]
        if style in ("colwise", "packed_colwise"):
            cols.setdefault(parent, []).append(name)
        elif style == "rowwise":
            rows.add(parent)
    return {p: c for p, c in cols.items() if p in rows}


def heads_to_divide(
    model: nn.Module, matches: dict[str, str], tp: int
) -> list[tuple[nn.Module, str]]:
    """Check that heads divide the TP size; return the head-count attributes to divide."""
    to_divide = []
    for parent_name, children in _attention_parents(model, matches).items():
        parent = model.get_submodule(parent_name) if parent_name else model
        label = parent_name or type(model).__name__
        head_dim = getattr(parent, "head_dim", None)
        for child in children if isinstance(head_dim, int) and head_dim > 0 else []:
            out = linear_dims(model.get_submodule(child))[1]
            out //= packs_of(model, child) if matches[child] == "packed_colwise" else 1
            if (out // tp) % head_dim:
                raise ValueError(
                    f"{label}: {out // head_dim} attention heads (head_dim {head_dim} in "
                    f"{child}) cannot be split over tensor-parallel size {tp} "
                    "(tensor_parallel.size): use a TP size that divides the number of heads"
                )
        for attr in HEAD_ATTRS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                if value % tp:
                    raise ValueError(
                        f"{label}.{attr} = {value} is not divisible by the tensor-parallel "
                        f"size {tp} (tensor_parallel.size): use a TP size that divides the number "
                        "of heads"
                    )
                to_divide.append((parent, attr))
        packed = any(matches[c] == "packed_colwise" for c in children)
        if packed and isinstance(getattr(parent, "split_size", None), int):
            to_divide.append((parent, "split_size"))
    return to_divide
