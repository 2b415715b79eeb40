"""The serving layer: an OpenAI-compatible HTTP server with continuous batching over one engine."""
