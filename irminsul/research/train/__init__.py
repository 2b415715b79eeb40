"""Training of the bundled reference models: tokenizer, data mix, trainer, retrieval evals."""
