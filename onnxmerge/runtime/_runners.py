"""The search loops' runners: a session and its cache, stepped one token at a time.

``Runner`` is the plain one; where the session's accelerations allow, its cached steps write
into ``PresentBuffers`` and greedy search's go through the int8 head (``GreedyHeadRunner``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from onnxmerge import contract as c
from onnxmerge.runtime import _corpus as corpus
from onnxmerge.runtime import _memory as memory
from onnxmerge.runtime._accelerations import Accelerations, FloatHeadBackoff
from onnxmerge.runtime._greedy_head import GreedyHead, LogitBounds
from onnxmerge.runtime._session import Cache, MergedSession, StepOutput


class SessionSteps:
    """A session and its cache, stepped by the search loops through the runners below."""

    def __init__(
        self,
        session: MergedSession,
        encoder_inputs: dict,
        prompt: np.ndarray,
        max_length: int,
        stop: threading.Event | None = None,
    ):
        self.session = session
        self.encoder_inputs = encoder_inputs
        self.prompt = prompt
        self.max_length = max_length
        self.stop = stop
        self._cache: Cache | None = None
        self._presents: PresentBuffers | None = None

    @property
    def accelerations(self) -> Accelerations:
        return self.session.accelerations

    def _check_stop(self) -> None:
        """End the search between steps once ``generate_many``'s caller has left."""
        if self.stop is not None and self.stop.is_set():
            raise corpus.Stopped

    @property
    def cache(self) -> Cache:
        if self._cache is None:
            raise RuntimeError("the runner has not started")  # the search loops start first
        return self._cache

    def start(self, *, every_position: bool = False) -> np.ndarray:
        """The first step's logits: ``[rows, vocab]`` of the prompt's last position, or with
        ``every_position`` ``[rows, prompt length, vocab]``."""
        self._check_stop()
        out = self.session.first_step(self.encoder_inputs, self.prompt)
        self._cache = out.cache
        if self.session.writes_into and self.accelerations.present_buffers:
            vocab = out.logits.shape[-1]
            ring = self.accelerations.present_ring and self.session.pasts_die_by_layer
            self._presents = PresentBuffers(self.max_length, vocab, out.logits.dtype, ring=ring)
        return out.logits if every_position else out.logits[:, -1, :]

    def _next(self, tokens: np.ndarray, *, greedy: bool) -> StepOutput:
        self._check_stop()
        ids = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1, 1)
        into = logits = None
        if self._presents is not None:
            into = self._presents.next(self.cache.decoder)
            logits = self._presents.logits(ids.shape[0], flat=self.session.flat_logits)
        out = self.session.next_step(ids, self.cache, greedy=greedy, into=into, logits_into=logits)
        self._cache = out.cache
        return out

    def expand(self, n: int) -> None:
        if n > 1:
            self._cache = self.cache.expand(n)

    def keep(self, rows: np.ndarray) -> None:
        """Run on with these rows only: the search dropped the others, which ended."""
        self._cache = self.cache.kept(rows)  # the runner's own cache

    def reorder(self, rows: np.ndarray, *, within_batch: bool = False) -> None:
        if within_batch:  # the runner's own cache: its rows move within its arrays
            self._cache = self.cache.kept(rows, encoder=False)
        else:
            self._cache = self.cache.reorder(rows)


class PresentBuffers:
    """Buffers that cached steps write their presents (``present.*.decoder.*``) into, and one
    that every step's logits are written into, which the search consumes before the next step.

    A step reads its past from some of these buffers and writes its present into others. Where
    the session's pasts die by layer (``MergedSession.pasts_die_by_layer``), they form a ring
    one layer longer than the model: a step's presents of layer ``i`` go where the pasts of
    layer ``i - 1`` are, layer 0's into the spare one, so the cache is held ``(layers + 1) /
    layers`` times; otherwise two sets, by turns, hold it twice.

    onnxruntime would allocate every present in its arena, one position longer each step than
    the last, and a freed past cannot hold the next present: the arena grows by the cache's size
    again and again over a search. Each buffer is mapped once, long enough for ``positions``
    (the search's max_length), and its pages become resident only as the cache grows into
    them: no page is written twice for the first time, and none is kept that the search ends
    without. The logits would take the arena's largest block and a copy into numpy besides.
    """

    def __init__(
        self, positions: int, vocab: int, logits_dtype: np.dtype, *, ring: bool = False
    ) -> None:
        self._positions = positions
        self._ring = ring
        self._slots: list[np.ndarray] = []
        self._step = 0
        self._vocab = vocab
        self._logits_dtype = logits_dtype
        self._space = memory.Workspace()

    def logits(self, rows: int, *, flat: bool) -> np.ndarray:
        """The array a step's logits for ``rows`` rows, one new token each, are written into;
        the same memory every step (mapped once per search, unless its rows grow)."""
        shape = (rows, self._vocab) if flat else (rows, 1, self._vocab)
        return self._space.array("logits", shape, self._logits_dtype)

    def _slot(self, tensor: int, tensors: int) -> int:
        kinds = len(c.CACHE_KINDS)
        if self._ring:
            layers = tensors // kinds + 1
            return (tensor // kinds - self._step) % layers * kinds + tensor % kinds
        return self._step % 2 * tensors + tensor

    def next(self, past: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Arrays for the presents of a step after ``past``; never memory that the step reads
        after writing there (the step before wrote ``past`` at most)."""
        arrays = []
        for i, tensor in enumerate(past):
            rows, heads, length, width = tensor.shape
            shape = (rows, heads, length + 1, width)
            size = rows * heads * (length + 1) * width
            slot = self._slot(i, len(past))
            while slot >= len(self._slots):
                self._slots.append(np.empty(0, tensor.dtype))
            if self._slots[slot].size < size or self._slots[slot].dtype != tensor.dtype:
                # Once per search, unless its rows change or it outgrows max_length. Each step
                # faults in a few pages more: small ones, which the system never compacts for.
                longest = rows * heads * max(self._positions, length + 1) * width
                grown = max(longest, 2 * self._slots[slot].size)
                self._slots[slot] = memory.anonymous_array(grown, tensor.dtype, huge_pages=False)
            arrays.append(self._slots[slot][:size].reshape(shape))
        self._step += 1
        return arrays


class Runner(SessionSteps):
    """The search loops' ``StepRunner``: every step returns the next-token logits."""

    def advance(self, tokens: np.ndarray) -> np.ndarray:
        return self._next(tokens, greedy=False).logits[:, -1, :]


class GreedyHeadRunner(SessionSteps):
    """A runner for greedy search whose cached steps return the greedy head's bounds
    (``GreedyRunner``): full logits only where the session gave no hidden state.

    Where the bounds leave many tokens to take in float (flat logits, as random weights give),
    a step costs more than the float head's; the next steps run the float head, as this
    search's ``FloatHeadBackoff`` says.
    """

    def __init__(
        self,
        session: MergedSession,
        encoder_inputs: dict,
        prompt: np.ndarray,
        max_length: int,
        head: GreedyHead,
        stop: threading.Event | None = None,
    ):
        super().__init__(session, encoder_inputs, prompt, max_length, stop)
        self.head = head
        self.workspace = memory.Workspace()
        self._screened: LogitBounds | None = None
        self.backoff = FloatHeadBackoff(self.accelerations)  # this search's own

    def advance(self, tokens: np.ndarray) -> np.ndarray | LogitBounds:
        head, last, self._screened = self.head, self._screened, None
        share = None if last is None else last.float_share
        taken = None if last is None else last.float_tokens
        if share is not None and self.backoff.costly(share, taken):
            head.drop_pages()  # the many rows it read
        out = self._next(tokens, greedy=self.backoff.next_is_screened(share, taken))
        if out.hidden is not None:
            self._screened = head.bounds(
                out.logits[:, -1, :], out.hidden, self.workspace, self.accelerations
            )
            return self._screened
        return out.logits[:, -1, :]
