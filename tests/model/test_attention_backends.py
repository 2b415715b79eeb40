"""The attention backends by name: `cpu` (the default: the reference with native kernels where they run)
and `reference` (torch's ops only) generate the same tokens; `torch` is the default's older name."""

import pytest

from irminsul import LLM
from irminsul.errors import RequestError
from irminsul.model import attention


def test_the_reference_and_the_cpu_backend_generate_the_same_tokens(tiny_dir):
    prompts = [[5, 9, 14, 2, 7] * 6, list(range(3, 40))]
    runs = {}
    for name in ("cpu", "reference", "torch"):
        llm = LLM(tiny_dir, attention_backend=name, compile_decode=False)
        assert llm.engine.model.capabilities.backend == attention.ALIASES.get(name, name)
        runs[name] = [o.token_ids for o in llm.generate(prompts, max_tokens=8, ignore_eos=True)]
    assert runs["cpu"] == runs["reference"] == runs["torch"]


def test_an_unknown_backend_names_the_known_ones(tiny_dir):
    with pytest.raises(RequestError, match="cpu, reference, triton"):
        LLM(tiny_dir, attention_backend="flash")
