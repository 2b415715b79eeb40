"""The public, offline entry point: `LLM(model).generate(...)`, `.score(...)` and `.stats()`.

`generate` takes one prompt or a list of prompts (vLLM's convention) and batches a list through
the engine's scheduler. A prompt is a string, a list of token ids, or `Segments`: token-id lists
where chunking restarts at each one (S2). So `[[1, 2], [3, 4]]` is two token-id prompts, and one
prompt in two segments is `Segments([[1, 2], [3, 4]])`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from irminsul.bundled import bundled_model
from irminsul.engine.build import build_engine
from irminsul.engine.config import EngineConfig
from irminsul.engine.sampling import SamplingParams
from irminsul.engine.sequence import RequestStats, TokenLogprob
from irminsul.errors import RequestError
from irminsul.model.identity import checkpoint_id
from irminsul.model.loader import load_model
from irminsul.model.tokenizer import Tokenizer

# generate()'s keyword controls: SamplingParams' fields that are not its named arguments
CONTROLS = frozenset(f.name for f in fields(SamplingParams)) - {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
}


class Segments(tuple):
    """One prompt given in parts (lists of token ids); chunking restarts at every part (S2)."""

    def __new__(cls, parts):
        return super().__new__(cls, tuple(list(p) for p in parts))


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: RequestStats
    finish_reason: str
    prompt_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # with generate(logprobs=N): one per generated token


def _token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def normalize_prompt(prompt, tokenizer: Tokenizer) -> tuple[list[int], list[int] | None]:
    """str | list[int] (or a 1-D integer array / tensor) | Segments -> (token ids, segment starts or None)."""
    if (
        isinstance(prompt, (np.ndarray, torch.Tensor))
        and prompt.ndim == 1
        and (
            prompt.dtype.kind in "iu"
            if isinstance(prompt, np.ndarray)
            else not prompt.is_floating_point() and prompt.dtype != torch.bool
        )
    ):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty; send at least one character")
        return tokenizer.encode(prompt), None
    if isinstance(prompt, Segments):
        if not all(_token_ids(s) for s in prompt):
            raise RequestError("every part of Segments must be a list of token ids")
        tokens: list[int] = []
        starts: list[int] = []
        for segment in prompt:
            starts.append(len(tokens))
            tokens.extend(segment)
        return list(tokens), starts
    if _token_ids(prompt):
        return list(prompt), None
    raise RequestError("prompt must be a str, a list of token ids, or Segments (lists of token ids)")


class LLM:
    """An MLA model with Irminsul's cache. `reuse` is one of off | prefix | naive | pic;
    `kv_cache_gib` sizes the latent pool that running requests and cached content share;
    `compile_decode` compiles the decode steps (model/compiled.py on a CPU; CUDA graphs of the
    triton backend on a GPU, model/graphs.py): None (default) where available, on a CPU in the
    background while the eager path runs (`wait_compiled` waits for it); True before this returns;
    False never. `cache_options`: the rest of `EngineConfig.of`'s options (max_prefill_tokens,
    tenant, recompute_ratio, ...)."""

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "float32",
        reuse: str = "off",
        device: str = "cpu",
        kv_cache_gib: float | None = None,
        max_running_requests: int = 256,
        attention_backend: str = "cpu",
        compile_decode: bool | None = None,
        **cache_options,
    ):
        # Offline batches are for throughput: prompts are prefilled at the full per-step budget
        # (the server keeps decode_slowdown=2: its streams' inter-token latency comes first).
        config = EngineConfig.of(
            **{
                "decode_slowdown": None,
                **cache_options,
                "reuse": reuse,
                "kv_cache_gib": kv_cache_gib,
                "compile_decode": compile_decode,
                "max_running_requests": max_running_requests,
            }
        )
        self.path = Path(model) if model is not None else bundled_model("mla")
        self.model = load_model(self.path, dtype=dtype, device=device)
        if attention_backend not in ("cpu", "torch"):  # (the default every family starts with)
            self.model.set_attention_backend(attention_backend)
        self.tokenizer = Tokenizer(self.path)
        if "model_id" not in cache_options:
            config = config.replace(model_id=checkpoint_id(self.path, dtype))
        self.engine = build_engine(config, self.model, self.tokenizer)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the decode steps compiling in the background are ready (a benchmark's steady
        state); whether compiled steps run now."""
        return self.engine.runner.wait_compiled(timeout)

    @property
    def reuse(self) -> str:
        return self.engine.reuse

    def generate(
        self,
        prompts,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop=None,
        stop_token_ids=(),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        **controls,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt -> one result; a list of prompts -> a list of results, in order, generated
        together (continuous batching). Greedy by default; the sampling options apply to every prompt;
        `controls` are SamplingParams' logit controls (presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias as ((id, bias), ...) or {id: bias}, min_p, min_tokens,
        include_stop_str_in_output, skip_special_tokens, constraint)."""
        if unknown := sorted(set(controls) - CONTROLS):
            raise RequestError(
                f"generate() has no option {', '.join(unknown)}; its logit controls are {', '.join(sorted(CONTROLS))}"
            )
        batch = isinstance(prompts, (list, tuple)) and not isinstance(prompts, Segments) and not _token_ids(prompts)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=() if stop is None else stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            **controls,
        )
        items = list(prompts) if batch else [prompts]  # NOTE: [] is an empty prompt, refused as such
        seqs = []
        for p in items:
            tokens, segments = normalize_prompt(p, self.tokenizer)
            seqs.append(self.engine.new_sequence(tokens, params, segments))
        for seq in seqs:
            self.engine.add_request(seq)
        try:
            while any(not s.finished for s in seqs):
                self.engine.step()
        except BaseException:
            for seq in seqs:
                self.engine.abort(seq)
            raise
        results = []
        for seq in seqs:
            if seq.error:
                raise RequestError(seq.error)
            assert seq.finish_reason is not None, "the engine stepped until every sequence finished"
            results.append(
                GenerationResult(
                    token_ids=seq.output_ids,
                    text=seq.text,
                    stats=seq.stats,
                    finish_reason=seq.finish_reason,
                    prompt_token_ids=seq.tokens[: seq.prompt_len],
                    logprobs=seq.logprobs if logprobs is not None else None,
                )
            )
        return results if batch else results[0]

    def score(self, prompt_ids, continuation_ids) -> torch.Tensor:
        """Teacher-forced log-probabilities [len(continuation_ids), vocab] under this LLM's reuse mode.
        `prompt_ids` may be token ids or Segments (a list of token-id lists is read as segments too)."""
        if (
            isinstance(prompt_ids, (list, tuple))
            and prompt_ids
            and all(isinstance(s, (list, tuple)) for s in prompt_ids)
        ):
            prompt_ids = Segments(prompt_ids)
        tokens, segments = normalize_prompt(
            prompt_ids if isinstance(prompt_ids, Segments) else list(prompt_ids), self.tokenizer
        )
        logprobs, seq = self.engine.score(tokens, list(continuation_ids), segments)
        self.last_stats = seq.stats
        return logprobs

    def stats(self) -> dict:
        """kv_pool_bytes_used / _capacity, cached_bytes, running_sequences, waiting_sequences."""
        return self.engine.stats()
