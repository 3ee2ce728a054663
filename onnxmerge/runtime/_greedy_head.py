"""Exact greedy tokens from a session-cache entry's int8 head and the float rows of a few tokens.

A cached step run with ``FLAG`` set returns int8 logits (the embedding's rows quantized to int8,
see ``runtime/_greedy_source.py``) and the head's input ``HIDDEN``. For each token the tables
bound how far its int8 logit can be from the float one: the rows' quantization error, the
input's (quantized per tensor to uint8, off by at most half a step) and the rounding of both
products. After the logits processors, which map each score through a non-decreasing
function of that score alone, a token whose upper bound is below the best lower bound cannot be
the largest; only the others get float logits, from the embedding's own rows, and the largest
of those is the token a full float head would pick (up to the rounding of the two float products,
as between any two runtimes).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

FLAG = "onnxmerge.greedy_head"
HIDDEN = "onnxmerge.greedy_head.hidden"
TABLES = "greedy_head.npz"
# Where more tokens than this share of the vocabulary remain, one product over all rows is cheaper.
_MOST = 0.25
# float32 sums here round too: every bound is taken this much wider.
_RAISE = 1 + 2.0**-10


def write_tables(
    folder: Path,
    *,
    weight_file: str,
    weight_offset: int,
    weight_shape: tuple[int, int],
    bias: np.ndarray | None,
    error: np.ndarray,
    l1: np.ndarray,
    amax: np.ndarray,
) -> None:
    """The tables :meth:`GreedyHead.load` reads; the weight stays in the entry's data file."""
    np.savez(
        folder / TABLES,
        weight_file=np.array(weight_file),
        weight_offset=np.array(weight_offset, np.int64),
        weight_shape=np.array(weight_shape, np.int64),
        bias=np.zeros(0, np.float32) if bias is None else np.asarray(bias, np.float32),
        error=error,
        l1=l1,
        amax=amax,
    )


class GreedyHead:
    """The float rows of a tied head and the bounds of its int8 copy."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None, error, l1, amax):
        self.weight = weight  # [vocab, hidden], mapped: only the rows read become resident
        self.bias = bias
        hidden = weight.shape[1]
        # Per unit of the input's L1 norm: the rows' quantization error, and the rounding of the
        # float products (sums of `hidden` terms). Per unit of the input's quantization step:
        # its rounding, off by at most half a step (plus float32's error in dividing by the
        # step), times the int8 rows' L1 norm. Raised a little for float32's own rounding here.
        self.per_input_l1 = ((error + amax * (hidden * 2.0**-22)) * _RAISE).astype(np.float32)
        self.per_input_step = (l1 * (0.5 + 2.0**-12) * _RAISE).astype(np.float32)

    @classmethod
    def load(cls, folder: Path) -> GreedyHead | None:
        """The head whose tables are in ``folder``, or None where there are none to read."""
        path = folder / TABLES
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as tables:
                name = str(tables["weight_file"])
                if Path(name).name != name:
                    raise ValueError(f"weight file {name!r} is not a name in the entry")
                vocab, hidden = (int(n) for n in tables["weight_shape"])
                weight = np.memmap(
                    folder / name,
                    dtype=np.float32,
                    mode="r",
                    offset=int(tables["weight_offset"]),
                    shape=(vocab, hidden),
                )
                bias = tables["bias"] if tables["bias"].size else None
                per_token = [tables["error"], tables["l1"], tables["amax"]] + [bias] * (
                    bias is not None
                )
                if any(t.shape != (vocab,) for t in per_token):
                    raise ValueError("the tables do not match the vocabulary")
                return cls(weight, bias, tables["error"], tables["l1"], tables["amax"])
        except Exception as error:  # any damage: greedy steps run the float head instead
            logger.debug("greedy head tables in %s not read: %s", folder, error)
            return None

    def bounds(self, approximate: np.ndarray, hidden: np.ndarray) -> LogitBounds:
        """``approximate`` ``[rows, vocab]``: the int8 head's logits of one step; ``hidden``
        ``[rows, hidden]``: the input it quantized (one tensor, one scale)."""
        return LogitBounds(self, approximate, hidden)


class LogitBounds:
    """One step's int8 logits with their bounds; :meth:`argmax` gives the greedy tokens."""

    def __init__(self, head: GreedyHead, approximate: np.ndarray, hidden: np.ndarray):
        self.head = head
        self.approximate = approximate
        self.hidden = hidden

    def slack(self) -> np.ndarray:
        """``[rows, vocab]``: how far each float logit can be from its int8 logit."""
        head, hidden = self.head, self.hidden.astype(np.float64)
        l1 = np.abs(hidden).sum(axis=1)
        step = (max(hidden.max(), 0.0) - min(hidden.min(), 0.0)) / 255
        slack = np.abs(self.approximate) * np.float32(2.0**-19)  # the int8 logits' rounding
        slack += np.outer(l1.astype(np.float32), head.per_input_l1)
        slack += np.float32(step) * head.per_input_step
        return slack

    def argmax(self, processors, input_ids: np.ndarray) -> np.ndarray:
        """``argmax(processors(input_ids, float logits))`` per row; ``processors`` must map
        each score through a non-decreasing function of that score alone."""
        slack = self.slack()
        lower = processors(input_ids, self.approximate - slack)
        upper = processors(input_ids, np.add(self.approximate, slack, out=slack))
        best_lower = lower.max(axis=1)
        head = self.head
        vocab = head.weight.shape[0]
        exact = np.full(self.approximate.shape, -np.inf, dtype=np.float32)
        for row, (hidden, floor) in enumerate(zip(self.hidden, best_lower, strict=True)):
            found = np.flatnonzero(upper[row] >= floor) if np.isfinite(floor) else None
            tokens: np.ndarray | slice = found if found is not None else slice(None)
            if found is not None and found.size > _MOST * vocab:
                tokens = slice(None)  # every row, read in place rather than gathered
            logits = head.weight[tokens] @ hidden
            if head.bias is not None:
                logits += head.bias[tokens]
            exact[row, tokens] = logits
        return np.argmax(processors(input_ids, exact), axis=1)
