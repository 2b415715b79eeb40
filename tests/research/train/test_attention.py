"""The probe that supervises attention recomputes exactly what transformers computes."""

import pytest
import torch

from irminsul.research.train.arch import build_model, hf_config
from irminsul.research.train.attention import HeadProbe


def _model(tok, shape, arch):
    torch.manual_seed(0)
    cfg = hf_config(arch, tok, shape)
    cfg._attn_implementation = "eager"  # so output_attentions returns the weights
    model = build_model(cfg).eval()
    for name, p in model.named_parameters():
        if "proj" in name:  # sharp attention, so a wrong head or position would show
            p.data.normal_(0, 0.3)
    return model


def _src(L):
    src = torch.full((2, L), -1)
    src[0, L - 10], src[1, L - 1], src[1, 5] = 7, 20, 3
    return src


@pytest.mark.parametrize("arch", ["mla", "gqa"])
def test_probe_scores_and_output_match_transformers(tok, tiny_shape, arch):
    model = _model(tok, tiny_shape, arch)
    heads = tuple(range(tiny_shape.heads))
    probe = HeadProbe(model, 1, heads)
    seen = {}

    def keep(module, args, output):  # returns None: the module's output is left alone
        seen["out"] = output[0]

    model.model.layers[1].self_attn.register_forward_hook(keep)
    x = torch.randint(10, tok.get_vocab_size(), (2, 40))
    src = _src(40)
    probe.target(src)
    with torch.no_grad():
        ref = model(input_ids=x, output_attentions=True).attentions[1]  # [B, H, L, L]
    b, t = (src >= 0).nonzero(as_tuple=True)
    torch.testing.assert_close(torch.softmax(probe.scores, -1), ref[b, :, t], atol=1e-5, rtol=0)
    torch.testing.assert_close(probe.out, seen["out"][b, t], atol=1e-4, rtol=0)  # all heads = the module
    want = ref[b, :, t].gather(2, src[b, t][:, None, None].expand(-1, len(heads), 1)).mean()
    assert probe.mass() == pytest.approx(float(want), abs=1e-5)
    assert float(probe.attention_loss()) == pytest.approx(
        float(-ref[b, :, t].gather(2, src[b, t][:, None, None].expand(-1, len(heads), 1)).log().mean()), rel=1e-4
    )
    probe.target(torch.full_like(src, -1))  # a text-only batch: nothing to supervise, no mass (not nan)
    with torch.no_grad():
        model(input_ids=x)
    assert probe.mass() is None and float(probe.attention_loss()) == 0.0


def test_probe_records_nothing_without_targets(tok, tiny_shape):
    model = _model(tok, tiny_shape, "mla")
    probe = HeadProbe(model, 0, (0,))
    probe.target(torch.full((1, 16), -1))
    with torch.no_grad():
        model(input_ids=torch.randint(10, 300, (1, 16)))
    assert probe.scores is None and float(probe.attention_loss()) == 0.0


def test_attention_loss_trains_the_head_toward_the_source(tok, tiny_shape):
    model = _model(tok, tiny_shape, "gqa")
    for p in model.parameters():
        p.data.mul_(0.1)
    probe = HeadProbe(model, 1, (0,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(10, tok.get_vocab_size(), (2, 40))
    src = _src(40)
    masses = []
    for _ in range(60):
        probe.target(src)
        model(input_ids=x)
        masses.append(probe.mass())
        probe.attention_loss().backward()
        opt.step()
        opt.zero_grad()
    assert masses[-1] > 0.9 > masses[0]


def test_probe_heads_must_exist(tok, tiny_shape):
    model = _model(tok, tiny_shape, "mla")
    with pytest.raises(ValueError, match="must be among the model's 2 heads"):
        HeadProbe(model, 0, (0, 1, 2))
