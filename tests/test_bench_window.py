"""course_utils.bench.window without a GPU: the case list, the pair count, the writers, the no-GPU path.

The timing itself needs a GPU (the lead runs `python -m course_utils.bench window` on the H200).
"""

import json

import course_utils  # noqa: F401  (before triton)
import numpy as np
import pytest
import torch

from course_utils import bench, references
from course_utils.bench import window as bench_window


def test_sweep_is_the_issues_sweep():
    cases = bench_window.cases()
    assert {c.window_size for c in cases} == {256, 1024, 4096}
    assert {c.sink_size for c in cases} == {0, 4}
    assert min(c.n for c in cases) == 4096 and max(c.n for c in cases) == 65536
    assert len(cases) == 3 * 2 * 5
    assert (bench_window.N_Q_HEADS, bench_window.N_KV_HEADS, bench_window.HEAD_DIM) == (32, 8, 128)
    assert set(bench_window.PROVIDERS) == {"course", "flex", "sdpa_mask"}


@pytest.mark.parametrize("n,w,s", [(1, 1, 0), (10, 1, 0), (37, 5, 3), (64, 64, 4), (50, 100, 0), (70, 9, 80),
                                   (200, 16, 20), (33, 32, 1)])
def test_visible_pairs_match_the_mask(n, w, s):
    assert bench_window.visible_pairs(n, w, s) == int(references.window_mask(n, n, w, s).sum())
    assert bench_window.visible_pairs(n, None) == int(references.causal_mask(n, n).sum())


def test_flops_count_visible_pairs_only():
    # A window as long as N is plain causal: the same count as course_utils.bench's causal FLOPs.
    n = 4096
    assert bench_window.window_flops(n, n, 0, batch=2) == pytest.approx(
        bench.attention_flops(2, 32, n, 128, causal=True) * (n + 1) / n)
    # At a fixed window the work is linear in N (up to the first W rows).
    f = [bench_window.window_flops(n, 1024, 4) for n in (16384, 32768, 65536)]
    assert f[2] / f[1] == pytest.approx(2.0, rel=0.02) and f[1] / f[0] == pytest.approx(2.0, rel=0.05)
    assert bench_window.window_flops(n, 256, 0, training=True) == 3.5 * bench_window.window_flops(n, 256, 0)


def test_timing_helpers_come_from_bench():
    from course_utils.bench import report
    from course_utils.bench.measure import time_checked_forward, time_checked_training

    assert bench_window.gpu_available is bench.gpu_available and bench_window.environment_info is bench.environment_info
    # The check-then-time path, the output check and the ratio/merge helpers: one definition, in bench.
    assert bench_window.forward_error is bench.check_output
    assert bench_window.time_checked_forward is time_checked_forward and bench_window.time_checked_training is time_checked_training
    assert bench_window.course_over_flex is report.course_over_flex and bench_window.merge_rows_by is report.merge_rows_by
    from course_utils.bench.providers import flex_compiled

    assert bench_window.flex_compiled is flex_compiled  # one torch.compile(flex_attention) a process


def test_main_without_gpu_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_window, "gpu_available", lambda: False)
    assert bench_window.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == bench_window.NO_GPU_MESSAGE and "\n" not in out
    assert list(tmp_path.iterdir()) == []


def _fake_rows():
    rows = []
    for mode, factor in (("forward", 1.0), ("training", 3.5)):
        for n in (4096, 8192):
            r = dict(provider="causal", mode=mode, window_size=None, sink_size=0, n=n, batch=1, n_q_heads=32,
                     n_kv_heads=8, head_dim=128, ms=factor * n * n / 1e7, tflops=400.0, status="ok", rel_err=1e-3,
                     note="")
            rows.append(r)
            for provider, tf in (("course", 420.0), ("flex", 320.0), ("sdpa_mask", None)):
                rows.append(dict(r, provider=provider, window_size=1024, sink_size=4, ms=factor * n / 1e4 if tf else None,
                                 tflops=tf, status="ok" if tf else "OOM"))
    return rows


def test_writers(tmp_path, monkeypatch):
    rows = _fake_rows()
    paths = bench_window.write_results(rows, tmp_path, {"gpu": "test GPU"})
    text = paths["md"].read_text()
    assert "| 1024 | 4 | 8192 |" in text and "1.31×" in text and "OOM" in text
    saved = json.loads(paths["json"].read_text())
    assert saved["rows"] == rows and all(r["course_over_flex"] == pytest.approx(420 / 320) for r in saved["ratios"])
    assert paths["png"].stat().st_size > 1000
    monkeypatch.setattr(bench_window, "plot", lambda rows, path: path.write_bytes(b"png"))  # drawn once is enough
    assert bench_window.main(["--replot", str(paths["json"]), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "window_bench.md").read_text() == text


def test_reference_slice_and_error_on_cpu_tensors():
    # The GPU references are plain torch: check them on small CPU tensors against the float64 reference.
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 200, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    heads, idx, o_ref, lse_ref = bench_window.reference_forward(q, k, v, 7, 3, rows=16)
    want_o, want_lse = references.attention_lse(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                                causal=True, window_size=7, sink_size=3)
    np.testing.assert_allclose(o_ref.numpy(), want_o[0, heads][:, idx.numpy()], atol=1e-5)
    np.testing.assert_allclose(lse_ref.numpy(), want_lse[0, heads][:, idx.numpy()], atol=1e-5)
    o = torch.from_numpy(want_o).float()
    assert bench_window.forward_error((o, torch.from_numpy(want_lse).float()), (heads, idx, o_ref, lse_ref))[0] < 1e-5
    do = torch.randn_like(q)
    got = bench_window.reference_group_grads(q, k, v, do, 7, 3)
    want = references.attention_backward(q[:, :2].double().numpy(), k[:, :1].double().numpy(),
                                         v[:, :1].double().numpy(), do[:, :2].double().numpy(),
                                         causal=True, window_size=7, sink_size=3)
    for g, w in zip(got[1:], want):
        np.testing.assert_allclose(g.numpy(), w[0], atol=1e-4)


def test_split_runs_merge():
    rows = _fake_rows()
    again = [dict(rows[1], tflops=999.0)]
    merged = bench_window.merge_rows(rows, again)
    assert len(merged) == len(rows) and merged[-1]["tflops"] == 999.0
    assert sum(r["tflops"] == 999.0 for r in merged) == 1


def test_flex_mask_mod_matches_the_reference():
    mask_mod = bench_window._mask_mod(5, 2, "cpu")
    i = torch.arange(40)
    got = mask_mod(0, 0, i[:, None], i[None, :])
    assert torch.equal(got, torch.from_numpy(references.window_mask(40, 40, 5, 2)))
    assert bench_window._mask_mod(5, 2, "cpu") is mask_mod  # one per (W, S): no recompilation


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's
def test_the_compiled_flex_provider_gives_the_reference_on_the_cpu():
    """The bench's FlexAttention, as it times it (``providers.flex_compiled``: torch.compile with static shapes, the
    window's block mask), on a small case on the CPU: the float32 reference's output. Its first compilation takes
    about 10 s on two cores; the GPU grids use the same path."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 64, generator=g)
    k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(2))
    case = bench_window.WindowCase(64, 4, 256)
    rel, lse_err = bench_window.forward_error(bench_window.make_forward("flex", q, k, v, case)(),
                                              bench_window.reference_forward(q, k, v, 64, 4, rows=16))
    assert rel < 1e-5 and lse_err is None
    wrong = bench_window.make_forward("flex", q, k, v, bench_window.WindowCase(16, 0, 256))()  # another window
    assert bench_window.forward_error(wrong, bench_window.reference_forward(q, k, v, 64, 4, rows=16))[0] > 0.05
