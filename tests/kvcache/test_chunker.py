import struct

import numpy as np
import pytest
import xxhash

from irminsul.kvcache.chunker import (
    GEAR_SEED,
    Chunk,
    ChunkerConfig,
    boundaries,
    candidates,
    chunk,
    clamp,
    fingerprint,
    gear,
    marker_ends,
    namespace_seed,
    segment_starts_of,
)
from tests.kvcache.oracles import reference_candidates, reference_clamp

CFG = ChunkerConfig()


def _tokens(n, seed=0, high=129_280):
    return np.random.default_rng(seed).integers(0, high, n)


def _splitmix64_py(x):
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_gear_is_splitmix64_of_seeded_id_for_any_32bit_id():
    ids = [0, 1, 2, 127, 129_279, 2**31, 2**32 - 1]
    assert gear(ids).tolist() == [_splitmix64_py(GEAR_SEED ^ i) for i in ids]
    assert gear(np.array(ids[:5], np.int32)).tolist() == gear(ids[:5]).tolist()


@pytest.mark.parametrize("mask_bits", [4, 7, 9, 13])
@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_candidates_equal_literal_recurrence(mask_bits, seed):
    cfg = ChunkerConfig(mask_bits=mask_bits)
    tokens = _tokens(6000, seed, high=2**32)
    assert np.array_equal(candidates(tokens, cfg), reference_candidates(tokens, cfg))


def test_candidates_with_segments_reset_the_state():
    tokens = _tokens(5000, 3)
    starts = [1, 2, 3, 10, 700, 703, 2500, 4999]
    assert np.array_equal(candidates(tokens, CFG, starts), reference_candidates(tokens, CFG, starts))
    # a reset means the segment chunks exactly like the same tokens standing alone
    seg = candidates(tokens, CFG, [700])
    alone = candidates(tokens[700:], CFG) + 700
    assert np.array_equal(seg[seg > 700], alone[alone > 700])


@pytest.mark.parametrize(
    "cfg", [CFG, ChunkerConfig(min_len=1, max_len=3, mask_bits=2), ChunkerConfig(min_len=50, max_len=60, mask_bits=5)]
)
def test_clamp_equals_token_walk(cfg):
    tokens = _tokens(4000, 4)
    for seg in (None, [5, 6, 300, 1000, 3990]):
        starts = segment_starts_of(tokens, cfg, seg)
        cands = candidates(tokens, cfg, starts)
        assert np.array_equal(clamp(cands, len(tokens), starts, cfg), reference_clamp(cands, len(tokens), starts, cfg))


def test_chunk_lengths_and_coverage():
    tokens = _tokens(50_000, 5)
    chunks = chunk(tokens, CFG, seed=1)
    assert chunks[0].start == 0 and chunks[-1].end == len(tokens)
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    assert all(32 <= len(c) <= 512 for c in chunks[:-1])
    assert 100 < np.mean([len(c) for c in chunks]) < 220  # min_len + ~2^mask_bits
    assert chunks[3] == Chunk(chunks[3].start, chunks[3].end, fingerprint(tokens[chunks[3].start : chunks[3].end], 1))


def test_segments_force_cuts_and_are_never_crossed():
    tokens = _tokens(3000, 6)
    starts = [10, 40, 41, 900, 2990]
    ends = boundaries(tokens, CFG, starts)
    assert set(starts) <= set(ends.tolist())
    # a segment shorter than min_len is one chunk
    assert [10, 40, 41] == [e for e in ends.tolist() if e <= 41]
    assert chunk([], CFG, 0) == [] and len(boundaries([], CFG)) == 0


def test_marker_starts_a_segment_after_every_occurrence():
    marker = (7, 8, 9)
    tokens = _tokens(2000, 7, high=1000) + 10  # no marker token occurs by chance
    for pos in (100, 500, 503, 1997):  # 503 overlaps-adjacent, 1997 ends at the last token
        tokens[pos : pos + 3] = marker
    cfg = ChunkerConfig(marker=marker)
    assert marker_ends(tokens, marker).tolist() == [103, 503, 506, 2000]
    assert np.array_equal(boundaries(tokens, cfg), boundaries(tokens, CFG, [103, 503, 506]))
    assert np.array_equal(marker_ends(np.array([7, 7, 7, 7]), (7, 7)), [2, 3, 4])


def test_shifted_content_resynchronises_to_the_same_chunks():
    body = _tokens(3000, 8)
    seen = []
    for header_len in (1, 37, 250):
        header = _tokens(header_len, 100 + header_len)
        chunks = chunk(np.concatenate([header, body]), CFG, seed=9)
        seen.append({(c.start - header_len, c.fingerprint) for c in chunks if c.start >= header_len})
    common = set.intersection(*seen)
    first = min(s for s, _ in common)
    assert first <= 512
    for s in seen:  # after the first shared cut every chunk is the same
        assert {x for x in s if x[0] >= first} == {x for x in common if x[0] >= first}


def test_fingerprint_encoding_seed_and_injection():
    assert fingerprint([1, 2, 2**32 - 1], 5) == xxhash.xxh64_intdigest(struct.pack("<3I", 1, 2, 2**32 - 1), 5)
    assert fingerprint([1, 2], 5) != fingerprint([1, 2], 6)
    tokens = _tokens(1000, 9)
    fake = chunk(tokens, CFG, 3, fingerprint_fn=lambda ids, seed: int(ids.sum()) % 2)
    assert [c.fingerprint for c in fake] == [int(tokens[c.start : c.end].sum()) % 2 for c in fake]


def test_namespace_seed_is_deterministic_and_unambiguous():
    assert namespace_seed("m", "t") == namespace_seed("m", "t")
    assert namespace_seed("ab", "c") != namespace_seed("a", "bc")
    assert namespace_seed("m") != namespace_seed("m", "x")
    assert 0 <= namespace_seed("deepseek-v2-lite") < 2**64


def test_bad_inputs_fail_with_a_message():
    with pytest.raises(ValueError, match="min_len"):
        ChunkerConfig(min_len=0)
    with pytest.raises(ValueError, match="mask_bits"):
        ChunkerConfig(mask_bits=40)
    with pytest.raises(ValueError, match="marker"):
        ChunkerConfig(marker=())
    with pytest.raises(ValueError, match="2\\^32"):
        chunk([1, -1], CFG, 0)
    with pytest.raises(ValueError, match="1-D"):
        chunk(np.zeros((2, 2), np.int64), CFG, 0)
    with pytest.raises(ValueError, match="segment starts"):
        boundaries([1, 2, 3], CFG, [5])
