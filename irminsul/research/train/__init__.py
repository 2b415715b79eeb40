"""Training of the bundled reference models (issue 4): tokenizer, data mix, trainer, retrieval evals."""
