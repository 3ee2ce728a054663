"""transformers' ``Cache`` protocol over the runtime's cache.

The merged file's steps take and return the runtime's :class:`onnxmerge.runtime.Cache` (numpy
arrays that share onnxruntime's buffers). ``MergedCache`` holds one and answers what
``GenerationMixin`` asks of a cache: its length, and the row moves of beam search, of
``num_return_sequences`` and of contrastive search, each one call on the runtime's cache. No
tensor is converted between steps, so the next step gets back the very arrays the last returned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import transformers

from onnxmerge.runtime import Cache


class MergedCache(transformers.Cache):
    """A transformers cache whose content is a runtime :class:`~onnxmerge.runtime.Cache`.

    Args:
        cache: the cache a step of the merged file returned.
        num_layers: the decoder's layers (``len(cache)``).
    """

    def __init__(self, cache: Cache, num_layers: int):
        # No layers of transformers' own: every method below reads ``self.merged``.
        super().__init__(layers=[])
        self.merged = cache
        self.num_layers = num_layers

    def __repr__(self) -> str:
        return f"MergedCache(rows={self.merged.rows}, length={self.merged.length})"

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_compileable(self) -> bool:
        """Never: the steps run in onnxruntime, not in torch.compile."""
        return False

    @property
    def is_initialized(self) -> bool:
        """Always: a first step made it."""
        return True

    @property
    def max_batch_size(self) -> int:
        """The rows the cache holds."""
        return self.merged.rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Decoder positions the cache holds."""
        return self.merged.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """-1: no bound on the cached length."""
        return -1  # grows without bound, as transformers' DynamicCache

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reorder: beams move within an input, whose encoder part is one."""
        self.merged = self.merged.reorder(_indices(beam_idx), encoder=False)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``, in that order."""
        self.merged = self.merged.reorder(_indices(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times, each copy after its row."""
        self.merged = self.merged.expand(repeats)

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop ``-max_length``)."""
        keep = max_length if max_length >= 0 else self.merged.length + max_length
        if keep >= self.merged.length:
            return
        if self.merged.tokens is not None:
            self.merged = dataclasses.replace(self.merged, tokens=self.merged.tokens[:, :keep])
        else:
            decoder = tuple(t[:, :, :keep] for t in self.merged.decoder)
            self.merged = dataclasses.replace(self.merged, decoder=decoder)

    def reset(self) -> None:
        """Refused: a step makes the cache, and a new generation makes a new one."""
        raise NotImplementedError("a MergedCache is made by a step; it is never emptied")

    def to_legacy_cache(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per layer ``(key, value, cross key, cross value)`` as torch views of the arrays."""
        if self.merged.tokens is not None:
            raise NotImplementedError("a merged file without past has no key/value cache")
        views = [torch.from_numpy(np.asarray(t)) for t in self.merged.decoder]
        cross = [torch.from_numpy(np.asarray(t)) for t in self.merged.encoder]
        return tuple(
            (views[2 * i], views[2 * i + 1], *(cross[2 * i : 2 * i + 2]))
            for i in range(len(views) // 2)
        )


def _indices(rows: Any) -> np.ndarray:
    if isinstance(rows, torch.Tensor):
        return rows.detach().cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(rows, dtype=np.int64)
