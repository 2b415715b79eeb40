from irminsul.model.chat_format import SPECIAL_TOKENS
from irminsul.research.train.tokenizer import load_tokenizer, save_tokenizer


def test_specials_are_single_tokens(tok):
    for t in SPECIAL_TOKENS:
        assert tok.encode(t).ids == [tok.token_to_id(t)]


def test_a_number_tokenises_differently_after_a_space(tok):
    # why tasks encode " <value>" once and reuse the ids
    assert tok.decode(tok.encode(" 48213").ids) == " 48213"
    assert tok.encode(" 48213").ids != tok.encode("48213").ids


def test_saved_tokenizer_loads_in_transformers_with_chat_template(tok, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tok, tmp_path, 512)
    assert load_tokenizer(tmp_path).encode("echo delta").ids == tok.encode("echo delta").ids
    hf = AutoTokenizer.from_pretrained(tmp_path)
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>hi<|end|><|assistant|>"
    assert hf.eos_token == "<|end|>" and hf.bos_token == "<|bos|>"
