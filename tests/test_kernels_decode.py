"""The decoding kernels (course_utils.kernels.decode) against the float64 references.

Contiguous and paged caches (block tables shuffled, unused pages NaN), ragged
lengths with NaN past each sequence's length, T in {1, 3, 16}, MHA/GQA/MQA,
one split to more splits than blocks, fp32 and fp16. Bad input raises a
ValueError of one sentence. And the one-copy rule with lesson 09's notebook.
"""

import inspect
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import nbformat
import numpy as np
import pytest
import torch

from course_utils import references as ref
from course_utils import results
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
    # 512 programs: the 2-stage launch of one split holds them all at once (5 per SM), so nothing ends raggedly
    # and one split is best; the counts are derived in test_split_model_by_hand.
    assert many == 1
    assert 8 <= few <= decode.MAX_SPLITS  # 8 programs alone would leave most SMs idle
    assert short == 1  # 4 blocks: too short to split


# -- the split model, by hand (an H200: 132 SMs; 3 programs per SM, 5 for one split over a full grid) ---------
def _by_hand(per_sm, drain, blocks_per_split, splits, useful):
    """busy = useful / time, time = (programs on the busiest SM + drain if past what the SMs hold) x (blocks + 1)
    + 2 if split."""
    return useful / ((per_sm + drain) * (blocks_per_split + 1) + (2 if splits > 1 else 0))


def test_split_model_by_hand():
    busy = decode.split_busy_fraction
    # B = 64, Hkv = 8, a 16k context (256 blocks of 64 keys): useful = 512 * 256 / 132 block reads per SM.
    useful = 512 * 256 / 132
    want = {1: _by_hand(4, 0.0, 256, 1, useful),  # 512 programs, 3.88 per SM -> 4; 660 fit at once: not ragged
            2: _by_hand(8, 0.45, 128, 2, useful),  # 1024: 7.76 -> 8, past the 396 that 3 per SM hold
            3: _by_hand(12, 0.45, 86, 3, useful),  # 1536: 11.6 -> 12; ceil(256 / 3) = 86 blocks
            4: _by_hand(16, 0.45, 64, 4, useful)}  # 2048: 15.5 -> 16
    assert busy(64, 8, 1, 256, 1, 132, 5) == pytest.approx(want[1], rel=1e-12)
    for s in (2, 3, 4):
        assert busy(64, 8, 1, 256, s, 132, 3) == pytest.approx(want[s], rel=1e-12)
    assert want[1] == pytest.approx(0.9659, abs=1e-4) and want[4] == pytest.approx(0.9269, abs=1e-4)
    assert want[1] > want[4] > want[2]
    assert decode.pick_num_splits(64, 8, 1, 16384, torch.device("cpu"), 64, sm_count=132) == 1
    # The 3-stage launch holds 396 of the 512: its one split ends raggedly, and 4 splits would beat it.
    ragged = busy(64, 8, 1, 256, 1, 132, 3)
    assert ragged == pytest.approx(_by_hand(4, 0.45, 256, 1, useful)) and ragged < 0.98 * want[4]
    assert [decode.programs_per_sm_of_launch(512, s, 132) for s in (1, 2)] == [5, 3]
    assert decode.programs_per_sm_of_launch(263, 1, 132) == 3

    # B = 16, a 4k context (64 blocks): one split is 128 programs, one per SM; 2 splits put 2 on most SMs.
    useful = 128 * 64 / 132
    assert busy(16, 8, 1, 64, 1, 132, 3) == pytest.approx(useful / 65)
    assert busy(16, 8, 1, 64, 2, 132, 3) == pytest.approx(useful / (2 * 33 + 2))
    assert busy(16, 8, 1, 64, 4, 132, 3) == pytest.approx(useful / (4.45 * 17 + 2))  # 512 > 396: ragged
    assert useful / 68 < 0.98 * useful / 65
    assert decode.pick_num_splits(16, 8, 1, 4096, torch.device("cpu"), 64, sm_count=132) == 1

    # B = 1, a 16k context: 16 splits = 128 programs (one per SM), 16 blocks each; 32 splits put 2 on an SM.
    useful = 8 * 256 / 132
    assert busy(1, 8, 1, 256, 16, 132, 3) == pytest.approx(useful / 19)
    assert busy(1, 8, 1, 256, 32, 132, 3) == pytest.approx(useful / 20)
    assert busy(1, 8, 1, 256, 17, 132, 3) == pytest.approx(useful / 36)  # 136 programs: 4 SMs run two
    assert useful / 20 < 0.98 * useful / 19
    assert decode.pick_num_splits(1, 8, 1, 16384, torch.device("cpu"), 64, sm_count=132) == 16

    # GQA packing: the query heads of a kv head share a program, so only n_kv_heads and m_blocks count.
    assert busy(2, 8, 2, 64, 3, 132, 3) == busy(4, 8, 1, 64, 3, 132, 3) == busy(4, 4, 2, 64, 3, 132, 3)
    # Splits stay at least 4 blocks long: 7 blocks allow one split only, 8 allow two.
    assert decode.pick_num_splits(1, 1, 1, 7 * 64, torch.device("cpu"), 64, sm_count=132) == 1
    assert decode.pick_num_splits(1, 1, 1, 8 * 64, torch.device("cpu"), 64, sm_count=132) == 2


def test_drain_is_what_the_recorded_b64_run_says():
    """DRAIN_WAVES solves the model for results/decode_splits.json's B = 64, one-split rows (every context swept):
    512 programs of the 3-stage launch (396 at once), 4 on the busiest SM."""
    from course_utils import results

    rows = results.rows("decode_splits", B=64, splits=1, stages=3)
    assert len(rows) >= 2
    fits = []
    for row in rows:
        n = row["context"] // 64
        useful = 512 * n / 132
        measured = row["of_ceiling"] / 100
        fits.append(useful / (measured * (n + 1)) - 4)  # busy = useful / ((4 + drain) * (n + 1))
    assert min(fits) <= decode.DRAIN_WAVES <= max(fits), fits
    assert max(fits) - min(fits) < 0.2, fits
    # What lesson 09 says the model predicts there without the ragged end (and so what the drain makes up).
    alone = [decode.split_busy_fraction(64, 8, 1, r["context"] // 64, 1, 132, 3, drain=0.0) for r in rows]
    shown = f"{100 * min(alone):.0f}–{100 * max(alone):.0f}%"
    text = " ".join(" ".join(c.source.split()) for c in nbformat.read(Path(__file__).parents[1] / "solutions" / "09_decoding.ipynb", 4).cells)
    assert f"where the rest of the model predicts {shown}" in text, shown


def test_the_model_s_residencies_are_what_the_h200_compiled():
    """PROGRAMS_PER_SM and ONE_SPLIT_PROGRAMS_PER_SM: the shipped launches' compiles recorded on the H200
    (results/tune_decode.json: registers and shared memory, lesson 06's occupancy rule)."""
    from course_utils import results
    from course_utils.bench import decode as bench

    rows = results.load("tune_decode")["rows"]
    for stages, want in ((3, decode.PROGRAMS_PER_SM), (2, decode.ONE_SPLIT_PROGRAMS_PER_SM)):
        mine = [r for r in rows if (r.get("block_n"), r.get("num_warps"), r.get("num_stages")) == (64, 4, stages)]
        assert mine, stages
        for r in mine:
            assert r["programs_per_sm"] == want, r
            assert bench.programs_per_sm(r["n_regs"], r["num_warps"], r["shared_bytes"]) == want, r


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
    pick = {(b, n): decode.model_num_splits(b, 8, 1, n // 64, 132)  # the model's counts (the paragraph's)
            for b, n in ((1, 16384), (4, 16384), (16, 16384), (64, 1024), (64, 4096), (64, 16384), (64, 65536))}
    assert all(decode.pick_num_splits(b, 8, 1, n, cpu, 64, sm_count=132) == s for (b, n), s in pick.items()
               if (b, n) != (16, 16384))  # B = 16 at 16k: doubled (the next test)
    assert pick == {(1, 16384): 16, (4, 16384): 4, (16, 16384): 1, (64, 1024): 1, (64, 4096): 1, (64, 16384): 1,
                    (64, 65536): 1}
    assert all(decode.model_num_splits(b, 8, 1, -(-n // 64), 132) == 1
               for b in (16, 64) for n in (1024, 4096, 16384, 65536, 131072))
    doc = " ".join(decode.pick_num_splits.__doc__.split())
    assert "16 splits at ``B = 1`` and a 16k context" in doc and "4 at ``B = 4``" in doc
    assert "one split at ``B = 16`` and ``B = 64`` at every context" in doc


def test_long_contexts_get_twice_the_models_splits_below_one_program_per_sm():
    """pick_num_splits: where the model's count leaves at most one program per SM and each of twice as many
    splits still reads LONE_SPLIT_MIN_BLOCKS blocks, the count doubles (8 at B = 4 from 64k, 2 at B = 16 from
    16k); shorter splits and B = 64 keep the model's count."""
    cpu = torch.device("cpu")
    pick = {(b, n): decode.pick_num_splits(b, 8, 1, n, cpu, 64, sm_count=132)
            for b in (1, 4, 16, 64) for n in (1024, 4096, 16384, 65536, 131072)}
    model = {(b, n): decode.model_num_splits(b, 8, 1, -(-n // 64), 132) for b, n in pick}
    doubled = {key for key in pick if pick[key] != model[key]}
    assert doubled == {(4, 65536), (4, 131072), (16, 16384), (16, 65536), (16, 131072)}
    assert all(pick[key] == 2 * model[key] for key in doubled)
    for (b, n), s in model.items():
        lone = b * 8 * s <= 132
        assert ((b, n) in doubled) == (lone and -(-n // 64) // (2 * s) >= decode.LONE_SPLIT_MIN_BLOCKS)
    doc = " ".join(decode.pick_num_splits.__doc__.split())
    assert "8 splits at ``B = 4`` from a 64k context and 2 at ``B = 16`` from 16k" in doc


def test_the_doubled_split_counts_read_faster_in_the_recorded_sweep():
    """results/tune_decode_long.json: at the long contexts where pick_num_splits doubles the model's count, the
    doubled count's launch (3 stages: more than one program per SM) read more than the model's count's
    (4 stages alone on an SM) in the same run, except B = 16 at 16k (within 1%); and the docstring's ratios."""
    runs = results.load("tune_decode_long")["runs"]
    cpu = torch.device("cpu")

    def gbps(rows, splits, stages):
        return next(r["gbps"] for r in rows if r.get("num_splits") == splits and r.get("num_stages") == stages
                    and r.get("block_n") == 64 and r["gbps"])

    seen = {}
    for run in runs:
        for b, n in sorted({(r["batch"], r["context"]) for r in run["rows"]}):
            rows = [r for r in run["rows"] if (r["batch"], r["context"]) == (b, n)]
            model = decode.model_num_splits(b, 8, 1, -(-n // 64), 132)
            pick = decode.pick_num_splits(b, 8, 1, n, cpu, 64, sm_count=132)
            if pick == model or not any(r.get("num_stages") == 4 for r in rows):
                continue
            sdpa = max(r["gbps"] for r in rows if r["name"].startswith("sdpa"))
            seen[(b, n)] = (gbps(rows, model, 4) / sdpa, gbps(rows, pick, 3) / sdpa)
    assert set(seen) == {(4, 131072), (16, 16384), (16, 65536)}
    for key, (before, after) in seen.items():
        assert after > before or (key == (16, 16384) and after > 0.99 * before)
    doc = " ".join(decode.pick_num_splits.__doc__.split())
    b4, b16, b16s = seen[(4, 131072)], seen[(16, 65536)], seen[(16, 16384)]
    assert f"{b4[0]:.2f} -> {b4[1]:.2f}x cuDNN at ``B = 4`` and 128k" in doc
    assert f"{b16[0]:.2f} -> {b16[1]:.2f}x at ``B = 16`` and 64k" in doc
    assert f"{b16s[0]:.3f} -> {b16s[1]:.3f}x" in doc and "``results/tune_decode_long.json``, run 2" in doc
    nb = nbformat.read(Path(__file__).resolve().parent.parent / "solutions" / "09_decoding.ipynb", as_version=4)
    lesson = " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    assert f"at `B = 4` and 128k {b4[0]:.2f}× cuDNN with the model's count against {b4[1]:.2f}×" in lesson


# -- the split kernel compiled for sm_90 here (triton as installed, no GPU) --------------------------------
OCCUPANCY_SCRIPT = r"""
import json
import torch
from course_utils.kernels import decode, targets
from course_utils.bench import decode as bench

targets._TYPES.setdefault(torch.int32, "i32")  # cache_seqlens
cfg = dict(decode._gpu_config(128, 2, (9, 0)))  # what decode_config gives bf16, D = 128 on sm_90
decode.decode_config = lambda *args, **kwargs: dict(cfg)
q = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
k = torch.zeros(1, 8, 256, 128, dtype=torch.bfloat16)
lens = torch.full((1,), 256, dtype=torch.int32)
with targets._as_if_on_a_gpu(90), targets._captured_launches() as launches:
    decode.decode_split(q, k, k, lens, 2)
kernel, args, kwargs = launches[0]
c = targets.compile_launch(kernel, args, kwargs, 90, "bf16 D=128", registers=True)
print(json.dumps(dict(vars(c), per_sm=bench.programs_per_sm(c.registers, c.num_warps, c.shared_bytes))))
"""


def test_the_split_kernel_compiles_for_sm_90_without_spills():
    """Compiled for sm_90 here (ptxas, no GPU): 4 warps, nothing spilled. What it compiles to here need not be
    what the H200's triton compiled (this machine's triton 3.8 gave 255 registers and 36 KiB, 2 per SM; the H200's
    triton 3.6 96 registers and 70 KiB, 3 per SM): the model's residencies follow the H200's record
    (test_the_model_s_residencies_are_what_the_h200_compiled)."""
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
    assert 1 <= got["per_sm"] <= decode.ONE_SPLIT_PROGRAMS_PER_SM, got


def test_a_full_grid_at_one_split_launches_with_two_stages_on_hopper():
    """decode_config(programs=): 2 stages only where results/tune_decode.json measured them faster (one split,
    at least FULL_GRID_PROGRAMS_PER_SM programs per SM, Hopper), 4 where one split is at most one program per SM
    (B = 16 there); 3 elsewhere, as before."""
    cpu = torch.device("cpu")
    h200 = dict(capability=(9, 0), sm_count=132)
    base = decode.decode_config(128, torch.bfloat16, cpu, **h200)
    assert (base["BLOCK_N"], base["num_warps"], base["num_stages"]) == (64, 4, 3)
    assert decode.decode_config(128, torch.bfloat16, cpu, 512, **h200)["num_stages"] == 2  # B = 64, 8 kv heads
    assert decode.decode_config(128, torch.bfloat16, cpu, 264, **h200)["num_stages"] == 2
    assert decode.decode_config(128, torch.bfloat16, cpu, 263, **h200)["num_stages"] == 3
    lone = dict(h200, split_blocks=16)  # at most one program per SM, 16 blocks each: 4 stages
    assert decode.decode_config(128, torch.bfloat16, cpu, 128, **lone)["num_stages"] == 4  # B = 16, one split
    assert decode.decode_config(128, torch.bfloat16, cpu, 132, num_splits=4, **lone)["num_stages"] == 4
    assert decode.decode_config(128, torch.bfloat16, cpu, 133, **lone)["num_stages"] == 3
    assert decode.decode_config(128, torch.bfloat16, cpu, 128, **dict(h200, split_blocks=15))["num_stages"] == 3
    assert decode.decode_config(128, torch.bfloat16, cpu, 128, **h200)["num_stages"] == 3  # blocks not known
    assert decode.decode_config(128, torch.bfloat16, cpu, 512, num_splits=2, **h200)["num_stages"] == 3
    assert decode.decode_config(128, torch.bfloat16, cpu, 512, capability=(8, 0), sm_count=108) == \
        decode.decode_config(128, torch.bfloat16, cpu, capability=(8, 0))
    assert decode.decode_config(256, torch.bfloat16, cpu, 4096, **h200)["num_stages"] == 3  # 32-key tiles: not measured
    assert decode.decode_config(128, torch.bfloat16, cpu, 512) == dict(BLOCK_N=32)  # the interpreter


def test_the_split_kernel_gets_the_launch_s_programs_and_split_length(monkeypatch):
    seen = []
    real = decode.decode_config

    def spy(*args, **kwargs):
        if len(args) > 3:  # the launch's own call (the other asks for BLOCK_N only)
            seen.append((args[3:], kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "decode_config", spy)
    q = torch.randn(3, 8, 1, 32).to(DEVICE)
    k = torch.randn(3, 2, 64, 32).to(DEVICE)
    lens = torch.full((3,), 64, dtype=torch.int32, device=DEVICE)
    decode.decode_split(q, k, k, lens, 1, out=torch.empty_like(q))
    decode.decode_split(q, k, k, lens, 2)
    block_n = real(32, q.dtype, q.device)["BLOCK_N"]
    # 3 sequences x 2 kv heads x 1 block of packed rows, times the splits; 64 keys cut in 1 or 2
    assert seen == [((6,), dict(num_splits=1, split_blocks=-(-64 // block_n))),
                    ((12,), dict(num_splits=2, split_blocks=-(-32 // block_n)))]


def test_a_paged_cache_gets_four_times_the_splits_below_one_program_per_sm():
    """pick_num_splits(paged=True): 4x the model's count while that count gives at most one program per SM
    (capped at 32), the best counts of the paged sweep at 16k (32 at B = 1, 16 at B = 4, 4 at B = 16); past one
    program per SM (B = 64) the contiguous count."""
    cpu = torch.device("cpu")
    pick = {b: decode.pick_num_splits(b, 8, 1, 16384, cpu, 64, sm_count=132, paged=True) for b in (1, 4, 16, 64)}
    model = {b: decode.model_num_splits(b, 8, 1, 16384 // 64, 132) for b in (1, 4, 16, 64)}
    assert model == {1: 16, 4: 4, 16: 1, 64: 1}
    assert pick == {1: 32, 4: 16, 16: 4, 64: 1}
    # a short cache: the blocks cap it (1k keys, 16 blocks of 64: 4 splits at most)
    assert decode.pick_num_splits(1, 8, 1, 1024, cpu, 64, sm_count=132, paged=True) == \
        decode._max_splits(16) == decode.pick_num_splits(1, 8, 1, 1024, cpu, 64, sm_count=132)
    doc = " ".join(decode.pick_num_splits.__doc__.split())
    assert "32 at ``B = 1``, 16 at ``B = 4`` and 4 at ``B = 16`` (16k context)" in doc


def test_the_launcher_says_when_the_cache_is_paged(monkeypatch):
    seen = []
    real = decode.pick_num_splits
    monkeypatch.setattr(decode, "pick_num_splits", lambda *a, **k: seen.append(k.get("paged")) or real(*a, **k))
    q = torch.randn(1, 4, 1, 32).to(DEVICE)
    k = torch.randn(1, 2, 64, 32).to(DEVICE)
    lens = torch.full((1,), 64, dtype=torch.int32, device=DEVICE)
    pages = k.view(1, 2, 4, 16, 32).permute(0, 2, 1, 3, 4).reshape(4, 2, 16, 32).contiguous()
    table = torch.arange(4, dtype=torch.int32, device=DEVICE).view(1, 4)
    want = decode.launch_decode(q, k, k, lens)
    got = decode.launch_decode(q, pages, pages, lens, block_table=table)
    assert seen == [False, True]
    torch.testing.assert_close(got, want)
