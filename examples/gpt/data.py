"""The corpus (CPython's own standard library sources), a character tokenizer, and windows.

Every Python install ships its standard library, so the demo needs no download, and a fixed
sorted file list makes the corpus identical on every machine with the same Python version
(``corpus_digest`` lets two machines check that).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

UNK = "\ufffd"  # stands for any character the training text never showed
# Generated at build time (install paths, compiler flags): differ between machines.
_MACHINE_SPECIFIC = ("_sysconfigdata", "sitecustomize", "usercustomize")


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The top-level ``*.py`` files of the standard library, sorted by name.

    Top level only: sub-packages (tkinter, idlelib, ...) are split into separate packages by
    some Linux distributions, and site-packages differs per machine; the top level alone
    holds over 4 MB of code.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    names = sorted(
        p.name
        for p in root.iterdir()
        if p.suffix == ".py" and p.is_file() and not p.name.startswith(_MACHINE_SPECIFIC)
    )
    return [root / n for n in names]


def load_corpus(max_mb: float = 3.0, root: str | os.PathLike | None = None) -> str:
    """The first ``max_mb`` MB (10^6 characters) of the concatenated stdlib sources."""
    limit = int(max_mb * 1e6)
    parts, size = [], 0
    for path in stdlib_files(root):
        # A few files are not UTF-8 on purpose; replacing bad bytes stays deterministic.
        text = path.read_bytes().decode("utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    if not parts:
        raise FileNotFoundError(f"no .py files found in the standard library at {root}")
    return "".join(parts)[:limit]


def corpus_digest(text: str) -> str:
    """Short sha256 of the text: equal digests mean two runs trained on the same corpus."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def split_corpus(text: str, val_fraction: float = 0.1, chunk: int = 32_768) -> tuple[str, str]:
    """Deterministic split: every k-th chunk of ``chunk`` characters goes to validation.

    Interleaving chunks (rather than taking the tail) keeps validation drawn from the same
    mix of files as training: the sorted file list puts very different modules at its end.
    A short text gets smaller chunks, so that validation still holds at least two of them.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    every = round(1 / val_fraction)
    chunk = max(1, min(chunk, len(text) // (2 * every)))
    chunks = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    val = [c for i, c in enumerate(chunks) if i % every == every - 1]
    train = [c for i, c in enumerate(chunks) if i % every != every - 1]
    return "".join(train), "".join(val)


class CharTokenizer:
    """Characters <-> ids; the vocabulary is the sorted set of characters plus ``UNK``."""

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = list(chars)
        if UNK not in self.chars:
            raise ValueError("the vocabulary must contain the UNK character")
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.unk_id = self.stoi[UNK]

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text) | {UNK}))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unk, stoi = self.unk_id, self.stoi
        return [stoi.get(c, unk) for c in text]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({"chars": self.chars, "unk": UNK}, ensure_ascii=True))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        return cls(json.loads(Path(path).read_text())["chars"])


class CharWindows(Dataset):
    """Map-style dataset: item i is the window starting at ``i * stride``.

    x = tokens[s : s + block_size], y = tokens[s + 1 : s + block_size + 1] (the next character
    at every position). Index -> window is a pure function, so a distributed sampler can shard
    and shuffle indices and every rank agrees on what each index means.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {block_size} + 1")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        s = (i % len(self)) * self.stride
        w = self.tokens[s : s + self.block_size + 1].long()
        return w[:-1], w[1:]


def build_datasets(
    max_mb: float, block_size: int, val_fraction: float = 0.1
) -> tuple[CharWindows, CharWindows, CharTokenizer, dict]:
    """(train windows, val windows, tokenizer, facts about the corpus) in one call.

    The vocabulary comes from the training part only: what validation alone contains maps to
    UNK, as it would for text the model meets after training.
    """
    text = load_corpus(max_mb)
    train_text, val_text = split_corpus(text, val_fraction)
    tok = CharTokenizer.from_text(train_text)
    # int32 storage: half of int64's memory for the whole corpus; windows widen to long.
    train = torch.tensor(tok.encode(train_text), dtype=torch.int32)
    val = torch.tensor(tok.encode(val_text), dtype=torch.int32)
    info = {
        "chars": len(text),
        "train_chars": len(train_text),
        "val_chars": len(val_text),
        "vocab_size": tok.vocab_size,
        "digest": corpus_digest(text),
    }
    return CharWindows(train, block_size), CharWindows(val, block_size), tok, info
