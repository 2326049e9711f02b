"""check_attention_flops and check_roofline: planted slips get their diagnosis, correct answers pass."""

import math

import pytest

from course_utils.grading import GradingError, check_attention_flops, check_roofline


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
