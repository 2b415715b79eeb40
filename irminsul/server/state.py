"""What the server holds while it runs: the loaded checkpoint, the client of its engine, the tenancy
policy, the worker threads and the metrics, and the checks every endpoint makes against them.

`load_checkpoint` reads the model and its tokenizer; `ServerState` builds the rest around them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from irminsul.server.config import ServerConfig
from irminsul.server.errors import APIError, context_exceeded
from irminsul.server.tenancy import Tenancy

if TYPE_CHECKING:
    from irminsul.model.tokenizer import Tokenizer

log = logging.getLogger("irminsul.server")


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the model, its tokenizer, the name clients send and the id of its weights."""

    model: object
    tokenizer: Tokenizer
    name: str
    checkpoint_id: str


def load_checkpoint(config: ServerConfig) -> Checkpoint:
    """The model of --model (default: the bundled MLA one), on --device in --dtype, with its tokenizer."""
    from irminsul.bundled import bundled_model
    from irminsul.model.identity import checkpoint_id
    from irminsul.model.loader import load_model
    from irminsul.model.tokenizer import Tokenizer

    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    path = Path(config.model) if config.model else bundled_model("mla")
    model = load_model(path, dtype=config.dtype, device=config.device)
    if config.attention_backend not in ("cpu", "torch"):  # (the default every family starts with)
        model.set_attention_backend(config.attention_backend)
    ident = checkpoint_id(path, config.dtype)
    if config.threads is None:
        import torch

        from irminsul.model.threads import fastest_threads

        start = torch.get_num_threads()
        threads = fastest_threads(model, ident)
        if threads != start:
            torch.set_num_threads(threads)
            log.info("threads: %d of %d (one request ran faster on it here; --threads N sets it)", threads, start)
    return Checkpoint(model, Tokenizer(path), config.served_model_name or path.name, ident)


class ServerState:
    """The loaded model's tokenizer and chat renderer, the client of its engine, and the request-level policies."""

    def __init__(self, config: ServerConfig):
        from irminsul.server.chat import ChatRenderer
        from irminsul.server.engine_client import EngineClient
        from irminsul.server.metrics import LoopStalls, ServerMetrics
        from irminsul.server.workers import Workers

        self.config = config
        loaded = load_checkpoint(config)
        self.model_name, self.tokenizer = loaded.name, loaded.tokenizer
        self.renderer = ChatRenderer(self.tokenizer)
        # no token stands for more bytes than this, so a text of more than context x this many
        # characters cannot fit, and is refused before anyone tokenizes it
        self.max_token_bytes = max(
            1, max(len(self.tokenizer.token_bytes(t, False)) for t in range(self.tokenizer.vocab_size))
        )
        if config.store.specs != ("memory",) and not config.store_secret:
            log.warning(
                "the disk / Redis tiers have no --store-secret: whoever can write to them can "
                "substitute cached rows undetected (see docs/serving.md, Security model)"
            )
        self.metrics = ServerMetrics(self.model_name)
        self.client = EngineClient.create(loaded.model, self.tokenizer, loaded.checkpoint_id, config, self.metrics)
        self.context = self.client.context
        self.metrics.watch(self.client)
        self.stalls = LoopStalls()  # started with the app, on its event loop
        self.metrics.watch_loop(self.stalls)
        self.tenancy = Tenancy(config)
        self.workers = Workers(config.prep_threads, config.prep_threads_per_tenant)
        self.started = time.time()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def prepare(self, request, fn, *args):
        """``fn(*args)`` on a worker thread, within the request's share of them (an awaitable)."""
        return self.workers.run(self.tenancy.share_of(request), fn, *args)

    def check_text(self, chars: int, what: str, param: str) -> None:
        """Refuse a text that cannot fit in the context before it is tokenized (a body of megabytes
        tokenizes for seconds into millions of ids): no token is longer than max_token_bytes."""
        most = self.context * self.max_token_bytes
        if chars > most:
            raise context_exceeded(
                self.context,
                f"the {what} has {chars:,} characters, more than {self.context} "
                f"tokens hold (no token is longer than {self.max_token_bytes} "
                f"bytes)",
                param,
                what,
            )

    def close(self) -> None:
        """Stop the engine thread, the store's threads and the worker threads (idempotent: the app's
        shutdown and the CLI both call it)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.stalls.stop()
        self.client.stop()
        self.workers.close()
