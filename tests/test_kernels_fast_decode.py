"""Decoding in equal shares (course_utils.kernels.fast_decode) in Triton's interpreter, against float64.

The schedule (``lean_shares``) is checked as numbers: every K/V block of every
segment read once, each piece in its own slot, the merge reading exactly the
pieces that were written. The kernels are checked against the references on
the same caches as lesson 09's (NaN past each length, paged and shuffled),
with SM counts that cut segments into pieces, pieces past a sequence's end and
shares longer than a segment. ``tests/test_gpu_fast_decode.py`` runs them on a GPU.
"""

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch

from course_utils import kernels
from course_utils.kernels import decode, fast_decode
from course_utils.kernels.fast_decode import LEAN_MIN_BLOCKS, lean_rule, lean_shares
from test_kernels_decode import DEVICE, TOL, make_cache


@pytest.mark.parametrize("segments,n_blocks,n_sms,per_sm,min_blocks", [
    (8, 16, 132, 3, 2),  # B = 1 at 1k: shares of 2 blocks, 64 programs
    (128, 2048, 132, 3, 2),  # B = 16 at 128k: 396 programs of 662 blocks
    (512, 16, 132, 3, 2),  # B = 64 at 1k: a share of 21 blocks spans two segments
    (3, 7, 5, 1, 1), (4, 3, 2, 2, 1), (1, 1, 4, 4, 1), (5, 100, 3, 1, 4), (6, 4, 1, 1, 1),
    (1, 1024, 132, 3, 2),  # MQA, B = 1, 64k keys: one segment, at most 128 pieces (lesson 09's most splits)
])
def test_every_block_is_read_once_and_every_piece_has_its_own_slot(segments, n_blocks, n_sms, per_sm, min_blocks):
    plan = lean_shares(segments, n_blocks, n_sms, per_sm, min_blocks)
    assert plan.share >= min_blocks
    assert plan.programs <= n_sms * per_sm or plan.share == min_blocks  # more programs only at the smallest share
    assert plan.max_parts <= decode.MAX_SPLITS
    seen = np.zeros((segments, n_blocks), dtype=int)
    slots = {}
    for p in range(plan.programs):
        pieces = plan.pieces(p)
        assert pieces, f"program {p} reads nothing"
        assert sum(end - first for _, first, end, _ in pieces) <= plan.share
        for seg, first, end, slot in pieces:
            seen[seg, first:end] += 1
            assert 0 <= slot < plan.max_parts
            assert (seg, slot) not in slots, "two pieces of one segment in one slot"
            slots[(seg, slot)] = (first, end)
    assert (seen == 1).all(), "a block read twice or never"
    for seg in range(segments):
        written = sorted(slot for s, slot in slots if s == seg)
        assert written == list(range(plan.parts_of(seg))), "the merge must read exactly the slots written"
        assert slots[(seg, 0)][0] == 0  # slot 0 holds the segment's first block: every row sees a key there


def test_shares_are_equal_and_fill_the_sms():
    plan = lean_shares(128, 2048, 132, 3)  # B = 16, 128k keys of 64, 8 kv heads on an H200
    assert plan.programs == 396 and plan.share == -(-128 * 2048 // 396) == 662
    lengths = [sum(end - first for _, first, end, _ in plan.pieces(p)) for p in range(plan.programs)]
    assert set(lengths[:-1]) == {662} and lengths[-1] == 128 * 2048 - 395 * 662  # all equal but the last
    # a 2048-block segment spans at most cdiv(2048, 662) + 1 = 5 shares, and some do
    assert plan.max_parts == 5 == max(plan.parts_of(seg) for seg in range(128))


def test_a_call_of_few_segments_gets_longer_shares_not_more_pieces_than_the_merge_holds():
    free = lean_shares(1, 1024, 132, 3, max_parts=10**6)  # uncapped: 342 pieces of one segment, one merge tile
    assert free.max_parts == free.programs == 342
    plan = lean_shares(1, 1024, 132, 3)
    assert plan.max_parts <= decode.MAX_SPLITS and plan.share == -(-1024 // (decode.MAX_SPLITS - 1))
    small = lean_shares(2, 40, 8, 2, 1, max_parts=4)
    assert small.share == 14 and max(small.parts_of(s) for s in range(2)) <= 4


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="positive"):
        lean_shares(0, 4, 132)
    with pytest.raises(ValueError, match="positive"):
        lean_shares(4, 4, 132, programs_per_sm=0)


CASES = [
    # b, hq, hkv, t, n_max, d, lengths, dtype, page_size, n_sms, per_sm, min_blocks
    (2, 4, 2, 1, 96, 32, [96, 50], torch.float32, None, 3, 1, 1),  # GQA, ragged, pieces across segments
    (3, 8, 2, 2, 128, 16, [128, 7, 64], torch.float32, None, 4, 1, 1),  # T = 2, a piece past a short length
    (1, 4, 4, 1, 200, 64, [170], torch.float32, None, 7, 1, 1),  # MHA, 4 segments cut into up to 5 pieces
    (2, 4, 1, 3, 64, 32, [64, 33], torch.float32, 16, 2, 1, 1),  # MQA, T = 3, paged and shuffled
    (2, 6, 2, 1, 160, 24, [160, 100], torch.float16, None, 3, 1, 1),  # fp16, D not a power of two
    (2, 2, 1, 16, 80, 32, [80, 16], torch.float32, None, 1, 1, 8),  # T = 16; one program reads everything
    (1, 4, 1, 1, 640, 32, [600], torch.float32, None, 40, 1, 1),  # one segment cut into 20 pieces
]


@pytest.mark.parametrize("b,hq,hkv,t,n_max,d,lengths,dtype,page_size,n_sms,per_sm,min_blocks", CASES)
def test_lean_decode_matches_reference(b, hq, hkv, t, n_max, d, lengths, dtype, page_size, n_sms, per_sm, min_blocks):
    (q, k, v, seqlens, table), (want_o, _) = make_cache(b, hq, hkv, t, n_max, d, lengths, dtype, page_size=page_size)
    o = fast_decode.launch(q, k, v, seqlens, table, n_sms=n_sms, programs_per_sm=per_sm, min_blocks=min_blocks)
    assert o.shape == q.shape and o.dtype == q.dtype
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(o.double().cpu().numpy(), want_o, atol=atol, rtol=rtol)


def test_the_package_entry_keeps_lesson_09s_kernels_off_a_gpu():
    (q, k, v, seqlens, _), _ = make_cache(2, 4, 2, 1, 96, 32, [96, 50], torch.float32)
    assert fast_decode.lean_reason(q, k) is not None
    assert kernels.decode_attention is fast_decode.decode_attention
    assert torch.equal(kernels.decode_attention(q, k, v, seqlens), decode.decode_attention(q, k, v, seqlens))
    with pytest.raises(ValueError, match="num_splits"):
        kernels.decode_attention(q, k, v, seqlens, num_splits=0)


def test_the_lean_schedule_starts_at_long_contiguous_caches():
    assert lean_rule(LEAN_MIN_BLOCKS * 64, 64) is None
    assert "starts at" in lean_rule(LEAN_MIN_BLOCKS * 64 - 64, 64)
    assert "paged" in lean_rule(LEAN_MIN_BLOCKS * 64, 64, paged=True)
    assert "Hopper only" in lean_rule(LEAN_MIN_BLOCKS * 64, 64, capability=(8, 0))  # an A100: not measured
    assert lean_rule(LEAN_MIN_BLOCKS * 64, 64, capability=(10, 0)) is None
    assert "twice its splits" in lean_rule(LEAN_MIN_BLOCKS * 64, 64, pdl_doubles=True)  # B = 1: the PDL launch
    assert "starts at" in lean_rule(LEAN_MIN_BLOCKS * 64 - 64, 64, pdl_doubles=True)
    assert DEVICE in ("cpu", "cuda")


@pytest.mark.parametrize("page_size", [None, 16])
def test_lesson_09s_kernels_through_the_pdl_wrappers_give_their_bits(page_size):
    """The wrappers call lesson 09's kernels as functions: same launch, same result (PDL itself needs a GPU)."""
    (q, k, v, seqlens, table), (want_o, _) = make_cache(2, 4, 2, 2, 96, 32, [96, 40], torch.float32,
                                                        page_size=page_size)
    for splits in (1, 3):
        o = fast_decode.launch_pdl_splits(q, k, v, seqlens, splits, table, pdl=False)
        assert torch.equal(o, decode.launch_decode(q, k, v, seqlens, splits, table))
        atol, rtol = TOL[torch.float32]  # tf32 on a GPU
        np.testing.assert_allclose(o.double().cpu().numpy(), want_o, atol=atol, rtol=rtol)
    assert fast_decode.launch_choice(q, k, table) == f"num_splits={decode.launch_splits(q, k, table)}"  # no GPU


@pytest.mark.parametrize("batch,context,lesson_09,pdl", [
    (1, 1024, 4, 8),  # one wave of 64 programs of 2 blocks
    (1, 4096, 16, 16),  # doubled: 256 programs of 2 blocks (lost)
    (1, 16384, 16, 32),  # doubled splits of 8 blocks
    (4, 1024, 4, 4),  # doubled: 256 programs of 2 blocks (lost)
    (4, 4096, 4, 8),
    (4, 16384, 4, 8),
    (4, 65536, 8, 8),  # 256 programs: more than one per SM already
    (16, 1024, 1, 1),  # one split: no combine to add
    (16, 16384, 2, 2),
    (1, 65536, 16, 32),  # from 64k the lean schedule, but at B = 1 the PDL launch doubles (lean_rule)
    (1, 131072, 16, 32),
    (16, 65536, 2, 2),  # the lean schedule's
    (64, 65536, 1, 1),
])
def test_the_pdl_split_rule_on_an_h200(batch, context, lesson_09, pdl):
    """pdl_num_splits at the decode grid's points on 132 SMs; from a 64k context only B = 1 doubles, which is where
    lean_reason gives the lean schedule's points to the PDL launch."""
    n_blocks = context // 64
    splits = decode.pick_num_splits(batch, 8, 1, context, torch.device("cpu"), 64, sm_count=132)
    assert splits == lesson_09
    assert fast_decode.pdl_num_splits(batch, 8, 1, n_blocks, splits, 132) == pdl
