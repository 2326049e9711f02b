"""Lesson 06's checks: planted slips get their diagnosis, correct answers pass."""

import math
import re

import pytest

from course_utils.grading import (GradingError, check_attention_flops, check_programs_per_sm, check_roofline,
                                  check_two_per_sm)


# -- correct answers, written differently -----------------------------------------
def flops_plain(batch, n_heads, n, head_dim, causal):
    total = 4 * batch * n_heads * n * n * head_dim
    return total / 2 if causal else total


def flops_by_matmul(batch, n_heads, n, head_dim, causal):
    one_matmul = 2 * n * n * head_dim  # multiply-adds x 2
    return batch * n_heads * 2 * one_matmul * (0.5 if causal else 1.0)


@pytest.mark.parametrize("fn", [flops_plain, flops_by_matmul])
def test_correct_flop_counts_pass(fn):
    assert check_attention_flops(fn)


@pytest.mark.parametrize("fn, words", [
    (lambda b, h, n, d, c: 4 * b * h * n * n * d, "not halved"),
    (lambda b, h, n, d, c: 2 * b * h * n * n * d / (2 if c else 1), "half the count"),
    (lambda b, h, n, d, c: 4 * h * n * n * d / (2 if c else 1), "batch size is missing"),
    (lambda b, h, n, d, c: 4 * b * n * n * d / (2 if c else 1), "number of heads is missing"),
    (lambda b, h, n, d, c: 4 * b * h * d * (n * (n + 1) / 2 if c else n * n), "exact lower triangle"),
    (lambda b, h, n, d, c: 4 * b * h * n * n / (2 if c else 1), "head dim"),
])
def test_flop_slips_get_their_diagnosis(fn, words):
    with pytest.raises(GradingError, match=words):
        check_attention_flops(fn)


def test_flops_wrong_type_gets_one_sentence():
    with pytest.raises(GradingError, match="returned a str; return a number"):
        check_attention_flops(lambda *a: "many")
    with pytest.raises(GradingError, match="forget a `return`"):
        check_attention_flops(lambda *a: None)


def test_a_hard_coded_flop_table_fails_on_random_cases():
    table = {(4, 32, 4096, 128, True): flops_plain(4, 32, 4096, 128, True),
             (1, 8, 1000, 64, False): flops_plain(1, 8, 1000, 64, False),
             (3, 5, 7, 16, False): flops_plain(3, 5, 7, 16, False),
             (2, 1, 64, 16, True): flops_plain(2, 1, 64, 16, True)}
    with pytest.raises(GradingError):
        check_attention_flops(lambda *a: table.get(a, 0.0))


def roofline_min(intensity, peak_tflops, bandwidth_gbps):
    return min(peak_tflops, intensity * bandwidth_gbps / 1000)


def roofline_branch(intensity, peak_tflops, bandwidth_gbps):
    ridge = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)
    return peak_tflops if intensity >= ridge else intensity * bandwidth_gbps * 1e9 / 1e12


@pytest.mark.parametrize("fn", [roofline_min, roofline_branch])
def test_correct_rooflines_pass(fn):
    assert check_roofline(fn)


@pytest.mark.parametrize("fn, words", [
    (lambda i, p, bw: max(p, i * bw / 1000), "LOWER of the two limits"),
    (lambda i, p, bw: min(p, i * bw), "divide by 1000"),
    (lambda i, p, bw: i * bw / 1000, "caps nothing"),
    (lambda i, p, bw: p, "always returns the peak"),
])
def test_roofline_slips_get_their_diagnosis(fn, words):
    with pytest.raises(GradingError, match=words):
        check_roofline(fn)


def test_seed_reproduces_the_same_cases():
    seen = []

    def spy(i, p, bw):
        seen.append((i, p, bw))
        return roofline_min(i, p, bw)

    check_roofline(spy, seed=5)
    first = list(seen)
    seen.clear()
    check_roofline(spy, seed=5)
    assert seen == first and len(first) > 4
    assert all(math.isfinite(x) for case in first for x in case)


# ----------------------------------------------------------------------------
# check_programs_per_sm (lesson 06): occupancy from registers and shared memory
# ----------------------------------------------------------------------------
def _occupancy(r, w, s):
    if r > 255 or s > 227:
        return 0
    regs = math.ceil(r / 8) * 8
    return min(65536 // (regs * 32 * w), 228 // (s + 1), 64 // w, 32)


def _occupancy_loop(registers_per_thread, num_warps, shared_kib):
    # Written differently: add programs until one resource runs out.
    if registers_per_thread > 255 or shared_kib > 227:
        return 0
    per_program_regs = ((registers_per_thread + 7) // 8) * 8 * 32 * num_warps
    n = 0
    while (n + 1) * per_program_regs <= 65536 and (n + 1) * (shared_kib + 1) <= 228 \
            and (n + 1) * num_warps <= 64 and n + 1 <= 32:
        n += 1
    return n


@pytest.mark.parametrize("fn", [_occupancy, _occupancy_loop], ids=["formula", "loop"])
def test_programs_per_sm_correct_answers_pass(fn):
    for seed in (0, 1, 2):
        assert check_programs_per_sm(fn, seed=seed)


PLANTED_OCCUPANCY = {
    "most programs any one resource allows": lambda r, w, s: 0 if r > 255 or s > 227 else max(
        65536 // (math.ceil(r / 8) * 8 * 32 * w), 228 // (s + 1)),
    "1 KiB of shared memory the system reserves": lambda r, w, s: 0 if r > 255 or s > 227 else min(
        65536 // (math.ceil(r / 8) * 8 * 32 * w), 228 // s if s else 32, 64 // w, 32),
    "multiples of 8": lambda r, w, s: 0 if r > 255 or s > 227 else min(
        65536 // (r * 32 * w), 228 // (s + 1), 64 // w, 32),
    "resident-warp limit": lambda r, w, s: 0 if r > 255 or s > 227 else min(
        65536 // (math.ceil(r / 8) * 8 * 32 * w), 228 // (s + 1), 32),
    "counted per warp, not per thread": lambda r, w, s: 0 if r > 255 or s > 227 else min(
        65536 // (math.ceil(r / 8) * 8 * w), 228 // (s + 1), 64 // w, 32),
    "cannot launch at all": lambda r, w, s: min(
        65536 // (math.ceil(r / 8) * 8 * 32 * w), 228 // (s + 1), 64 // w, 32),
}


@pytest.mark.parametrize("message", list(PLANTED_OCCUPANCY))
def test_programs_per_sm_planted_mistakes_are_named(message):
    with pytest.raises(GradingError) as info:
        check_programs_per_sm(PLANTED_OCCUPANCY[message], seed=3)
    assert message in str(info.value)


def test_programs_per_sm_cases_are_the_recorded_compile_statistics():
    import json
    from pathlib import Path

    from course_utils.grading.part3_performance import RECORDED_COMPILES, programs_per_sm

    rows = json.loads((Path(__file__).resolve().parent.parent / "results" / "tune_fast.json").read_text())["rows"]
    recorded = {}
    for r in rows:
        m = re.fullmatch(r"regs (\d+), spills \d+, smem (\d+) KiB", r["info"])
        if m and r["n"] == 4096:
            recorded[r["name"]] = (int(m[1]), int(m[2]))
    for name, regs, warps, smem in RECORDED_COMPILES:
        assert recorded[name] == (regs, smem), name
        assert f" w{warps} " in f" {name} "
    # What results/NOTES.md says about them: the shipped winner fits twice, the old one once.
    assert programs_per_sm(255, 4, 96) == 2 and programs_per_sm(190, 8, 225) == 1 and programs_per_sm(139, 4, 113) == 2


# -- check_programs_per_sm at each boundary of the rule: fixed cases, so every seed catches them ----------
def _occupancy_loop_with(*, cap=True, strict=(), refuse_at=(), kib=lambda s: s):
    # The loop of _occupancy_loop with one thing changed: the 32-program cap, a comparison (< for <=), or
    # how shared_kib is read. strict / refuse_at name resources as part3_performance.RESOURCES does.
    def fn(registers_per_thread, num_warps, shared_kib):
        s = kib(shared_kib)
        if registers_per_thread > 255 or s > 227:
            return 0
        if ("registers" in refuse_at and registers_per_thread >= 255) or ("shared" in refuse_at and s >= 227):
            return 0
        per_program_regs = ((registers_per_thread + 7) // 8) * 8 * 32 * num_warps
        fits = {  # does a total of m programs fit?
            "registers": lambda m: m * per_program_regs < 65536 if "registers" in strict else m * per_program_regs <= 65536,
            "shared": lambda m: m * (s + 1) < 228 if "shared" in strict else m * (s + 1) <= 228,
            "warps": lambda m: m * num_warps < 64 if "warps" in strict else m * num_warps <= 64,
            "programs": lambda m: (m < 32 if "programs" in strict else m <= 32) if cap else True,
        }
        n = 0
        while all(f(n + 1) for f in fits.values()):
            n += 1
        return n
    return fn


def test_the_loop_with_every_comparison_right_passes():  # the planted versions below differ from it in one thing
    for seed in (0, 1):
        assert check_programs_per_sm(_occupancy_loop_with(), seed=seed)


PLANTED_BOUNDARIES = {
    "limit of 32 resident programs": _occupancy_loop_with(cap=False),
    "every limit was counted with <": _occupancy_loop_with(strict=("registers", "shared", "warps", "programs")),
    "shared memory that fits exactly was refused": _occupancy_loop_with(strict=("shared",)),
    "registers that fill the register file exactly": _occupancy_loop_with(strict=("registers",)),
    "warps that fill the SM exactly": _occupancy_loop_with(strict=("warps",)),
    "the 32nd program was refused": _occupancy_loop_with(strict=("programs",)),
    "227 KiB itself was refused": _occupancy_loop_with(refuse_at=("shared",)),
    "255 registers per thread itself was refused": _occupancy_loop_with(refuse_at=("registers",)),
}


@pytest.mark.parametrize("message", list(PLANTED_BOUNDARIES))
def test_boundary_mistakes_are_caught_on_every_seed_and_named(message):
    # Fresh random cases reached these boundaries 1-5% of the time; the fixed boundary cases always do.
    for seed in range(5):
        with pytest.raises(GradingError) as info:
            check_programs_per_sm(PLANTED_BOUNDARIES[message], seed=seed)
        assert message in str(info.value)


@pytest.mark.parametrize("kib, case", [
    (int, "113 KiB and one byte"),  # shared memory truncated to whole KiB
    (lambda s: round(s), "113 KiB and one byte"),
], ids=["int", "round"])
def test_shared_memory_a_byte_over_a_fit_is_not_rounded_away(kib, case):
    for seed in range(3):
        with pytest.raises(GradingError) as info:
            check_programs_per_sm(_occupancy_loop_with(kib=kib), seed=seed)
        assert case in str(info.value)


def test_the_boundary_cases_sit_on_both_sides_of_each_limit():
    from course_utils.grading.part3_performance import BOUNDARY_CASES, RESOURCES, programs_per_sm

    got = {what.split(":")[0]: programs_per_sm(r, w, s) for r, w, s, what in BOUNDARY_CASES}
    assert list(got.values()) == [32, 32, 4, 8, 7, 4, 2, 1, 1, 0, 0]
    # Each mistake model differs from the rule on at least one fixed case (so no seed can miss it).
    for kw in [dict(program_limit=False), dict(refuse_at=("shared",)), dict(refuse_at=("registers",))] + [
            dict(strict=(res,)) for res in RESOURCES]:
        cases = BOUNDARY_CASES + ((255, 4, 96, "recorded"),)
        assert any(programs_per_sm(r, w, s, **kw) != programs_per_sm(r, w, s) for r, w, s, _ in cases), kw


# ----------------------------------------------------------------------------
# check_two_per_sm (lesson 06): the learner's lesson-05 kernel, two programs per SM
# ----------------------------------------------------------------------------
def _two_per_sm_kit():
    """A learner's copy of lesson 05's kernel (forward.py outside course_utils) and a launcher taking options."""
    import torch
    import triton

    from conftest import learner_copy
    from course_utils.kernels import forward as course_forward

    forward = _KIT.get("forward") or learner_copy(course_forward, "learner_forward_two_per_sm")
    _KIT["forward"] = forward

    def launch(q, k, v, options, kernel=None):
        B, Hq, N, D = q.shape
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(N, options["BLOCK_M"]), B * Hq)
        (kernel or forward._flash_attention_forward_gqa_kernel)[grid](
            q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            1.0 / math.sqrt(D), N, Hq, k.shape[1],
            HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), IS_CAUSAL=True, **options)
        return o, lse

    return forward, launch


_KIT: dict = {}


def _smem_kib(block_m, block_n, d, stages, elt):  # the lesson's section-5 model, written out again
    return (block_m * d + 2 * stages * block_n * d) * elt / 1024


def _options_by_model(head_dim, dtype, *, pad=True, element_bytes=None):
    """The lesson's answer: 4 warps, 3 stages where two programs fit with 3, else 2 (pad=False: D unpadded)."""
    import triton

    d = triton.next_power_of_2(head_dim) if pad else head_dim
    elt = element_bytes or dtype.itemsize
    bm, bn = (128, 64) if dtype.itemsize == 2 else (64, 32)
    for stages in (3, 2):
        if _occupancy(255, 4, _smem_kib(bm, bn, d, stages, elt)) >= 2:
            return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=stages)
    raise ValueError("no configuration fits two programs")


def _options_by_table(head_dim, dtype):
    """Written differently: the measured configuration for 16-bit D = 128, lesson 05's H200 launch elsewhere."""
    import torch
    import triton

    forward, _ = _two_per_sm_kit()
    if dtype.itemsize == 2 and triton.next_power_of_2(head_dim) == 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    return forward.block_config(head_dim, dtype, torch.device("cuda"), capability=(9, 0))


def _options_64x64(head_dim, dtype):
    """Also two programs per SM: 64 x 64 tiles keep 3 stages at D = 128 in 16-bit (112 KiB)."""
    return dict(BLOCK_M=64, BLOCK_N=64 if dtype.itemsize == 2 else 32, num_warps=4,
                num_stages=3 if dtype.itemsize == 2 else 2)


@pytest.mark.parametrize("options", [_options_by_model, _options_by_table, _options_64x64],
                         ids=["model", "table", "64x64"])
def test_two_per_sm_correct_launches_pass(options):
    _, launch = _two_per_sm_kit()
    assert check_two_per_sm(lambda q, k, v: launch(q, k, v, options(q.shape[-1], q.dtype)))


def test_two_per_sm_passes_options_positionally_too():
    # BLOCK_M and BLOCK_N as positional constexprs: the check reads them by the kernel's parameter names.
    forward, _ = _two_per_sm_kit()
    import torch
    import triton

    def fn(q, k, v):
        B, Hq, N, D = q.shape
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
        cfg = _options_by_model(D, q.dtype)
        forward._flash_attention_forward_gqa_kernel[(triton.cdiv(N, cfg["BLOCK_M"]), B * Hq)](
            q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            1.0 / math.sqrt(D), N, Hq, k.shape[1], D, triton.next_power_of_2(D), True, cfg["BLOCK_M"], cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return o, lse

    assert check_two_per_sm(fn)


def _taught(head_dim, dtype):  # lesson 05's launch on an H200, unchanged: 8 warps, 3 stages at D = 128
    import torch

    forward, _ = _two_per_sm_kit()
    return forward.block_config(head_dim, dtype, torch.device("cuda"), capability=(9, 0))


PLANTED_TWO_PER_SM = {
    "still uses 8 warps": _taught,
    "Use num_stages=2 here": lambda d, dt: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    "these are float32 inputs": lambda d, dt: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
    "not D = 80": lambda d, dt: _options_by_model(d, dt, pad=False),
    "float32 inputs: 4 bytes": lambda d, dt: _options_by_model(d, dt, element_bytes=2),
    "names no num_warps and num_stages": lambda d, dt: dict(BLOCK_M=128, BLOCK_N=64),
    "names no num_stages": lambda d, dt: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4),
    "with one stage no K/V tile is loaded": lambda d, dt: dict(_options_by_model(d, dt), num_stages=1),
    "use 4. On Hopper a warpgroup": lambda d, dt: dict(_options_by_model(d, dt), num_warps=2),
    "hold one. Two programs need at most 113 KiB": lambda d, dt: dict(BLOCK_M=128, BLOCK_N=128, num_warps=4,
                                                                     num_stages=2),
}


@pytest.mark.parametrize("message", list(PLANTED_TWO_PER_SM))
def test_two_per_sm_planted_launches_are_named(message):
    _, launch = _two_per_sm_kit()
    options = PLANTED_TWO_PER_SM[message]
    with pytest.raises(GradingError) as info:
        check_two_per_sm(lambda q, k, v: launch(q, k, v, options(q.shape[-1], q.dtype)))
    assert message in " ".join(str(info.value).split()), str(info.value)


def test_two_per_sm_refuses_the_course_kernel_and_torch():
    import torch

    from course_utils.kernels import forward as course_forward

    _, launch = _two_per_sm_kit()
    with pytest.raises(GradingError, match="course_utils's own kernel"):
        check_two_per_sm(lambda q, k, v: launch(q, k, v, _options_by_model(q.shape[-1], q.dtype),
                                                kernel=course_forward._flash_attention_forward_gqa_kernel))

    def sdpa(q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return o, torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)

    with pytest.raises(GradingError, match="torch computed attention"):
        check_two_per_sm(sdpa)


def test_two_per_sm_wrong_results_get_their_diagnosis(tmp_path):
    import inspect

    from conftest import function_span, module_from_source
    from course_utils.grading.mistakes import MSG_LSE_MIXED_TRITON
    from course_utils.kernels import forward as course_forward

    _, launch = _two_per_sm_kit()
    src = inspect.getsource(course_forward)
    a, b = function_span(src, "_flash_attention_forward_gqa_kernel")
    old = "lse = (m_i + tl.log2(l_i)) * 0.6931471805599453"
    assert src[a:b].count(old) == 1
    mixed = module_from_source(tmp_path / "two_per_sm_mixed.py", src[:a] + src[a:b].replace(old, "lse = m_i + tl.log(l_i)") + src[b:])
    with pytest.raises(GradingError) as info:
        check_two_per_sm(lambda q, k, v: launch(q, k, v, _options_by_model(q.shape[-1], q.dtype),
                                                kernel=mixed._flash_attention_forward_gqa_kernel))
    assert "lse is wrong" in str(info.value) and MSG_LSE_MIXED_TRITON[:60] in str(info.value)
    with pytest.raises(GradingError, match="return the pair"):
        check_two_per_sm(lambda q, k, v: launch(q, k, v, _options_by_model(q.shape[-1], q.dtype))[0])


def test_two_per_sm_model_matches_the_recorded_compiles():
    # The shared-memory model the check uses, against the fast kernel's compiles on the H200 (same tiles):
    # within 1 KiB, and the same number of programs per SM.
    from course_utils.grading.part3_performance import (MEASURED_TWO_PER_SM, RECORDED_COMPILES, lesson05_shared_kib,
                                                        two_per_sm_fit)

    for name, regs, warps, smem in RECORDED_COMPILES:
        m = re.fullmatch(r"(\d+)x(\d+) w(\d) s(\d)( kv-grouped)?", name)
        if not m:  # the hand-pipelined experiment keeps a second score tile: not lesson 05's kernel
            continue
        bm, bn, w, s = (int(x) for x in m.groups()[:4])
        assert abs(lesson05_shared_kib(bm, bn, 128, s, 2) - smem) <= 1, name
        if w == 4:
            assert two_per_sm_fit(bm, bn, 128, s, 2) == min(2, _occupancy(regs, warps, smem)), name
    c = MEASURED_TWO_PER_SM
    assert two_per_sm_fit(c["BLOCK_M"], c["BLOCK_N"], 128, c["num_stages"], 2) == 2
    assert two_per_sm_fit(c["BLOCK_M"], c["BLOCK_N"], 128, 3, 2) == 1


def test_two_per_sm_on_a_gpu_too_small_for_the_launch_says_where_to_grade_it(monkeypatch):
    # A T4 (sm_75) gives a program 64 KiB: the H200's 96 KiB launch cannot start there.
    import dataclasses

    from course_utils.grading import part3_performance

    t4 = dataclasses.replace(part3_performance.current(), device="cuda", capability=(7, 5), gpu_name="Tesla T4")
    monkeypatch.setattr(part3_performance, "current", lambda: t4)
    with pytest.raises(GradingError, match=r"Tesla T4, sm_75.*check_on_cpu\(check_two_per_sm"):
        part3_performance.grade_two_per_sm(lambda q, k, v: None)


def test_the_graders_own_rule_is_refused_as_the_answer():
    from course_utils.grading import part3_performance

    text = str(pytest.raises(GradingError, check_programs_per_sm, part3_performance.programs_per_sm).value)
    assert "called course_utils.grading.part3_performance.programs_per_sm" in text and "own answer" in text, text
    assert part3_performance.programs_per_sm(64, 4, 50) > 0  # answers again once the check has ended


@pytest.mark.parametrize("borrowed", ["reference", "bench"])
def test_programs_per_sm_borrowed_answers_are_refused(borrowed):
    """The grader's own rule, called directly or through course_utils.bench.decode.programs_per_sm (which
    lesson 11 uses and which delegates to it), is refused while the check runs."""
    from course_utils.bench import decode as bench_decode
    from course_utils.grading import part3_performance

    fn = {"reference": part3_performance.programs_per_sm,
          "bench": lambda r, w, s: bench_decode.programs_per_sm(r, w, s * 1024)}[borrowed]
    with pytest.raises(GradingError) as info:
        check_programs_per_sm(fn, seed=0)
    assert "it is the course's own answer to this exercise" in str(info.value), str(info.value)
    assert part3_performance.programs_per_sm(255, 4, 96) == 2  # the rule works again after the check
