"""Prefill of any subset of positions: decode, chunked and out-of-order prefill equal one full pass."""

import numpy as np
import torch

from irminsul.model.loader import load_model


def _full_logits(model, ids):
    seq = model.new_rows()
    return model.logits(model.prefill(seq, ids, torch.arange(len(ids))))


def test_incremental_decode_matches_full_forward(tiny_dir):
    model = load_model(tiny_dir)
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(0))
    full = _full_logits(model, ids)
    seq = model.new_rows(capacity=8)  # also exercises buffer growth
    model.prefill(seq, ids[:50], torch.arange(50))
    for p in range(50, 80):
        step = model.logits(model.prefill(seq, ids[p : p + 1], torch.tensor([p])))
        assert (step[0] - full[p]).abs().max().item() < 1e-4


def test_out_of_order_prefill_is_exact(tiny_dir):
    model = load_model(tiny_dir)
    n = 150
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(1))
    full = _full_logits(model, ids)
    # Rows are written into the buffer chunk by chunk in a shuffled order (as the cache does when
    # it copies reused chunks), then a subset of positions is recomputed in one pass. Attention
    # only reads filled rows at positions <= p, so the order of filling must not matter.
    seq = model.new_rows()
    model.prefill(seq, ids, torch.arange(n))
    rows_ref = seq.raw.clone()
    chunks = [np.arange(a, min(a + 25, n)) for a in range(0, n, 25)]
    rng = np.random.default_rng(0)
    seq2 = model.new_rows()
    for i in rng.permutation(len(chunks)):
        seq2.write(int(chunks[i][0]), rows_ref[:, chunks[i]])
    # Now recompute a random subset of positions (the cache's "compute" spans) in one pass.
    subset = np.sort(rng.choice(n, size=40, replace=False))
    subset[-1] = n - 1
    hidden = model.prefill(seq2, ids[subset], torch.as_tensor(subset))
    logits = model.logits(hidden)
    assert (logits - full[subset]).abs().max().item() < 1e-4
    assert (seq2.raw[:, :n] - rows_ref[:, :n]).abs().max().item() < 1e-5


def test_sparse_prefill_with_holes_filled_in_one_pass(tiny_dir):
    """Copy the rows of some spans, compute the rest (interleaved holes) in one forward pass."""
    model = load_model(tiny_dir)
    n = 120
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(2))
    seq = model.new_rows()
    full = model.logits(model.prefill(seq, ids, torch.arange(n)))
    kept = np.r_[0:20, 40:70, 90:100]
    holes = np.setdiff1d(np.arange(n), kept)
    seq2 = model.new_rows()
    for a, b in ((0, 20), (40, 70), (90, 100)):
        seq2.write(a, seq.raw[:, a:b])
    logits = model.logits(model.prefill(seq2, ids[holes], torch.as_tensor(holes)))
    assert (logits - full[holes]).abs().max().item() < 1e-4


def test_batched_forward_equals_separate(tiny_dir):
    """Two prefills and three decodes of different lengths in one pass, through one shared pool:
    each sequence's logits equal its own full forward."""
    from irminsul.model.attention import SeqAttention
    from irminsul.model.mla import ForwardBatch

    model = load_model(tiny_dir)
    cfg = model.config
    lengths, decode_from = (30, 45, 12, 70, 33), (None, None, 11, 69, 32)
    ids = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(3 + i)) for i, n in enumerate(lengths)]
    refs = [_full_logits(model, x) for x in ids]
    pool = torch.zeros(cfg.num_hidden_layers, 1 + sum(lengths), cfg.row_width)
    tables = np.split(np.arange(1, 1 + sum(lengths)), np.cumsum(lengths)[:-1])
    for x, table, start in zip(ids, tables, decode_from):  # the decoding sequences' earlier rows
        if start is not None:
            sr = model.new_rows()
            model.prefill(sr, x[:start], torch.arange(start))
            pool[:, table[:start]] = sr.raw[:, :start]
    qs = [np.arange(n) if s is None else np.array([s]) for n, s in zip(lengths, decode_from)]
    offsets = np.concatenate([[0], np.cumsum([len(q) for q in qs])]).tolist()
    batch = ForwardBatch(
        torch.cat([x[q] for x, q in zip(ids, qs)]),
        torch.as_tensor(np.concatenate(qs)),
        pool,
        torch.as_tensor(np.concatenate([t[q] for t, q in zip(tables, qs)])),
        model.attention.plan([SeqAttention(q, t[: q[-1] + 1]) for q, t in zip(qs, tables)], offsets, "cpu"),
    )
    decode = [g for g in batch.groups if g.shape[1] == 1]
    assert sum(len(g.token_index) for g in decode) == 3 and sum(len(g.token_index) for g in batch.groups) == 78
    logits = model.logits(model(batch))
    for i, (ref, q) in enumerate(zip(refs, qs)):
        assert (logits[offsets[i] : offsets[i + 1]] - ref[q]).abs().max().item() < 1e-4, i


def test_bf16_runs_and_stays_close(tiny_dir):
    fp32, bf16 = load_model(tiny_dir), load_model(tiny_dir, dtype="bfloat16")
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5))
    a = _full_logits(fp32, ids).softmax(-1)
    b = _full_logits(bf16, ids).softmax(-1)
    assert bf16.new_rows().raw.dtype == torch.bfloat16
    assert (a - b).abs().max().item() < 0.05


def test_a_lone_decoding_sequence_reads_its_rows_in_place(tiny_dir):
    """A sequence whose rows sit in consecutive slots decodes without gathering them
    (AttentionGroup.run); the result is the gathered path's, which is the full forward's."""
    import dataclasses

    model = load_model(tiny_dir)
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(7))
    full = _full_logits(model, ids)
    seq = model.new_rows()
    model.prefill(seq, ids[:59], torch.arange(59))
    batch = seq.batch(model.attention, ids[59:], torch.tensor([59]))
    (group,) = batch.groups
    assert group.run == 1 and group.dense  # SequenceRows: position p in slot p + 1
    in_place = model.logits(model(batch))[0]
    batch.groups[0] = dataclasses.replace(group, run=None)
    gathered = model.logits(model(batch))[0]
    assert (in_place - gathered).abs().max().item() < 1e-5
    assert (in_place - full[59]).abs().max().item() < 1e-4
    # a hole among the keys, or keys out of slot order, is not a run
    seq.filled[10] = False
    assert seq.batch(model.attention, ids[59:], torch.tensor([59])).groups[0].run is None


def test_packed_weights_are_views_that_change_nothing(tiny_dir):
    """`pack` lays weights out for inference (fused, in the layout measured) as views: the state dict and the
    logits are the unpacked model's."""
    packed, plain = load_model(tiny_dir), load_model(tiny_dir, pack=False)
    a, b = packed.state_dict(), plain.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    attn, mlp = packed.model.layers[0].self_attn, packed.model.layers[0].mlp
    assert attn.in_proj[0].data_ptr() == attn._q_in().weight.data_ptr()
    assert mlp.packed and not plain.model.layers[0].mlp.packed
    head = packed.lm_head.weight  # stored in the layout measured fastest for it here (model/kernel_choice.py)
    assert head.is_contiguous() == (packed.kernel_choices.choice(*head.shape, head.dtype).layout == "out")
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(8))
    assert (_full_logits(packed, ids) - _full_logits(plain, ids)).abs().max().item() < 1e-5
