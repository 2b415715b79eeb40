"""The public, offline entry point: `LLM(model).generate(...)` and `LLM(model).score(...)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from irminsul.bundled import bundled_model
from irminsul.engine.engine import Engine
from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import RequestStats
from irminsul.errors import RequestError
from irminsul.model.loader import load_model
from irminsul.model.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: RequestStats
    finish_reason: str
    prompt_token_ids: list[int]


def checkpoint_id(path: Path) -> str:
    """A model identity for cache namespaces: the config plus the weight files' names and sizes."""
    h = xxhash.xxh64((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()


def normalize_prompt(prompt, tokenizer: Tokenizer) -> tuple[list[int], list[int] | None]:
    """str | list[int] | list[list[int]] (segments) -> (token ids, segment starts or None)."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty; send at least one character")
        return tokenizer.encode(prompt), None
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(s, (list, tuple)) for s in prompt):
        tokens, starts = [], []
        for segment in prompt:
            starts.append(len(tokens))
            tokens.extend(segment)
        return list(tokens), starts
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), None
    raise RequestError("prompt must be a str, a list of token ids, or a list of segments (lists of token ids)")


class LLM:
    """An MLA model with Irminsul's cache. `reuse` is one of off | prefix | naive | pic."""

    def __init__(self, model: str | Path | None = None, dtype: str = "float32", reuse: str = "off",
                 device: str = "cpu", **cache_options):
        self.path = Path(model) if model is not None else bundled_model("mla")
        self.model = load_model(self.path, dtype=dtype, device=device)
        self.tokenizer = Tokenizer(self.path)
        cache_options.setdefault("model_id", checkpoint_id(self.path))
        self.engine = Engine(self.model, self.tokenizer, reuse=reuse, **cache_options)

    @property
    def reuse(self) -> str:
        return self.engine.reuse

    def generate(self, prompt, max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop=None, stop_token_ids=(),
                 ignore_eos: bool = False) -> GenerationResult:
        tokens, segments = normalize_prompt(prompt, self.tokenizer)
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=stop, stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos)
        seq = self.engine.run(self.engine.add(tokens, params, segments))
        return GenerationResult(token_ids=seq.output_ids, text=self.engine.output_text(seq), stats=seq.stats,
                                finish_reason=seq.finish_reason, prompt_token_ids=tokens)

    def score(self, prompt_ids, continuation_ids) -> torch.Tensor:
        """Teacher-forced log-probabilities [len(continuation_ids), vocab] under this LLM's reuse mode.
        `prompt_ids` may be token ids or segments (lists of token ids), as for `generate`."""
        tokens, segments = normalize_prompt(list(prompt_ids), self.tokenizer)
        logprobs, seq = self.engine.score(tokens, list(continuation_ids), segments)
        self.last_stats = seq.stats
        return logprobs
