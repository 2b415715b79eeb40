"""Test support that is not part of the installed package: services on loopback (`services`),
the vLLM moved-document helpers (`moved`). Benchmarks import them too, with the repository root
on sys.path (they are run from a clone)."""
