"""Decoding in equal shares (course_utils.kernels.fast_decode) compiled on a GPU.

Skipped without one, CI included: there ``test_kernels_fast_decode.py`` runs the same kernels in Triton's
interpreter. Outputs are compared with the float64 reference; the merge launched with programmatic dependent
launch (Hopper) must give the same bits as the plain launch.
"""

import numpy as np
import pytest
import torch

from course_utils import references as ref
from course_utils.kernels import decode, fast_decode, targets

GPU = torch.cuda.is_available()
HOPPER = GPU and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not GPU, reason="needs a GPU; see test_kernels_fast_decode.py")


def _cache(b, hq, hkv, t, n, d, lengths, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, m, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for h, m in ((hq, t), (hkv, n), (hkv, n)))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    want = ref.decode_attention(*(x.double().cpu().numpy() for x in (q, k, v)), seqlens.cpu().numpy())[0]
    return q, k, v, seqlens, want


@pytest.mark.parametrize("b,hq,hkv,t,n,lengths,per_sm", [
    (1, 32, 8, 1, 4096, [4096], 3),  # the benchmark's heads
    (4, 32, 8, 1, 2048, [2048, 1000, 64, 1], 3),  # ragged, a one-token sequence
    (2, 16, 2, 4, 3000, [3000, 2500], 1),  # T = 4, a capacity that is not a multiple of the block
    (3, 8, 8, 1, 1024, [1024, 512, 700], 4),  # MHA
])
def test_lean_decode_on_a_gpu_matches_reference(b, hq, hkv, t, n, lengths, per_sm):
    q, k, v, seqlens, want = _cache(b, hq, hkv, t, n, 128, lengths)
    n_sms = decode._sm_count(q.device)
    o = fast_decode.launch(q, k, v, seqlens, n_sms=n_sms, programs_per_sm=per_sm)
    np.testing.assert_allclose(o.double().cpu().numpy(), want, atol=3e-2, rtol=3e-2)
    plain = fast_decode.launch(q, k, v, seqlens, n_sms=n_sms, programs_per_sm=per_sm, pdl=False)
    assert torch.equal(o, plain)


@pytest.mark.skipif(not HOPPER, reason="the lean schedule's routing is measured on Hopper")
def test_long_caches_run_the_lean_kernels_and_short_ones_lesson_09s_with_the_pdl_combine():
    """From LEAN_MIN_BLOCKS blocks the lean schedule, but at B = 1 (lesson 09's launch at most one program per SM)
    the PDL launch at twice its splits; shorter caches lesson 09's kernels with the PDL combine."""
    long = fast_decode.LEAN_MIN_BLOCKS * 64
    for b, n, kernels, choice in (
            (4, long, ["_lean_split_kernel", "_lean_combine_kernel"], "lean"),
            (1, long, ["_split_released", "_combine_waiting"], "pdl num_splits=32"),
            (1, 16384, ["_split_released", "_combine_waiting"], "pdl num_splits=32")):
        q, k, v, seqlens, want = _cache(b, 32, 8, 1, n, 128, [n] * b, seed=n + b)
        with targets._captured_launches(launch=True) as launches:
            o = fast_decode.decode_attention(q, k, v, seqlens)
        assert [fn.__name__ for fn, *_ in launches] == kernels
        assert fast_decode.launch_choice(q, k) == choice
        np.testing.assert_allclose(o.double().cpu().numpy(), want, atol=3e-2, rtol=3e-2)
        del q, k, v


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs Hopper")
@pytest.mark.parametrize("b,n,lengths", [(1, 1024, [1024]), (4, 4096, [4096, 3000, 17, 1]), (2, 2000, [2000, 1999])])
def test_the_pdl_combine_gives_lesson_09s_bits(b, n, lengths):
    q, k, v, seqlens, want = _cache(b, 32, 8, 1, n, 128, lengths, seed=b)
    splits = fast_decode.pdl_splits_of(q, k)
    o = fast_decode.decode_attention(q, k, v, seqlens)
    assert torch.equal(o, decode.launch_decode(q, k, v, seqlens, splits))  # the same kernels, the same bits
    np.testing.assert_allclose(o.double().cpu().numpy(), want, atol=3e-2, rtol=3e-2)
    assert fast_decode.launch_choice(q, k) == f"pdl num_splits={splits}"


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs Hopper")
def test_a_paged_cache_keeps_lesson_09s_plain_launch():
    q, k, v, seqlens, want = _cache(2, 32, 8, 1, 1024, 128, [1024, 700], seed=3)
    pages = k.shape[2] // 16
    table = torch.arange(2 * pages, dtype=torch.int32, device="cuda").reshape(2, pages)
    kp, vp = (x.reshape(2, 8, pages, 16, 128).permute(0, 2, 1, 3, 4).reshape(2 * pages, 8, 16, 128).contiguous()
              for x in (k, v))
    with targets._captured_launches(launch=True) as launches:
        o = fast_decode.decode_attention(q, kp, vp, seqlens, block_table=table)
    assert launches[0][0].__name__ == "_decode_split_kernel"
    assert fast_decode.launch_choice(q, kp, table).startswith("num_splits=")
    np.testing.assert_allclose(o.double().cpu().numpy(), want, atol=3e-2, rtol=3e-2)
