"""Exact greedy tokens from a session-cache entry's int8 head and the float rows of a few tokens.

A cached step run with ``FLAG`` set returns int8 logits (the embedding's rows quantized to int8,
see ``runtime/_greedy_source.py``) and the head's input ``HIDDEN``. The tables bound how far a
token's int8 logit can be from the float one: the rows' quantization error, the input's
(quantized per tensor to uint8, off by at most half a step) and the rounding of both products;
a step takes their largest over the vocabulary, one bound per row. After the logits processors,
which map each score through a non-decreasing function of that score alone, a token whose upper
bound is below the best lower bound cannot be the largest; only the others get float logits,
from the embedding's own rows, and the largest of those is the token a full float head would
pick (up to the rounding of the two float products, as between any two runtimes).
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import numpy as np

from onnxmerge.runtime._accelerations import Accelerations
from onnxmerge.runtime._memory import Workspace

logger = logging.getLogger(__name__)

FLAG = "onnxmerge.greedy_head"
HIDDEN = "onnxmerge.greedy_head.hidden"
TABLES = "greedy_head.npz"
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
    """The float rows of a head and the bounds of its int8 copy.

    ``mapping``: the read-only file mapping ``weight`` lies in, whose pages :meth:`drop_pages`
    drops (where there is none, it does nothing).
    """

    def __init__(
        self,
        weight: np.ndarray,
        bias: np.ndarray | None,
        error,
        l1,
        amax,
        mapping: mmap.mmap | None = None,
    ):
        # [vocab, hidden], mapped: only the rows read become resident.
        self.weight = weight
        self.bias = bias
        self._mapping = mapping if hasattr(mmap, "MADV_DONTNEED") else None
        self._base = 0  # the mapping's address
        if self._mapping is not None:
            self._base = np.frombuffer(self._mapping, np.uint8, 1).ctypes.data
        hidden = weight.shape[1]
        # Per unit of the input's L1 norm: the rows' quantization error, and the rounding of the
        # float products (sums of `hidden` terms). Per unit of the input's quantization step:
        # its rounding, off by at most half a step (plus float32's error in dividing by the
        # step), times the int8 rows' L1 norm. Raised a little for float32's own rounding here.
        # A step's bound takes each at its largest over the vocabulary.
        per_input_l1 = ((error + amax * (hidden * 2.0**-22)) * _RAISE).astype(np.float32)
        per_input_step = (l1 * (0.5 + 2.0**-12) * _RAISE).astype(np.float32)
        self.most_per_input_l1 = float(per_input_l1.max(initial=0.0))
        self.most_per_input_step = float(per_input_step.max(initial=0.0))
        self.most_abs_weight = float(amax.max(initial=0.0))
        self.most_abs_bias = 0.0 if bias is None else float(np.abs(bias).max(initial=0.0))

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
                offset = int(tables["weight_offset"])
                start = offset - offset % mmap.ALLOCATIONGRANULARITY
                with open(folder / name, "rb") as file:
                    length = offset - start + vocab * hidden * 4
                    mapping = mmap.mmap(
                        file.fileno(), length, access=mmap.ACCESS_READ, offset=start
                    )
                if hasattr(mmap, "MADV_RANDOM"):  # a row read maps its own pages, no more
                    mapping.madvise(mmap.MADV_RANDOM)
                weight = np.frombuffer(mapping, np.float32, vocab * hidden, offset - start).reshape(
                    vocab, hidden
                )
                bias = tables["bias"] if tables["bias"].size else None
                per_token = [tables["error"], tables["l1"], tables["amax"]] + [bias] * (
                    bias is not None
                )
                if any(t.shape != (vocab,) for t in per_token):
                    raise ValueError("the tables do not match the vocabulary")
                return cls(weight, bias, tables["error"], tables["l1"], tables["amax"], mapping)
        except Exception as error:  # any damage: greedy steps run the float head instead
            logger.debug("greedy head tables in %s not read: %s", folder, error)
            return None

    def drop_pages(self, tokens: slice = slice(None)) -> None:
        """Drop this process's resident pages of the rows of ``tokens``: a step that reads many
        rows would leave them resident beside the float head's own packed copy. They stay in
        the page cache, and a later read maps them back."""
        if self._mapping is None:
            return
        rows = self.weight[tokens]
        offset = rows.ctypes.data - self._base
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._mapping.madvise(mmap.MADV_DONTNEED, start, offset + rows.nbytes - start)
        except (OSError, ValueError) as error:  # pragma: no cover - nothing is lost
            logger.debug("greedy head pages not dropped: %s", error)

    def bounds(
        self,
        approximate: np.ndarray,
        hidden: np.ndarray,
        workspace: Workspace | None = None,
        accelerations: Accelerations | None = None,
    ) -> LogitBounds:
        """``approximate`` ``[rows, vocab]``: the int8 head's logits of one step; ``hidden``
        ``[rows, hidden]``: the input it quantized (one tensor, one scale). ``workspace``: the
        search's arrays to work in, kept from step to step; ``accelerations``: the shares of
        tokens left beyond which whole rows take the float product (default: as measured)."""
        return LogitBounds(
            self, approximate, hidden, workspace or Workspace(), accelerations or Accelerations()
        )


class LogitBounds:
    """One step's int8 logits with their bounds; :meth:`argmax` gives the greedy tokens."""

    def __init__(
        self,
        head: GreedyHead,
        approximate: np.ndarray,
        hidden: np.ndarray,
        workspace: Workspace,
        accelerations: Accelerations,
    ):
        self.head = head
        self.approximate = approximate
        self.hidden = hidden
        self.workspace = workspace
        self.accelerations = accelerations
        # After argmax: the share of the step's logits it took in float beyond one a row (the
        # least any step takes), which is what the bounds cost, and how many they are.
        self.float_share = 0.0
        self.float_tokens = 0

    def slack(self) -> np.ndarray:
        """``[rows, 1]``: how far any float logit of each row can be from its int8 logit.

        Taken at the head's largest per-token quantities, not token by token: a few more tokens
        may remain, but the bounds cost two passes over ``[rows, vocab]`` instead of six.
        """
        head, hidden = self.head, self.hidden.astype(np.float64)
        l1 = np.abs(hidden).sum(axis=1)
        step = (max(hidden.max(), 0.0) - min(hidden.min(), 0.0)) / 255
        off = l1 * head.most_per_input_l1 + step * head.most_per_input_step
        # No int8 logit is larger than the float logit's bound plus ``off``.
        largest = l1 * head.most_abs_weight + head.most_abs_bias + off
        return ((off + largest * 2.0**-19) * _RAISE).astype(np.float32)[:, None]

    def argmax(self, processors, input_ids: np.ndarray) -> np.ndarray:
        """``argmax(processors(input_ids, float logits))`` per row; ``processors`` must map
        each score through a non-decreasing function of that score alone, except the scores of
        the columns its ``exact_columns(input_ids)`` names (a slice, where it has the method
        and returns one), which it may read as a whole: those get float logits before any
        processor runs. ``approximate`` is worked in: it is left
        holding the processed int8 logits, or float ones of the tokens that may be the
        largest."""
        approximate = self.approximate
        if not approximate.flags.writeable:
            approximate = approximate.copy()
        exact_columns = getattr(processors, "exact_columns", None)
        columns = exact_columns(input_ids) if exact_columns is not None else None
        if columns is not None:
            self._write_columns(approximate, columns)
        masks_only = getattr(processors, "masks_only", None)
        if columns is None and masks_only is not None and masks_only(input_ids):
            scores = processors(input_ids, approximate)
            return self._argmax_of_unmasked(scores, processors, input_ids)
        shape = approximate.shape
        space, slack = self.workspace, self.slack()
        lower = np.subtract(approximate, slack, out=space.array("lower", shape, np.float32))
        upper = np.add(approximate, slack, out=space.array("upper", shape, np.float32))
        if columns is not None:  # known: no slack either way
            lower[:, columns] = upper[:, columns] = approximate[:, columns]
        floor = processors(input_ids, lower).max(axis=1)
        upper = processors(input_ids, upper)
        reaching = np.greater_equal(upper, floor[:, None], out=space.array("mask", shape, bool))
        if columns is not None:
            reaching[:, columns] = False
        row_of, token_of, exact, whole = self._candidates(
            reaching, ~np.isfinite(floor), none_left_is_whole=columns is None
        )
        # A token left out keeps its int8 logit: below its upper bound, so below the floor after
        # the processors, and the largest float logit reaches the floor.
        self._write_whole_rows(approximate, whole)
        approximate[row_of, token_of] = exact
        return np.argmax(processors(input_ids, approximate), axis=1)

    def _argmax_of_unmasked(
        self, scores: np.ndarray, processors, input_ids: np.ndarray
    ) -> np.ndarray:
        """``argmax`` where the processors only set scores to -inf: ``scores`` are the int8
        logits after them. A row's largest float logit is at least its largest int8 logit less
        the slack, and no float logit is more than the slack above its int8 logit: a token whose
        int8 logit is more than twice the slack below the row's largest cannot be the largest.
        One pass finds each row's largest and one its candidates, instead of the passes over
        each bound and the processors run on both."""
        top = scores.max(axis=1)
        threshold = top.astype(np.float64) - 2 * self.slack()[:, 0].astype(np.float64)
        # In float32, rounded down: a candidate may be added, none dropped.
        threshold = np.nextafter(threshold.astype(np.float32), np.float32(-np.inf))
        reaching = np.greater_equal(
            scores, threshold[:, None], out=self.workspace.array("mask", scores.shape, bool)
        )
        # Every token masked (no finite largest) or a NaN: the row's full product.
        row_of, token_of, exact, whole = self._candidates(reaching, ~np.isfinite(top))
        tokens = np.empty(len(scores), np.int64)
        # Per row, the largest float logit, the lower token on a tie (as argmax gives it).
        order = np.lexsort((token_of, -exact, row_of))
        first = np.flatnonzero(np.diff(row_of[order], prepend=-1))
        tokens[row_of[order[first]]] = token_of[order[first]]
        if whole.any():  # processors read whole batches: run again, masks stay as they were
            self._write_whole_rows(scores, whole)
            tokens[whole] = np.argmax(processors(input_ids, scores)[whole], axis=1)
        return tokens

    def _candidates(
        self, reaching: np.ndarray, unbounded: np.ndarray, *, none_left_is_whole: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows and tokens ``reaching`` holds, with their float logits, found in one flat
        search over the mask (ten times a 2-D one's speed); and the rows that take the product
        over all of their tokens instead, read in place rather than gathered: ``unbounded``
        ones, those with too many left, and unless told otherwise (where some columns are
        float already) those with no candidate."""
        rows, vocab = reaching.shape
        row_of, token_of = np.divmod(np.flatnonzero(reaching), vocab)
        counts = np.bincount(row_of, minlength=rows)
        # Where many tokens remain, a product over the row (or every row) costs less than
        # gathering theirs.
        most = self.accelerations
        whole = unbounded | (counts > most.greedy_most_of_row * vocab)
        if none_left_is_whole:
            whole |= counts == 0
        many = row_of.size > most.greedy_most_of_step * rows * vocab
        if many and row_of.size >= most.greedy_gather_below:
            whole[:] = True
        picked = ~whole[row_of]
        row_of, token_of = row_of[picked], token_of[picked]
        taken = token_of.size + int(whole.sum()) * vocab
        self.float_tokens = max(taken - rows, 0)
        self.float_share = self.float_tokens / max(rows * vocab, 1)
        head = self.head
        exact = np.empty(token_of.size, np.float32)
        hidden_size = head.weight.shape[1]
        space = self.workspace
        chunk = self.accelerations.greedy_rows_at_once
        for start in range(0, token_of.size, chunk):
            part = slice(start, start + chunk)
            count = token_of[part].size
            rows_read = space.array("gathered_rows", (count, hidden_size), np.float32)
            inputs = space.array("gathered_inputs", (count, hidden_size), np.float32)
            # The indices are in range: "clip" skips checking them, at three times the speed.
            np.take(head.weight, token_of[part], axis=0, out=rows_read, mode="clip")
            np.take(self.hidden, row_of[part], axis=0, out=inputs, mode="clip")
            np.einsum("ij,ij->i", rows_read, inputs, out=exact[part])
        if head.bias is not None:
            exact += head.bias[token_of]
        return row_of, token_of, exact, whole

    def _write_columns(self, logits: np.ndarray, columns: slice) -> None:
        """Write the float logits of ``columns`` (a slice of the vocabulary) of every row over
        theirs in ``logits``: one product over those rows of the head."""
        head = self.head
        # einsum, not a BLAS product: BLAS's own threads would contend with onnxruntime's.
        logits[:, columns] = np.einsum("ij,kj->ik", self.hidden, head.weight[columns])
        if head.bias is not None:
            logits[:, columns] += head.bias[columns]

    def _write_whole_rows(self, logits: np.ndarray, whole: np.ndarray) -> None:
        """Write the float logits of the rows ``whole`` selects over theirs in ``logits``."""
        head, rows = self.head, np.flatnonzero(whole)
        if rows.size:  # one pass over the weight for all of them, a part resident at a time
            inputs = self.hidden[rows]
            chunk = self.accelerations.greedy_rows_at_once
            for start in range(0, head.weight.shape[0], chunk):
                part = slice(start, start + chunk)
                logits[rows, part] = inputs @ head.weight[part].T
                head.drop_pages(part)
        if head.bias is not None:
            logits[whole] += head.bias
