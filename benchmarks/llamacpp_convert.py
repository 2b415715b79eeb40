"""Convert an Irminsul (DeepSeek-V2) checkpoint to GGUF with llama.cpp's own converter, for
`bench_llamacpp.py`. Optional, and run with a separate Python that has llama.cpp's conversion
requirements (transformers 4.57.x, numpy, sentencepiece, its gguf-py):

    python benchmarks/llamacpp_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

Two things in the converter need help for the bundled model, and nothing else is changed:
- its byte-level BPE pre-tokenizer (GPT-2's regex) has a hash the converter does not know, so an
  unknown hash is written as "gpt-2";
- a null q_lora_rank ("no query compression") must be written as 0: llama.cpp only infers it for
  26-, 27- and 48-layer models.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    llama, model, out = (Path(a) for a in argv)
    sys.path.insert(0, str(llama))
    sys.path.insert(0, str(llama / "gguf-py"))
    import convert_hf_to_gguf as convert
    from conversion.base import TextModel
    from conversion.deepseek import DeepseekV2Model

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"  # the bundled tokenizer's pre-tokenizer is GPT-2's byte-level regex

    TextModel.get_vocab_base_pre = vocab_base_pre
    params = DeepseekV2Model.set_gguf_parameters

    def set_gguf_parameters(self):
        params(self)
        if self.hparams.get("q_lora_rank") is None:
            self.gguf_writer.add_q_lora_rank(0)

    DeepseekV2Model.set_gguf_parameters = set_gguf_parameters
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out), "--outtype", "f32"]
    return convert.main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
