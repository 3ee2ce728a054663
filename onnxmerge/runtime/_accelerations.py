"""What the runtime does beyond the plain search, and the thresholds it does it by.

The plain runtime runs every step through onnxruntime's float head, lets onnxruntime allocate
each step's outputs, runs every row to its batch's end and takes beam search's top-k with a
stable sort. Each field of :class:`Accelerations` switches one thing on top of that; none
changes a token (the tests run the token tests both ways). ``docs/runtime.md`` ("Accelerations")
says what each does and how its threshold was measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from onnxmerge.errors import InvalidArgumentError


@dataclass(frozen=True)
class Accelerations:
    """The runtime's accelerations, each with its switch and the thresholds it runs by.

    ``Accelerations()`` is what ``Seq2SeqModel`` runs with; ``Accelerations.off()`` is the
    plain runtime. Thresholds were measured on the opus-mt-fr-en shape (512 wide, 6 + 6
    layers, 59,514 tokens) on an Intel Xeon (avx512_vnni, amx_int8), 2 threads.

    Attributes:
        greedy_head: greedy steps go through the int8 head of a session-cache entry
            (``session_cache=``), which bounds every logit, and take float logits only of the
            tokens that can still be the largest. At batch 1 the float head reads 122 MB a
            token; measured in ``bench_ctranslate2`` (row ``float32 session cache``).
        greedy_most_of_row: where more than this share of a row's tokens remain within the
            bounds, the row takes its own float product instead of gathering their rows: a
            token's float logit from its gathered row costs about what 100 logits of a product
            do (``bench_corpus_ends``, random untied weights whose logits are flat).
        greedy_most_of_step: where more than this share of a step's logits remain, one
            product over all its rows (same measurement).
        greedy_cheaper_below: a step that took more than this share of its logits in float
            ran slower than the float head (the int8 head saves about half of it), and sends
            the next steps to the float head (same measurement).
        greedy_gather_below: a step that takes fewer tokens than this in float gathers their
            rows and counts as cheap, whatever the two shares above say: they were measured on
            batches, and at batch 1 they are a few hundred tokens. At batch 1 on the
            whisper-tiny shape, gathering 2,048 rows of the head from cold pages took 0.74 ms,
            against the 1.8 ms a step the int8 head saves and 7.3 ms for one row's product over
            the mapped head (``bench_greedy_gather``).
        greedy_rows_at_once: float logits are computed from this many of the head's rows at a
            time, gathered or in place, so that what a step reads stays within 16 MB at the
            opus-mt-fr-en shape's width (and its pages are dropped again part by part).
        greedy_first_float_steps: how many steps go to the float head after the first costly
            int8 step; each costly int8 step after that doubles it.
        greedy_most_float_steps: the most steps the float head then runs before the int8 head
            is tried again (the back-off of 4 to 32 steps, ``bench_corpus_ends``).
        gathered_pages_kept: the mapped pages that steps gather rows from (the embedding, the
            greedy head's float rows) are dropped once the process's resident file pages grew
            by this many bytes since the last drop, rather than after every step, which made
            each step fault its rows in again: two minutes of long-form Whisper through the
            session cache (whisper-tiny shape) took 0.92x the time of dropping about every
            step, and the process's resident file pages grew by 15.8 MB against 6.1 MB; 4 MiB
            took 0.94x, 64 MiB 0.89x, within the runs' spread of 16 MiB's
            (``bench_greedy_gather``).
        drop_finished: rows whose search ended leave their batch, as CTranslate2 drops them,
            instead of running on padding to the batch's end as transformers does; on a model
            whose outputs end at different lengths, 1.7-2.1x faster (``bench_corpus_ends``,
            dropping against keeping).
        present_buffers: cached steps write their presents and logits into the search's own
            buffers (I/O binding on onnxruntime's CPU provider) instead of onnxruntime's
            arena, which grew by the cache's size again and again over a search.
        present_ring: those buffers form a ring one layer longer than the model where the
            graph allows it, holding the cache ``(layers + 1) / layers`` times, not twice.
        session_cache: ``session_cache=`` is used; off, the model opens as without it.
        fast_topk: beam search's top-k bounds each row from column groups and searches only
            the groups that reach the bound, instead of sorting whole rows; on the last step
            of a 200-input 4-beam batch, partitioning whole rows took 1.4 s, 29% of the
            generation (``profile_generate``).
        topk_slabs: the slabs the fast top-k views each row as; few enough that the tiny test
            models' beams x vocab take the fast path too.
        mapped_open: a file holding its weights inline opens through its skeleton, so that
            onnxruntime maps those weights from the file as it maps a data file instead of
            parsing them into memory; off, it opens by path. Float32 opus-mt-fr-en shape:
            the session adds 300 MB against 417 MB and opens in about half the time
            (``bench_ctranslate2``, rows ``float32`` and ``float32 by path``).
    """

    greedy_head: bool = True
    greedy_most_of_row: float = 0.25
    greedy_most_of_step: float = 1 / 128
    greedy_cheaper_below: float = 1 / 256
    greedy_gather_below: int = 2048
    greedy_rows_at_once: int = 8192
    greedy_first_float_steps: int = 4
    greedy_most_float_steps: int = 32
    gathered_pages_kept: int = 16 * 2**20
    drop_finished: bool = True
    present_buffers: bool = True
    present_ring: bool = True
    session_cache: bool = True
    fast_topk: bool = True
    topk_slabs: int = 32
    mapped_open: bool = True

    @classmethod
    def off(cls) -> Accelerations:
        """The plain runtime: every switch off, the thresholds as they are."""
        return cls(**{f.name: False for f in dataclasses.fields(cls) if f.type == "bool"})

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                _refuse(f"{field.name} must be True or False, got {value!r}")
            if field.type == "float" and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0 <= value <= 1
            ):
                _refuse(f"{field.name} must be a share between 0 and 1, got {value!r}")
            if field.type == "int" and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                _refuse(f"{field.name} must be a positive integer, got {value!r}")
        if self.greedy_first_float_steps > self.greedy_most_float_steps:
            _refuse(
                f"greedy_first_float_steps ({self.greedy_first_float_steps}) must not exceed "
                f"greedy_most_float_steps ({self.greedy_most_float_steps})"
            )


def _refuse(message: str) -> None:
    raise InvalidArgumentError(f"Accelerations: {message}", argument="accelerations")


def checked(accelerations: object) -> Accelerations:
    """``accelerations``, or the default where None; refuses anything else."""
    if accelerations is None:
        return Accelerations()
    if not isinstance(accelerations, Accelerations):
        raise InvalidArgumentError(
            "accelerations must be an onnxmerge.runtime.Accelerations, got "
            f"{type(accelerations).__name__}; e.g. Accelerations.off() for the plain runtime",
            argument="accelerations",
        )
    return accelerations


class FloatHeadBackoff:
    """When a greedy search's steps skip the int8 head: after a step whose bounds left too many
    tokens to take in float, the next steps run the float head, more of them each time it
    happens again, and then the int8 head once more to see. One per search: searches running at
    once on one model never see each other's."""

    def __init__(self, accelerations: Accelerations):
        self._settings = accelerations
        self.float_steps = 0  # how many the last costly step sent to the float head
        self._left = 0

    def costly(self, float_share: float, float_tokens: int | None = None) -> bool:
        """Whether a screened step that took this share of its logits in float (``float_tokens``
        of them, where known) cost more than the float head."""
        settings = self._settings
        few = float_tokens is not None and float_tokens < settings.greedy_gather_below
        return float_share > settings.greedy_cheaper_below and not few

    def next_is_screened(
        self, last_float_share: float | None, last_float_tokens: int | None = None
    ) -> bool:
        """Whether the next step goes through the int8 head, given the share of its logits the
        last screened step took in float, and how many (None: the last step was not
        screened)."""
        settings = self._settings
        if last_float_share is not None:
            if self.costly(last_float_share, last_float_tokens):
                self.float_steps = min(
                    max(2 * self.float_steps, settings.greedy_first_float_steps),
                    settings.greedy_most_float_steps,
                )
                self._left = self.float_steps
            else:
                self.float_steps = 0
        screened = self._left == 0
        self._left = max(self._left - 1, 0)
        return screened
