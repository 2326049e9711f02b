"""course_utils.bench without a GPU: the message, the FLOP count, the writers, the shipped results."""

import csv
import dataclasses
import json
import math
import subprocess
import sys

import course_utils  # noqa: F401  (before triton)
import numpy as np
import pytest
import torch

from course_utils import bench, references


# ----------------------------------------------------------------------------
# No GPU: one sentence, exit code 0
# ----------------------------------------------------------------------------
def test_main_without_gpu_says_so_and_exits_zero(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "gpu_available", lambda: False)
    assert bench.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == bench.NO_GPU_MESSAGE
    assert "\n" not in out and out.endswith(".")  # one sentence
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.interpreter("this checks the no-GPU path of the command line")
def test_module_command_without_gpu():
    res = subprocess.run([sys.executable, "-m", "course_utils.bench", "--quick"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == bench.NO_GPU_MESSAGE


# ----------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------
def test_flops_formula_and_causal_halving():
    assert bench.attention_flops(1, 1, 1, 1, causal=False) == 4.0
    full = bench.attention_flops(4, 32, 4096, 128, causal=False)
    assert full == 4 * 4 * 32 * 4096**2 * 128
    assert bench.attention_flops(4, 32, 4096, 128, causal=True) == full / 2
    # Doubling N quadruples the work; doubling D or the heads doubles it.
    assert bench.attention_flops(1, 8, 2048, 64, False) == 4 * bench.attention_flops(1, 8, 1024, 64, False)
    assert bench.attention_flops(1, 8, 1024, 128, False) == 2 * bench.attention_flops(1, 8, 1024, 64, False)


def test_tflops_from_milliseconds():
    assert math.isclose(bench.tflops(1e12, 1000.0), 1.0)
    assert math.isclose(bench.tflops(bench.attention_flops(4, 32, 4096, 128, True), 1.0), 549.755813888)


def test_cases_keep_tokens_fixed():
    case = bench.STANDARD_SUITE[0]
    assert [case.batch(n) * n for n in case.ns] == [16384] * len(case.ns)
    assert {c.name for c in bench.STANDARD_SUITE} == {"main", "noncausal", "d64_causal", "d64_noncausal", "fp16"}
    d64 = [c for c in bench.STANDARD_SUITE if c.head_dim == 64]
    assert d64 and all(c.n_q_heads == c.n_kv_heads for c in d64)  # MHA
    assert {c.causal for c in d64} == {True, False}


def test_options_pick_the_suite_or_one_custom_case():
    cases = bench.cases_from_args(bench._parse([]))
    assert [c.name for c in cases] == [c.name for c in bench.STANDARD_SUITE]
    quick = bench.cases_from_args(bench._parse(["--quick"]))
    assert [c.name for c in quick] == ["main"] and quick[0].ns == bench.QUICK_NS
    (custom,) = bench.cases_from_args(bench._parse(["--no-causal", "--heads", "16/2", "--dim", "64", "--dtype", "fp16",
                                                   "--n", "512,2048", "--tokens", "8192"]))
    assert (custom.causal, custom.n_q_heads, custom.n_kv_heads, custom.head_dim, custom.dtype) == (False, 16, 2, 64, "fp16")
    assert custom.ns == (512, 2048) and custom.batch(512) == 16


# ----------------------------------------------------------------------------
# The providers' pure-PyTorch parts, and the correctness check
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_naive_attention_matches_the_reference_with_gqa(causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 48, 16, generator=g)
    k = torch.randn(2, 2, 48, 16, generator=g)
    v = torch.randn(2, 2, 48, 16, generator=g)
    o = bench.naive_attention(q, k, v, causal, 0.25)
    ref = references.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=causal, scale=0.25)
    np.testing.assert_allclose(o.double().numpy(), ref, atol=1e-5)


def test_compiled_provider_wraps_naive_attention_in_torch_compile():
    # The eager backend traces naive_attention with Dynamo without generating code
    # (Inductor's C++ compile would take a minute on the CI's CPU); the GPU run uses Inductor.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 40, 16, generator=g) for h in (4, 2, 2))
    fn = bench.compiled_attention(backend="eager")
    for causal in (True, False):
        np.testing.assert_allclose(fn(q, k, v, causal, 0.25).numpy(),
                                   bench.naive_attention(q, k, v, causal, 0.25).numpy(), atol=1e-6)
    assert "compiled" in bench.PROVIDERS and "torch.compile" in bench.LABELS["compiled"]


def test_check_output_passes_right_answers_and_flags_wrong_ones():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 160, 32, generator=g) for h in (4, 2, 2))
    ref = bench.reference_slice(q, k, v, causal=True, rows=16)
    heads, idx, o_ref, lse_ref = ref
    assert heads == [0, 3] and idx.tolist() == list(range(16)) + list(range(144, 160))
    right = bench.naive_attention(q, k, v, True, 1 / math.sqrt(32))
    rel, lse_err = bench.check_output(right, ref)
    assert rel < 1e-5 and lse_err is None
    # Non-causal output for a causal problem: far off.
    wrong = bench.naive_attention(q, k, v, False, 1 / math.sqrt(32))
    assert bench.check_output(wrong, ref)[0] > bench.TOLERANCE
    # An lse that is off is reported.
    lse = torch.zeros(1, 4, 160)
    assert bench.check_output((right, lse), ref)[1] > 1.0


def _checked_problem():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 96, 16, generator=g) for h in (4, 2, 2))
    return q, k, v, bench.reference_slice(q, k, v, causal=True, rows=8)


@pytest.fixture
def fake_do_bench(monkeypatch):
    """``triton.testing.do_bench`` needs a GPU: a stand-in that calls the function once and reads 2 ms."""
    import triton.testing

    calls = []

    def do_bench(fn, warmup=25, rep=100, return_mode="mean"):
        calls.append(fn)
        fn()
        return 2.0

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    return calls


def test_a_checked_forward_is_timed_only_when_right(fake_do_bench):
    from course_utils.bench.measure import time_checked_forward

    q, k, v, ref = _checked_problem()
    scale = 1 / math.sqrt(16)
    right = time_checked_forward(dict(note=""), lambda: lambda: bench.naive_attention(q, k, v, True, scale), ref, 4e12)
    assert right["ms"] == 2.0 and right["tflops"] == pytest.approx(2000.0) and right["rel_err"] < 1e-5
    assert len(fake_do_bench) == 1
    wrong = time_checked_forward(dict(note="", ms=None), lambda: lambda: bench.naive_attention(q, k, v, False, scale),
                                 ref, 4e12)
    assert wrong["status"] == "wrong" and wrong["ms"] is None and wrong["rel_err"] > bench.TOLERANCE
    bad_lse = time_checked_forward(
        dict(note="", ms=None), lambda: lambda: (bench.naive_attention(q, k, v, True, scale), torch.zeros(1, 4, 96)),
        ref, 4e12)
    assert bad_lse["status"] == "wrong" and bad_lse["note"].startswith("lse off by")
    assert len(fake_do_bench) == 1  # neither wrong answer was timed


@pytest.mark.parametrize("exc,status,note", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB\nmore"), "OOM", "out of memory"),
    (MemoryError("host allocation of 80 GB"), "OOM", "host allocation of 80 GB"),
    (ValueError("SDPA has no soft-cap (it is not a bias): not timed"), "n/a", "SDPA has no soft-cap"),
    (TypeError("first line\nsecond line"), "error", "TypeError: first line"),
])
def test_a_provider_that_raises_is_recorded_not_raised(fake_do_bench, exc, status, note):
    from course_utils.bench.measure import time_checked_forward, time_checked_training

    def make():
        raise exc

    *_, ref = _checked_problem()
    row = time_checked_forward(dict(note="", ms=None, status="ok"), make, ref, 1.0)
    assert row["status"] == status and row["note"].startswith(note) and "second line" not in row["note"]
    row, got = time_checked_training(dict(note="", ms=None, status="ok", rel_err=None), make, 1.0, ref=ref)
    assert row["status"] == status and got is None and not fake_do_bench


def test_a_checked_training_step_compares_gradients_then_times(fake_do_bench):
    from course_utils.bench.measure import relative_error, time_checked_training

    q, k, v, ref = _checked_problem()
    scale = 1 / math.sqrt(16)
    o = bench.naive_attention(q, k, v, True, scale)
    grads = (torch.ones_like(q), torch.ones_like(k), torch.ones_like(v))

    def row():
        return dict(note="", ms=None, status="ok", rel_err=None)

    def grads_error(got, want):
        return max(relative_error(a, b) for a, b in zip(got, want))

    # Against the float32 gradients.
    r, got = time_checked_training(row(), lambda: lambda: (o,) + grads, 7e12, ref=ref, want=(o,) + grads,
                                   grads_error=grads_error)
    assert r["status"] == "ok" and r["rel_err"] == 0.0 and r["tflops"] == pytest.approx(3500.0) and len(got) == 4
    # Against another provider's, where there is no float32 reference: the note says so; None entries are skipped.
    r, _ = time_checked_training(dict(row(), note="held fixed"), lambda: lambda: (o,) + grads + (None,), 7e12,
                                 ref=ref, baseline=(o,) + grads + (torch.zeros(3),), baseline_note="checked against B")
    assert r["status"] == "ok" and r["note"] == "held fixed; checked against B"
    # A gradient that is off, or a forward output that is: wrong, not timed, nothing returned.
    r, got = time_checked_training(row(), lambda: lambda: (o, 2 * grads[0]) + grads[1:], 7e12, ref=ref,
                                   want=(o,) + grads, grads_error=grads_error)
    assert r["status"] == "wrong" and r["rel_err"] == pytest.approx(1.0) and got is None
    r, got = time_checked_training(row(), lambda: lambda: (o.flip(-2),) + grads, 7e12, ref=ref)
    assert r["status"] == "wrong" and r["note"] == "the forward output o" and got is None
    assert len(fake_do_bench) == 2


# ----------------------------------------------------------------------------
# Writing results (fake measurements)
# ----------------------------------------------------------------------------
def _fake_rows():
    rows = []
    for case in bench.STANDARD_SUITE[:2]:
        for n in (1024, 4096):
            fake_tflops = {"naive": 30.0, "compiled": 100.0, "sdpa_flash": 200.0, "sdpa_cudnn": 500.0,
                           "course": 300.0, "fast": 400.0}
            for p, t in ((p, fake_tflops[p]) for p in bench.PROVIDERS):
                oom = p == "naive" and n == 4096
                rows.append(dict(
                    case=case.name, provider=p, dtype=case.dtype, causal=case.causal, batch=case.batch(n),
                    n_q_heads=case.n_q_heads, n_kv_heads=case.n_kv_heads, n=n, head_dim=case.head_dim,
                    ms=None if oom else 1.5, tflops=None if oom else t, peak_mib=None if oom else 64.0 * n / 1024,
                    status="OOM" if oom else "ok", rel_err=None if oom else 2e-3,
                    note="out of memory" if oom else ("BLOCK_M=128" if p == "fast" else ""),
                ))
    return rows


def test_write_results_csv_json_markdown_png(tmp_path):
    rows = _fake_rows()
    info = {"gpu": "Fake GPU", "date": "today", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1}
    ceilings = {"matmul_tflops": 700.0, "matmul_dtype": "bfloat16", "matmul_size": 8192, "copy_gbps": 4000.0}
    paths = bench.write_results(rows, tmp_path, info, list(bench.STANDARD_SUITE[:2]), ceilings)
    assert set(paths) == {"csv", "json", "md", "png"} and all(p.exists() for p in paths.values())
    # CSV round trip keeps numbers and empties.
    back = bench.read_csv(paths["csv"])
    assert len(back) == len(rows)
    assert back[0]["tflops"] == 30.0 and back[0]["n"] == 1024 and back[0]["causal"] is True
    oom = [r for r in back if r["status"] == "OOM"]
    assert len(oom) == 2 and all(r["tflops"] is None for r in oom)
    # JSON keeps everything.
    doc = json.loads(paths["json"].read_text())
    assert doc["info"]["gpu"] == "Fake GPU" and doc["rows"] == rows and doc["ceilings"]["copy_gbps"] == 4000.0
    # Markdown: the ratio columns are computed from the rows; OOM is shown as such.
    md = paths["md"].read_text()
    assert "| fast/flash | fast/cudnn | course/flash |" in md
    assert "| 1024 | 16 | 30 | 100 | 200 | 500 | 300 | 400 | 2.00x | 0.80x | 1.50x |" in md
    assert "| 4096 | 4 | OOM | 100 | 200 | 500 | 300 | 400 | 2.00x | 0.80x | 1.50x |" in md
    assert "Fake GPU" in md and "700 TFLOP/s" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_rebuilds_tables_from_json(tmp_path, capsys):
    bench.write_results(_fake_rows(), tmp_path, {"gpu": "Fake"}, list(bench.STANDARD_SUITE[:2]), plot=False)
    (tmp_path / "forward_bench.md").unlink()
    assert bench.main(["--replot", str(tmp_path)]) == 0
    assert "2.00x" in (tmp_path / "forward_bench.md").read_text()
    assert (tmp_path / "forward_bench.png").exists()


def test_ratio_table_skips_missing_providers():
    rows = [r for r in _fake_rows() if r["provider"] != "sdpa_cudnn"]
    r = bench.ratio_table(rows)[("main", 1024)]
    assert r["fast/sdpa_cudnn"] is None and math.isclose(r["fast/sdpa_flash"], 2.0)


def test_lesson_11s_forwards_join_the_sweep_where_asked(tmp_path):
    """--providers ...,course_fp8,gluon_bf16,gluon_fp8: bench fp8's providers (one copy) in the main sweep, with their
    own columns and ratios to cuDNN, checked at bench fp8's tolerances; a sweep without them renders as before."""
    import importlib

    from course_utils.bench import fp8, providers

    measure = importlib.import_module("course_utils.bench.measure")  # the package's `measure` is the function

    assert bench.ALL_PROVIDERS == bench.PROVIDERS + ("course_fp8", "gluon_bf16", "gluon_fp8")
    assert measure.tolerance("course_fp8") == measure.tolerance("gluon_fp8") == fp8.FP8_TOLERANCE > bench.TOLERANCE
    assert measure.tolerance("gluon_bf16") == fp8.BF16_TOLERANCE and measure.tolerance("fast") == bench.TOLERANCE
    q, k = torch.randn(1, 4, 256, 64, dtype=torch.bfloat16), torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    fn, note = providers.make_provider("course_fp8", q, k, k, True)
    assert callable(fn) and note.startswith("e4m3 inputs")
    assert providers.make_provider("gluon_bf16", q, k, k, True)[1] == ""
    rows = _fake_rows()
    extra = [dict(r, provider=p, tflops=t, note="") for r in rows if r["provider"] == "sdpa_cudnn"
             for p, t in (("gluon_bf16", 450.0), ("course_fp8", 600.0))]
    md = bench.markdown_tables(rows + extra)
    header = next(line for line in md.splitlines() if line.startswith("| N | B |"))
    assert header.endswith("| FP8 (11) | Gluon bf16 (11) | fast/flash | fast/cudnn | course/flash | "
                           "course_fp8/cudnn | gluon_bf16/cudnn |")
    line = next(line for line in md.splitlines() if line.startswith("| 1024 |"))
    assert line.endswith("| 600 | 450 | 2.00x | 0.80x | 1.50x | 1.20x | 0.90x |")
    assert bench.ratio_table(rows + extra)[("main", 1024)]["gluon_bf16/sdpa_cudnn"] == 0.9
    assert "gluon" not in bench.markdown_tables(rows) and "gluon_bf16/sdpa_cudnn" not in bench.ratio_table(rows)[("main", 1024)]
    assert bench.main(["--providers", "fast,gluon_fp8", "--out", str(tmp_path)]) == 0  # no GPU here: says so


# ----------------------------------------------------------------------------
# The results shipped in results/
# ----------------------------------------------------------------------------
RESULTS = bench.RESULTS_DIR


def test_shipped_results_parse_and_cover_every_provider_and_case():
    doc = bench.load_results(RESULTS / "forward_bench.json")
    info = doc["info"]
    for key in ("gpu", "torch", "triton", "date", "cuda", "cudnn"):
        assert info.get(key), key
    rows = doc["rows"]
    assert {r["case"] for r in rows} == {c.name for c in bench.STANDARD_SUITE}
    for case in bench.STANDARD_SUITE:
        for n in case.ns:
            got = {r["provider"] for r in rows if r["case"] == case.name and r["n"] == n}
            # The torch.compile baseline was added after the recorded run: it may be absent.
            assert set(bench.PROVIDERS) - {"compiled"} <= got <= set(bench.PROVIDERS), (case.name, n)
    # Every provider that was timed passed its correctness check first.
    for r in rows:
        if r["tflops"] is not None:
            assert r["status"] == "ok" and r["rel_err"] <= bench.TOLERANCE
            flops = bench.attention_flops(r["batch"], r["n_q_heads"], r["n"], r["head_dim"], r["causal"])
            assert math.isclose(r["tflops"], bench.tflops(flops, r["ms"]), rel_tol=1e-9)
    assert doc["ceilings"]["matmul_tflops"] > 0 and doc["ladder"]["steps"]


def test_shipped_csv_and_markdown_agree_with_the_json():
    doc = bench.load_results(RESULTS / "forward_bench.json")
    rows = bench.read_csv(RESULTS / "forward_bench.csv")
    assert len(rows) == len(doc["rows"])
    for a, b in zip(rows, doc["rows"]):
        assert (a["case"], a["provider"], a["n"]) == (b["case"], b["provider"], b["n"])
        if b["tflops"] is not None:
            assert math.isclose(a["tflops"], b["tflops"], rel_tol=1e-9)
    md = (RESULTS / "forward_bench.md").read_text()
    assert md.startswith(bench.markdown_tables(doc["rows"], doc["cases"], doc["info"]))
    assert bench.ladder_markdown(doc["ladder"]) in md
    for p in {r["provider"] for r in doc["rows"]}:
        assert bench.LABELS[p] in md
    assert (RESULTS / "forward_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_recorded_results_are_found():
    assert bench.recorded_results_path() == RESULTS / "forward_bench.json"


def test_training_flops_count_the_backward_as_two_and_a_half_forwards():
    from course_utils import bench

    fwd = bench.attention_flops(2, 4, 256, 64, causal=False)
    assert bench.training_flops(2, 4, 256, 64, causal=False) == pytest.approx(3.5 * fwd)
    assert bench.training_flops(2, 4, 256, 64, causal=True) == pytest.approx(3.5 * fwd / 2)


def test_training_table_shows_ratios_and_failures():
    from course_utils import bench

    case = bench.Case("main", ns=(1024, 2048))
    rows = []
    for n, times in ((1024, {"sdpa_flash": 3.0, "sdpa_cudnn": 1.5, "course": 2.0}), (2048, {"sdpa_flash": 6.0, "sdpa_cudnn": None, "course": 4.0})):
        for p, ms in times.items():
            rows.append(dict(n=n, provider=p, ms=ms, tflops=100.0 if ms else None, status="ok" if ms else "error"))
    md = bench.training_markdown(rows, case, {"gpu": "Fake GPU", "date": "today"})
    line_1k = next(l for l in md.splitlines() if l.startswith("| 1024 |"))
    assert line_1k.endswith("| 1.50x | 0.75x |")
    line_2k = next(l for l in md.splitlines() if l.startswith("| 2048 |"))
    assert "error" in line_2k and line_2k.endswith("| 1.50x | - |")
    assert "Fake GPU" in md


@pytest.mark.parametrize("name", ["forward_bench", "forward_bench_quick", "window_bench", "decode_bench", "ring_bench",
                                  "training_bench", "fp8_bench", "tune_fp8", "ncu_forward", "fp8_persistent",
                                  "decode_splits", "mods_bench", "ring_blocks", "tune_backward", "tune_window",
                                  "tune_fp8_hopper", "tune_fp8_maxnreg", "tune_window_fast", "sm90_compiles",
                                  "hopper_ws_probe", "hopper_ws_probe_h100", "hopper_ws_fp8_probe_h100",
                                  "ncu_forward_h100", "hopper_ws_probe_overlap_h100", "hopper_ws_fp8_probe_overlap_h100",
                                  "hopper_ws_bwd_probe_h100", "fp8_bench_gluon_h100", "fp8_bench_gluon_h100_run2",
                                  "ncu_forward_h100_fixed", "fp8_bench_gluon_h100_run3", "training_bench_gluon_h100",
                                  "training_bench_gluon_h100_run2", "training_bench_gluon_h100_run3",
                                  "fp8_bench_routes_h200", "fp8_bench_routes_h200_run2"])
def test_packaged_results_are_the_recorded_ones(name):
    """A pip install (Colab) has no results/ folder: the lessons read course_utils/data/ there."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    recorded = (root / "results" / f"{name}.json").read_bytes()
    packaged = (root / "course_utils" / "data" / f"{name}.json").read_bytes()
    assert packaged == recorded, f"copy results/{name}.json to course_utils/data/ after a new GPU run"


@pytest.mark.parametrize("module", ["cases", "window", "decode", "mods", "fp8"])
def test_every_bench_writes_to_the_repositorys_results_folder(module):
    """Each bench's default --out is <repo>/results (once course_utils/results, which no lesson reads)."""
    import importlib
    from pathlib import Path

    mod = importlib.import_module(f"course_utils.bench.{module}")
    assert mod.RESULTS_DIR == Path(__file__).resolve().parent.parent / "results"


def test_a_training_step_is_its_provider_s_forward_then_the_backward():
    """bench.training.make_training_forward is the forward make_training_step runs (ncu_backward.py profiles the
    backward of that forward alone): the same o, and the step's gradients are autograd's through it."""
    import torch

    from course_utils.bench import training

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 16, device=course_utils.DEVICE).requires_grad_() for h in (4, 2, 2))
    do = torch.randn(1, 4, 64, 16, device=course_utils.DEVICE)
    o, dq, dk, dv = training.make_training_step("course", q, k, v, do, True)()
    o2 = training.make_training_forward("course", q, k, v, True)()
    want = torch.autograd.grad(o2, (q, k, v), do)
    torch.testing.assert_close(o2, o)
    for got, w in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, w)
    with pytest.raises(ValueError, match="unknown training provider"):
        training.make_training_forward("sdpa_math", q, k, v, True)


def test_the_fast_backward_providers_run_their_configuration_and_are_tabled(monkeypatch):
    """--training --fast-backward: the course's forward with fast_backward's flat layout behind autograd (FLAT_DEFAULT,
    and with flat_dq), the gradients of float64 math; the table adds their columns and ratios to cuDNN."""
    import torch

    from course_utils import references
    from course_utils.bench import training
    from course_utils.kernels import fast_backward as fb

    calls = []
    real = fb.attention_backward_fast
    monkeypatch.setattr(fb, "attention_backward_fast", lambda *a, **kw: calls.append(kw["config"]) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    dtype = torch.float16 if course_utils.DEVICE == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(1, h, 128, 64, generator=g).to(course_utils.DEVICE, dtype).requires_grad_() for h in (4, 2, 2))
    do = torch.randn(1, 4, 128, 64, generator=g).to(course_utils.DEVICE, dtype)
    want = references.attention_backward(*(t.detach().double().cpu().numpy() for t in (q, k, v, do)), causal=True)
    for name in training.FAST_BACKWARD_PROVIDERS:
        _, *grads = training.make_training_step(name, q, k, v, do, True)()
        for got, w in zip(grads, want):
            w = torch.from_numpy(w)
            assert (torch.linalg.vector_norm(got.double().cpu() - w) / torch.linalg.vector_norm(w)).item() < 1e-2
    assert [c.flat_dq for c in calls] == [False, True] and all(c.mode == "flat" for c in calls)
    from course_utils import bench

    case = bench.Case("main", ns=(4096,))
    rows = [dict(n=4096, provider=p, ms=ms, tflops=1.0, status="ok")
            for p, ms in (("sdpa_flash", 3.0), ("sdpa_cudnn", 2.0), ("course", 2.5), ("course_flat", 2.2),
                          ("course_flat_dq", 1.6))]
    md = training.training_markdown(rows, case)
    assert "course, flat backward + flat dQ / cuDNN" in md
    assert next(line for line in md.splitlines() if line.startswith("| 4096 |")).endswith(
        "| 1.20x | 0.80x | 0.91x | 1.25x |")
