"""``Saved``: what one micro-batch of one layer keeps for backward, by kind, and per rank."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.parallel.flat import ceil_div


@dataclass(frozen=True)
class Saved:
    """Bytes of saved tensors (activations.py's kinds: split, tp_input, replicated).

    ``vocab_loss`` bytes (within ``split``) were saved inside a vocabulary-parallel loss
    module, on ``vocab_rows`` targets over a vocabulary of ``vocab``: with tensor parallelism
    that loss saves what tensor/vocab.py's ``_VocabParallelCE`` keeps instead: the fp32
    softmax of the rank's ceil(V / t) columns, the local target index (int64), two masks
    (bool) per row, and the count of targets for the mean (a 0-dim int64).
    """

    split: int = 0
    tp_input: int = 0
    replicated: int = 0
    vocab_loss: int = 0
    vocab_rows: int = 0
    vocab: int = 0

    def per_rank(self, tp: int, sequence_parallel: bool) -> float:
        rep = self.replicated / tp if sequence_parallel else self.replicated
        split = self.split
        if tp > 1 and self.vocab_rows:
            split -= self.vocab_loss
            rep += self.vocab_rows * (4 * ceil_div(self.vocab, tp) + 8 + 2) + 8
        return split / tp + self.tp_input + rep

    @property
    def total(self) -> int:
        return self.split + self.tp_input + self.replicated
