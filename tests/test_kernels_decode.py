"""The decoding kernels (course_utils.kernels.decode) against the float64 references.

Contiguous and paged caches (block tables shuffled, unused pages NaN), ragged
lengths with NaN past each sequence's length, T in {1, 3, 16}, MHA/GQA/MQA,
one split to more splits than blocks, fp32 and fp16. Bad input raises a
ValueError of one sentence. And the one-copy rule with lesson 09's notebook.
"""

import inspect

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import numpy as np
import pytest
import torch

from course_utils import references as ref
from course_utils.kernels import decode, decode_attention
from test_kernels_forward import _notebook_jit_functions, _strip

DEVICE = course_utils.ENV.device
TOL = {torch.float32: (1e-5, 1e-5) if DEVICE == "cpu" else (1e-2, 1e-2),  # tf32 dots on a GPU
       torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def make_cache(b, hq, hkv, t, n_max, d, lengths, dtype, *, page_size=None, seed=0):
    """q, the caches (NaN past each length), cache_seqlens, block_table, and float64 copies.

    With ``page_size`` the caches are paged: pages dealt out in a shuffled
    order, two spare pages and every unused slot NaN.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, n_max, d, generator=g)
    v = torch.randn(b, hkv, n_max, d, generator=g)
    k, v = k.to(dtype), v.to(dtype)
    q = q.to(dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    for i, n in enumerate(lengths):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("nan")
    table = None
    if page_size is not None:
        max_pages = -(-n_max // page_size)
        n_pages = b * max_pages + 2
        order = torch.randperm(n_pages, generator=g)[: b * max_pages].reshape(b, max_pages)
        kp = torch.full((n_pages, hkv, page_size, d), float("nan"), dtype=dtype)
        vp = kp.clone()
        for i in range(b):
            for p in range(max_pages):
                lo, hi = p * page_size, min((p + 1) * page_size, n_max)
                kp[order[i, p], :, : hi - lo] = k[i, :, lo:hi]
                vp[order[i, p], :, : hi - lo] = v[i, :, lo:hi]
        table = order.to(torch.int32).to(DEVICE)
        k_dev, v_dev = kp, vp
    else:
        k_dev, v_dev = k, v
    want_o, want_lse = ref.decode_attention(*(x.double().numpy() for x in (q, k, v)), seqlens.numpy())
    return (q.to(DEVICE), k_dev.to(DEVICE), v_dev.to(DEVICE), seqlens.to(DEVICE), table), (want_o, want_lse)


CASES = [
    # b, hq, hkv, t, n_max, d, lengths, dtype, page_size, num_splits
    (1, 2, 2, 1, 64, 32, [64], torch.float32, None, 1),  # MHA, one split: the direct path
    (3, 4, 2, 1, 100, 32, [100, 37, 1], torch.float32, None, 3),  # GQA, ragged, a length-1 sequence
    (2, 4, 1, 3, 90, 16, [90, 41], torch.float32, None, 2),  # MQA, T = 3
    (2, 2, 1, 16, 80, 32, [80, 16], torch.float32, None, 5),  # T = 16, a cache of only the new tokens
    (2, 4, 2, 3, 70, 64, [70, 9], torch.float32, None, 16),  # more splits than keys: empty splits
    (2, 4, 2, 1, 96, 48, [96, 50], torch.float16, None, 2),  # fp16, D not a power of two
    (2, 4, 2, 3, 100, 32, [100, 45], torch.float32, 16, 3),  # paged, shuffled table
    (2, 8, 1, 2, 64, 32, [64, 23], torch.float16, 8, 1),  # paged fp16 MQA, pages smaller than a block
    (1, 2, 2, 1, 96, 32, [77], torch.float32, 64, None),  # paged, pages larger than a block, auto splits
]


@pytest.mark.parametrize("b,hq,hkv,t,n_max,d,lengths,dtype,page_size,num_splits", CASES)
def test_decode_matches_reference(b, hq, hkv, t, n_max, d, lengths, dtype, page_size, num_splits):
    (q, k, v, seqlens, table), (want_o, _) = make_cache(b, hq, hkv, t, n_max, d, lengths, dtype,
                                                        page_size=page_size)
    o = decode_attention(q, k, v, seqlens, num_splits=num_splits, block_table=table)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(o.double().cpu().numpy(), want_o, atol=atol, rtol=rtol)


def test_partials_are_the_reference_partials_and_merge_to_the_result():
    (q, k, v, seqlens, _), (want_o, want_lse) = make_cache(2, 4, 2, 3, 40, 32, [40, 30], torch.float32, seed=1)
    o_parts, lse_parts = decode.decode_split(q, k, v, seqlens, 15)
    q64, k64, v64 = (x.double().cpu().numpy() for x in (q, k, v))
    ref_o, ref_lse = ref.decode_partials(q64, np.nan_to_num(k64), np.nan_to_num(v64), seqlens.cpu().numpy(), 15)
    lse = lse_parts.double().cpu().numpy()
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # the same rows see no key
    assert np.isneginf(lse).any()  # chunk 2: split [28, 30) is after query 0 (position 27)
    atol, rtol = TOL[torch.float32]
    np.testing.assert_allclose(np.where(np.isneginf(lse), 0, lse), np.where(np.isneginf(ref_lse), 0, ref_lse),
                               atol=atol, rtol=0)
    np.testing.assert_allclose(o_parts.double().cpu().numpy(), ref_o, atol=atol, rtol=rtol)
    merged_o, merged_lse = ref.merge_partials(ref_o, ref_lse)
    np.testing.assert_allclose(merged_o, want_o, atol=1e-12)
    np.testing.assert_allclose(merged_lse, want_lse, atol=1e-12)
    out = torch.empty_like(q)
    decode.decode_combine(o_parts, lse_parts, out)
    np.testing.assert_allclose(out.double().cpu().numpy(), want_o, atol=atol, rtol=rtol)


def test_strided_query_and_output_dtype():
    (q, k, v, seqlens, _), (want_o, _) = make_cache(2, 4, 2, 2, 40, 32, [40, 20], torch.float32, seed=2)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, D] memory
    assert not q_strided.is_contiguous()
    o = decode_attention(q_strided, k, v, seqlens, num_splits=2)
    np.testing.assert_allclose(o.double().cpu().numpy(), want_o, atol=TOL[torch.float32][0], rtol=TOL[torch.float32][1])


def test_num_splits_heuristic():
    cpu = torch.device("cpu")
    assert 1 <= decode.pick_num_splits(1, 8, 1, 256, cpu, 32) <= 4
    assert decode.pick_num_splits(1, 8, 1, 16, cpu, 32) == 1

    few = decode.pick_num_splits(1, 8, 1, 16384, cpu, 64, sm_count=132)
    many = decode.pick_num_splits(64, 8, 1, 16384, cpu, 64, sm_count=132)
    short = decode.pick_num_splits(1, 8, 1, 256, cpu, 64, sm_count=132)
    # 512 programs make 1.94 waves of 264 slots: the second ends raggedly (issue 24: one split ran at 86-88% of
    # the read ceiling there), so the model splits; the counts are derived in test_split_model_by_hand.
    assert many == 3
    assert 8 <= few <= decode.MAX_SPLITS  # 8 programs alone would leave most SMs idle
    assert short == 1  # 4 blocks: too short to split


# -- the split model, by hand (an H200: 132 SMs x 2 resident programs = 264 slots) --------------
def _by_hand(waves_rounded, drain, blocks_per_split, splits, useful):
    """busy = useful / time, time = (ceil(waves) + drain if past one wave) x (blocks + 1) + 2 if split."""
    return useful / ((waves_rounded + drain) * (blocks_per_split + 1) + (2 if splits > 1 else 0))


def test_split_model_by_hand():
    busy = decode.split_busy_fraction
    # B = 64, Hkv = 8, a 16k context (256 blocks of 64 keys): useful = 512 * 256 / 264 block reads per slot.
    useful = 512 * 256 / 264
    want = {1: _by_hand(2, 0.25, 256, 1, useful),  # 512 programs: 1.94 waves -> 2, ragged end
            2: _by_hand(4, 0.25, 128, 2, useful),  # 1024: 3.88 -> 4
            3: _by_hand(6, 0.25, 86, 3, useful),  # 1536: 5.82 -> 6; ceil(256 / 3) = 86 blocks
            4: _by_hand(8, 0.25, 64, 4, useful)}  # 2048: 7.76 -> 8
    for s, w in want.items():
        assert busy(64, 8, 1, 256, s, 264) == pytest.approx(w, rel=1e-12)
    assert want[1] == pytest.approx(0.8586, abs=1e-4) and want[4] == pytest.approx(0.9224, abs=1e-4)
    # The best of the 64 counts allowed (256 / 4 blocks) is 4's (8 ties it): 3 is within 2% of it, 1 and 2 are not.
    best = max(busy(64, 8, 1, 256, s, 264) for s in range(1, 65))
    assert best == pytest.approx(want[4])
    assert want[3] >= 0.98 * best > want[2] > want[1]
    assert decode.pick_num_splits(64, 8, 1, 16384, torch.device("cpu"), 64, sm_count=132) == 3
    # Without the ragged end the waves alone keep one split: 2 x 257 vs 8 x 65 + 2 block reads.
    assert busy(64, 8, 1, 256, 1, 264, drain=0.0) == pytest.approx(useful / 514)
    assert busy(64, 8, 1, 256, 1, 264, drain=0.0) > busy(64, 8, 1, 256, 4, 264, drain=0.0)

    # B = 16, a 4k context (64 blocks): 2 splits make 256 programs, one wave of 264 slots, 32 + 1 blocks + combine.
    useful = 128 * 64 / 264
    assert busy(16, 8, 1, 64, 2, 264) == pytest.approx(useful / 35)
    assert busy(16, 8, 1, 64, 1, 264) == pytest.approx(useful / 65)  # 128 programs: half the slots idle
    assert busy(16, 8, 1, 64, 4, 264) == pytest.approx(useful / (2.25 * 17 + 2))  # 1.94 waves again
    assert decode.pick_num_splits(16, 8, 1, 4096, torch.device("cpu"), 64, sm_count=132) == 2

    # B = 1, a 16k context: 32 splits = 256 programs (one wave), 8 blocks each; 31 splits need 9 blocks.
    useful = 8 * 256 / 264
    assert busy(1, 8, 1, 256, 32, 264) == pytest.approx(useful / 11)
    assert busy(1, 8, 1, 256, 31, 264) == pytest.approx(useful / 12)
    assert useful / 12 < 0.98 * useful / 11
    assert decode.pick_num_splits(1, 8, 1, 16384, torch.device("cpu"), 64, sm_count=132) == 32

    # GQA packing: the query heads of a kv head share a program, so only n_kv_heads and m_blocks count.
    assert busy(2, 8, 2, 64, 3, 264) == busy(4, 8, 1, 64, 3, 264) == busy(4, 4, 2, 64, 3, 264)
    # Splits stay at least 4 blocks long: 7 blocks allow one split only, 8 allow two.
    assert decode.pick_num_splits(1, 1, 1, 7 * 64, torch.device("cpu"), 64, sm_count=132) == 1
    assert decode.pick_num_splits(1, 1, 1, 8 * 64, torch.device("cpu"), 64, sm_count=132) == 2


def test_drain_is_what_the_recorded_b64_run_says():
    """DRAIN_WAVES solves the model for results/decode_splits.json's B = 64, one-split rows (every context swept)."""
    from course_utils import results

    rows = results.rows("decode_splits", B=64, splits=1)
    assert len(rows) >= 2
    for row in rows:
        n = row["context"] // 64
        useful = 512 * n / 264
        measured = row["of_ceiling"] / 100
        drain = useful / (measured * (n + 1)) - 2  # busy = useful / ((2 + drain) * (n + 1))
        assert abs(drain - decode.DRAIN_WAVES) < 0.06, (row, drain)


BAD = [
    (dict(q=(2, 4, 17, 32)), "1 to 16"),
    (dict(k=(2, 3, 64, 32)), "multiple"),
    (dict(seqlens=[65, 10]), "can hold"),
    (dict(seqlens=[64, 1], t=3), "fewer than the 3 new tokens"),
    (dict(seqlens_dtype=torch.int64), "int32"),
    (dict(k=(3, 2, 64, 32)), "batch size"),
    (dict(num_splits=0), "num_splits"),
    (dict(v=(2, 2, 64, 16)), "same shape"),
]


@pytest.mark.parametrize("change,words", BAD)
def test_bad_input_gets_one_sentence(change, words):
    t = change.get("t", 1)
    q = torch.zeros(change.get("q", (2, 4, t, 32)), device=DEVICE)
    k = torch.zeros(change.get("k", (2, 2, 64, 32)), device=DEVICE)
    v = torch.zeros(change.get("v", k.shape), device=DEVICE)
    seqlens = torch.tensor(change.get("seqlens", [64, 10]), dtype=change.get("seqlens_dtype", torch.int32),
                           device=DEVICE)
    with pytest.raises(ValueError, match=words) as info:
        decode_attention(q, k, v, seqlens, num_splits=change.get("num_splits"))
    message = str(info.value)
    assert message.count(". ") == 0 and message.endswith("."), message


def test_paged_table_must_be_int32():
    q = torch.zeros(1, 2, 1, 32, device=DEVICE)
    pages = torch.zeros(4, 2, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="block_table"):
        decode_attention(q, pages, pages, torch.tensor([20], dtype=torch.int32, device=DEVICE),
                         block_table=torch.tensor([[0, 1]], device=DEVICE))


def test_notebook_kernels_are_the_module_kernels():
    taught = _notebook_jit_functions("09_decoding.ipynb")
    kernels = ["_decode_split_kernel", "_decode_combine_kernel"]
    assert set(kernels) <= set(taught), f"09_decoding does not define {set(kernels) - set(taught)}"
    for name in kernels:
        module_src = inspect.getsource(getattr(decode, name).fn)
        assert _strip(taught[name]) == _strip(module_src), f"09_decoding: {name} differs from decode.py"
        assert "### BEGIN SOLUTION" in taught[name]


# -- compiled on a GPU: realistic shapes in bf16, the automatic split count --------------
@pytest.mark.gpu("bf16 and long caches need the compiled kernels (a GPU)")
@pytest.mark.parametrize("t,page_size", [(1, None), (4, None), (1, 16), (3, 64)])
def test_gpu_bf16_long_ragged_caches(t, page_size):
    b, hq, hkv, d, n_max = 3, 32, 8, 128, 5000
    lengths = [5000, 1234, t + 1]
    dtype = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    (q, k, v, seqlens, table), (want_o, _) = make_cache(b, hq, hkv, t, n_max, d, lengths, dtype,
                                                        page_size=page_size)
    o = decode_attention(q, k, v, seqlens, block_table=table)
    np.testing.assert_allclose(o.double().cpu().numpy(), want_o, atol=3e-2, rtol=3e-2)


def test_pick_num_splits_docstring_counts():
    """The counts pick_num_splits's docstring states for an H200 (132 SMs, 8 kv heads, one row block)."""
    cpu = torch.device("cpu")
    pick = {(b, n): decode.pick_num_splits(b, 8, 1, n, cpu, 64, sm_count=132)
            for b, n in ((1, 16384), (4, 16384), (16, 16384), (64, 1024), (64, 4096), (64, 16384), (64, 65536))}
    assert pick == {(1, 16384): 32, (4, 16384): 8, (16, 16384): 2, (64, 1024): 1, (64, 4096): 2, (64, 16384): 3,
                    (64, 65536): 17}
    assert "32 splits at ``B = 1``" in decode.pick_num_splits.__doc__
    assert "1 split at 1k, 2 at 4k, 3 at 16k and 17 at 64k" in " ".join(decode.pick_num_splits.__doc__.split())


# -- the split model's PROGRAMS_PER_SM is what the split kernel compiles to for an H200 ---------------
OCCUPANCY_SCRIPT = r"""
import json
import torch
from course_utils.kernels import decode, targets
from course_utils.bench import decode as bench

targets._TYPES.setdefault(torch.int32, "i32")  # cache_seqlens
cfg = dict(decode._gpu_config(128, 2, (9, 0)))  # what decode_config gives bf16, D = 128 on sm_90
decode.decode_config = lambda *args: dict(cfg)
q = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 8, 256, 128, dtype=torch.bfloat16)
lens = torch.full((1,), 256, dtype=torch.int32)
with targets._as_if_on_a_gpu(90), targets._captured_launches() as launches:
    decode.decode_split(q, k, k, lens, 2)
kernel, args, kwargs = launches[0]
c = targets.compile_launch(kernel, args, kwargs, 90, "bf16 D=128", registers=True)
print(json.dumps(dict(vars(c), per_sm=bench.programs_per_sm(c.registers, c.num_warps, c.shared_bytes))))
"""


def test_programs_per_sm_is_what_the_split_kernel_compiles_to():
    """Compiled for sm_90 here (ptxas, no GPU): registers and shared memory give decode.PROGRAMS_PER_SM."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", OCCUPANCY_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["num_warps"] == 4 and got["spill_bytes"] == 0, got
    assert got["per_sm"] == decode.PROGRAMS_PER_SM, (
        f"the split kernel compiles to {got['registers']} registers and {got['shared_bytes']} bytes of shared "
        f"memory: {got['per_sm']} programs per SM, but the split model assumes {decode.PROGRAMS_PER_SM}")


def test_a_full_grid_at_one_split_launches_with_two_stages_on_hopper():
    """decode_config(programs=): 2 stages only where results/tune_decode.json measured them faster (one split,
    at least FULL_GRID_PROGRAMS_PER_SM programs per SM, Hopper); 3 elsewhere, as before."""
    cpu = torch.device("cpu")
    h200 = dict(capability=(9, 0), sm_count=132)
    base = decode.decode_config(128, torch.bfloat16, cpu, **h200)
    assert (base["BLOCK_N"], base["num_warps"], base["num_stages"]) == (64, 4, 3)
    assert decode.decode_config(128, torch.bfloat16, cpu, 512, **h200)["num_stages"] == 2  # B = 64, 8 kv heads
    assert decode.decode_config(128, torch.bfloat16, cpu, 264, **h200)["num_stages"] == 2
    assert decode.decode_config(128, torch.bfloat16, cpu, 263, **h200)["num_stages"] == 3
    assert decode.decode_config(128, torch.bfloat16, cpu, 128, **h200)["num_stages"] == 3  # B = 16
    assert decode.decode_config(128, torch.bfloat16, cpu, 512, capability=(8, 0), sm_count=108) == \
        decode.decode_config(128, torch.bfloat16, cpu, capability=(8, 0))
    assert decode.decode_config(256, torch.bfloat16, cpu, 4096, **h200)["num_stages"] == 3  # 32-key tiles: not measured
    assert decode.decode_config(128, torch.bfloat16, cpu, 512) == dict(BLOCK_N=32)  # the interpreter


def test_the_split_kernel_gets_the_launch_s_programs_at_one_split_only(monkeypatch):
    seen = []
    real = decode.decode_config
    monkeypatch.setattr(decode, "decode_config", lambda *a, **k: seen.append(a[3:]) or real(*a, **k))
    q = torch.randn(3, 8, 1, 32).to(DEVICE)
    k = torch.randn(3, 2, 64, 32).to(DEVICE)
    lens = torch.full((3,), 64, dtype=torch.int32, device=DEVICE)
    decode.decode_split(q, k, k, lens, 1, out=torch.empty_like(q))
    decode.decode_split(q, k, k, lens, 2)
    assert seen == [(6,), (None,)]  # 3 sequences x 2 kv heads x 1 block of packed rows
