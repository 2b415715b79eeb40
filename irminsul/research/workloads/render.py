"""Trace rendering: each request's segments (`irminsul/model/chat_format.py`) tokenised on their own
with a named tokenizer and concatenated, every segment start recorded for S2 chunking (design §3).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from irminsul.model.chat_format import TEMPLATES, Chat, segment_texts
from irminsul.research.workloads.tokenizers import NamedTokenizer, load_tokenizer
from irminsul.research.workloads.trace import TraceRequest


@dataclass(frozen=True)
class Rendered:
    token_ids: np.ndarray  # [n] int32
    segment_starts: tuple[int, ...]  # strictly increasing, the first is 0


class Renderer:
    """Renders requests with one tokenizer; memoises segment tokenisation (agent turns repeat)."""

    def __init__(self, tokenizer: str | NamedTokenizer = "deepseek", cache_size: int = 200_000):
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.template = TEMPLATES[self.tokenizer.family]
        self._cache: dict[str, np.ndarray] = {}
        self._cache_size = cache_size

    def _encode(self, text: str) -> np.ndarray:
        ids = self._cache.get(text)
        if ids is None:
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int32)
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[text] = ids
        return ids

    def __call__(self, request: TraceRequest) -> Rendered:
        if request.pretokenized:
            ids = np.asarray(request.token_ids, dtype=np.int32)
            return Rendered(ids, request.segments if request.segments else (0,))
        texts = segment_texts(Chat(request.messages, request.tools), self.template)
        pieces = [p for p in (self._encode(t) for t in texts if t) if len(p)]
        starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
        return Rendered(np.concatenate(pieces), tuple(int(s) for s in starts))


def render_trace(
    requests, tokenizer: str | NamedTokenizer = "deepseek", progress: bool | None = None, desc: str = "render"
) -> Iterator[tuple[str, Rendered]]:
    """Yield (session, Rendered) per request, in order; a progress bar on long traces."""
    from tqdm import tqdm

    renderer = Renderer(tokenizer)
    show = len(requests) >= 200 if progress is None else progress
    for r in tqdm(requests, desc=desc, disable=not show, leave=False):
        yield r.session, renderer(r)
