"""Convert an Irminsul checkpoint (DeepSeek-V2, or DeepSeek-V3 from `irminsul checkpoint random`) to
GGUF with llama.cpp's own converter, for `bench_llamacpp.py` and `bench_real_shapes.py`. Optional,
and run with a separate Python that has llama.cpp's conversion requirements (transformers 4.57.x,
numpy, sentencepiece, its gguf-py):

    python benchmarks/llamacpp_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf [--outtype f32|bf16]

The default --outtype is f32 (the bundled model, bench_llamacpp.py); bench_real_shapes.py's bf16
checkpoint is converted with --outtype bf16, as it is stored. Both families go through llama.cpp's
DeepseekV2Model (it handles DeepseekV3ForCausalLM: sigmoid routing, the score-correction bias,
routing groups). What the converter needs help with, and nothing else is changed:
- a byte-level BPE pre-tokenizer (GPT-2's regex: the bundled tokenizer's and the random
  checkpoints' byte tokenizer) has a hash the converter does not know, so an unknown hash is
  written as "gpt-2";
- the random checkpoints' byte tokenizer has no merges (every token is one byte or a special
  token); llama.cpp refuses a "gpt2" vocabulary without a merges array and gguf-py writes no empty
  array, so one merge ("Ġ Ġ") is written where the tokenizer has none. Its result is no token of
  the vocabulary, so llama.cpp's tokenizer falls back to the two byte tokens: the same ids;
- a null q_lora_rank ("no query compression") must be written as 0: llama.cpp only infers it for
  26-, 27- and 48-layer models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp", type=Path, help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("model", type=Path, help="the checkpoint directory")
    ap.add_argument("out", type=Path, help="the GGUF file to write")
    ap.add_argument(
        "--outtype",
        default="f32",
        choices=["f32", "bf16", "f16"],
        help="tensor type in the GGUF (f32: the bundled model; bf16: a bf16 checkpoint as stored)",
    )
    args = ap.parse_args(argv)
    llama = args.llama_cpp
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
            return "gpt-2"  # a byte-level tokenizer with GPT-2's pre-tokenizer regex

    TextModel.get_vocab_base_pre = vocab_base_pre
    params = DeepseekV2Model.set_gguf_parameters

    def set_gguf_parameters(self):
        params(self)
        if self.hparams.get("q_lora_rank") is None:
            self.gguf_writer.add_q_lora_rank(0)

    DeepseekV2Model.set_gguf_parameters = set_gguf_parameters
    vocab = DeepseekV2Model.set_vocab

    def set_vocab(self):
        vocab(self)
        merges = "tokenizer.ggml.merges"
        if not any(merges in kv for kv in self.gguf_writer.kv_data):
            self.gguf_writer.add_token_merges(["\u0120 \u0120"])  # "Ġ Ġ": see the docstring

    DeepseekV2Model.set_vocab = set_vocab
    sys.argv = ["convert_hf_to_gguf.py", str(args.model), "--outfile", str(args.out), "--outtype", args.outtype]
    return convert.main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
