"""course_utils.bench.mods without a GPU: the case list, the pair count, the writers, the no-GPU path,
and the pieces of the providers and references that are plain torch (checked on small CPU tensors
against the float64 references).

The timing itself needs a GPU (the lead runs `python -m course_utils.bench mods` on the H200).
"""

import json
import warnings

import course_utils  # noqa: F401  (before triton)
import numpy as np
import pytest
import torch

from course_utils import bench, references, results
from course_utils.bench import cli
from course_utils.bench import mods as bench_mods


def test_sweep_is_the_issues_sweep():
    cases = bench_mods.cases()
    assert {c.mod for c in cases} == {"softcap", "alibi", "sinks"}
    assert {c.n_docs for c in cases} == {4, 16}
    assert {c.n for c in cases} == {8192, 16384, 32768}
    assert len(cases) == 3 * 2 * 3
    assert (bench_mods.N_Q_HEADS, bench_mods.N_KV_HEADS, bench_mods.HEAD_DIM) == (32, 8, 128)
    assert bench_mods.SOFTCAP == 50.0
    assert set(bench_mods.PROVIDERS) == {"course", "flex", "sdpa"}
    assert "mods" in cli.SUBCOMMANDS


def test_documents_are_random_seeded_and_valid():
    for n in (8192, 32768):
        for d in (4, 16):
            cu = bench_mods.cu_seqlens_for(n, d)
            assert cu[0] == 0 and cu[-1] == n and len(cu) == d + 1 and all(np.diff(cu) > 0)
            assert bench_mods.cu_seqlens_for(n, d) == cu  # seeded: the same documents every run
    lengths = np.diff(bench_mods.cu_seqlens_for(32768, 16))
    assert len(set(lengths.tolist())) > 8  # random lengths, not equal pieces


@pytest.mark.parametrize("cu", [[0, 1], [0, 10], [0, 3, 8, 12], [0, 1, 2, 3], [0, 37, 40, 100, 150], [0, 5, 70]])
def test_visible_pairs_match_the_mask(cu):
    n = cu[-1]
    causal = references.document_mask(cu, n) & references.causal_mask(n, n)
    assert bench_mods.visible_pairs(cu) == int(causal.sum())
    assert bench_mods.visible_pairs(cu, causal=False) == int(references.document_mask(cu, n).sum())


def test_flops_count_visible_pairs_only():
    # One document is plain causal: the same count as course_utils.bench's causal FLOPs (which uses N²/2).
    n = 4096
    assert bench_mods.mods_flops([0, n]) == pytest.approx(bench.attention_flops(1, 32, n, 128, causal=True) * (n + 1) / n)
    # 16 equal documents in N tokens: about 1/16 of the causal work.
    cu = list(range(0, n + 1, n // 16))
    assert bench_mods.mods_flops(cu) / bench_mods.mods_flops([0, n]) == pytest.approx(1 / 16, rel=0.01)
    assert bench_mods.mods_flops(cu, training=True) == 3.5 * bench_mods.mods_flops(cu)


def test_timing_helpers_come_from_bench():
    from course_utils.bench import report
    from course_utils.bench.measure import time_checked_forward, time_checked_training

    assert bench_mods.gpu_available is bench.gpu_available and bench_mods.environment_info is bench.environment_info
    # The check-then-time path, the output check and the ratio/merge helpers: one definition, in bench.
    assert bench_mods.forward_error is bench.check_output
    assert bench_mods.time_checked_forward is time_checked_forward and bench_mods.time_checked_training is time_checked_training
    assert bench_mods.course_over_flex is report.course_over_flex and bench_mods.merge_rows_by is report.merge_rows_by
    from course_utils.bench.providers import flex_compiled

    assert bench_mods.flex_compiled is flex_compiled  # one torch.compile(flex_attention) a process


def test_main_without_gpu_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_mods, "gpu_available", lambda: False)
    assert bench_mods.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == bench_mods.NO_GPU_MESSAGE and "\n" not in out and "GPU" in out
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["mods", "--out", str(tmp_path)]) == 0  # through the bench's command line
    assert capsys.readouterr().out.strip() == bench_mods.NO_GPU_MESSAGE


def _fake_rows():
    rows = []
    for mode, factor in (("forward", 1.0), ("training", 3.5)):
        for n in (8192, 16384):
            causal = bench_mods._row("causal", bench_mods.ModsCase("softcap", 1, n), mode)
            rows.append(dict(causal, ms=factor * n * n / 1e7, tflops=400.0))
            for mod in ("softcap", "alibi"):
                for provider, tf in (("course", 420.0), ("flex", 300.0), ("sdpa", None)):
                    r = bench_mods._row(provider, bench_mods.ModsCase(mod, 16, n), mode)
                    rows.append(dict(r, ms=factor * n / 1e4 if tf else None, tflops=tf,
                                     status="ok" if tf else ("n/a" if mod == "softcap" else "OOM")))
    return rows


def test_writers_and_the_lessons_table(tmp_path, monkeypatch):
    rows = _fake_rows()
    paths = bench_mods.write_results(rows, tmp_path, {"gpu": "test GPU"})
    text = paths["md"].read_text()
    assert "| softcap | 16 | 8192 |" in text and "1.40×" in text and "OOM" in text and "n/a" in text
    saved = json.loads(paths["json"].read_text())
    assert saved["rows"] == rows and all(r["course_over_flex"] == pytest.approx(420 / 300) for r in saved["ratios"])
    assert len(saved["ratios"]) == 2 * 2 * 2
    assert bench_mods.main(["--replot", str(paths["json"]), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "mods_bench.md").read_text() == text
    # course_utils.results renders it for lesson 12 (read from results/ or the package's data/).
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    assert results.figure("mods_bench", "course_over_flex", mode="forward") == "1.40×"
    table = results.markdown("mods_bench", ["mod", "docs", "N", "course_over_flex"], mode="training")
    assert "| alibi | 16 | 16384 | 1.40× |" in table


def test_split_runs_merge():
    rows = _fake_rows()
    again = [dict(rows[1], tflops=999.0)]
    merged = bench_mods.merge_rows(rows, again)
    assert len(merged) == len(rows) and merged[-1]["tflops"] == 999.0
    assert sum(r["tflops"] == 999.0 for r in merged) == 1


def _small(mod, n=96, seed=0):
    torch.manual_seed(seed)
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    cu = [0, 20, 21, 60, n]
    extra = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32), softcap=None, alibi_slopes=None, sink_logits=None)
    if mod == "softcap":
        extra["softcap"] = 2.0
    elif mod == "alibi":
        extra["alibi_slopes"] = torch.tensor(bench_mods.alibi_slopes(4), dtype=torch.float32)
    elif mod == "sinks":
        extra["sink_logits"] = torch.tensor([0.5, 2.0, -1.0, 1.0])
    kw = dict(cu_seqlens=np.array(cu), softcap=extra["softcap"],
              alibi_slopes=None if extra["alibi_slopes"] is None else extra["alibi_slopes"].double().numpy(),
              sink_logits=None if extra["sink_logits"] is None else extra["sink_logits"].double().numpy())
    return (q, k, v), extra, kw


@pytest.mark.parametrize("mod", ["softcap", "alibi", "sinks"])
def test_references_match_the_float64_ones(mod):
    (q, k, v), extra, kw = _small(mod)
    q64, k64, v64 = (t.double().numpy() for t in (q, k, v))
    heads, idx, o_ref, lse_ref = bench_mods.reference_forward(q, k, v, extra, rows=16)
    want_o, want_lse = references.attention_lse(q64, k64, v64, causal=True, **kw)
    np.testing.assert_allclose(o_ref.numpy(), want_o[0, heads][:, idx.numpy()], atol=1e-5)
    np.testing.assert_allclose(lse_ref.numpy(), want_lse[0, heads][:, idx.numpy()], atol=1e-5)
    assert bench_mods.forward_error((torch.from_numpy(want_o).float(), torch.from_numpy(want_lse).float()),
                                    (heads, idx, o_ref, lse_ref))[0] < 1e-5
    do = torch.randn_like(q)
    got = bench_mods.reference_group_grads(q, k, v, do, extra)
    want = references.attention_backward(q64[:, :2], k64[:, :1], v64[:, :1], do[:, :2].double().numpy(), causal=True,
                                         **dict(kw, alibi_slopes=None if kw["alibi_slopes"] is None else kw["alibi_slopes"][:2],
                                                sink_logits=None if kw["sink_logits"] is None else kw["sink_logits"][:2]))
    for g, w in zip(got[1:4], want[:3]):
        np.testing.assert_allclose(g.numpy(), w[0], atol=1e-4)
    if mod == "sinks":
        np.testing.assert_allclose(got[4].numpy(), want[3], atol=1e-4)
    else:
        assert got[4] is None


@pytest.mark.parametrize("mod", ["alibi", "sinks"])
def test_sdpa_bias_gives_the_reference(mod):
    # SDPA runs on the CPU too: its bias (and the sink's extra key) must give the float64 answer.
    (q, k, v), extra, kw = _small(mod)
    case = bench_mods.ModsCase(mod, 4, q.shape[-2])
    o = bench_mods.make_forward("sdpa", q, k, v, case, extra)()
    want = references.attention(*(t.double().numpy() for t in (q, k, v)), causal=True, **kw)
    np.testing.assert_allclose(o.double().numpy(), want, atol=1e-5)


def test_sdpa_has_no_softcap_and_is_not_timed_there():
    (q, k, v), extra, _ = _small("softcap")
    case = bench_mods.ModsCase("softcap", 4, q.shape[-2])
    row = bench_mods.measure_forward("sdpa", case, q, k, v, extra, ref=None)  # refused before anything runs
    assert row["status"] == "n/a" and "soft-cap" in row["note"] and row["ms"] is None


def test_flex_functions_and_sink_fold_give_the_reference():
    # FlexAttention's own mask_mod / score_mod and the sink fold, run unfused on the CPU (small N).
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    (q, k, v), extra, kw = _small("alibi", n=64)
    extra["softcap"], kw["softcap"] = 2.0, 2.0
    sinks = torch.tensor([0.5, 2.0, -1.0, 1.0])
    doc = bench_mods._document_ids(extra["cu_seqlens"], 64, "cpu")
    mask_mod = bench_mods.flex_mask_mod(doc)
    i = torch.arange(64)
    want_mask = references.document_mask(kw["cu_seqlens"], 64) & references.causal_mask(64, 64)
    assert torch.equal(mask_mod(0, 0, i[:, None], i[None, :]), torch.from_numpy(want_mask))
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=64, KV_LEN=64, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, lse = flex_attention(q, k, v, score_mod=bench_mods.flex_score_mod(2.0, extra["alibi_slopes"]),
                                block_mask=block_mask, enable_gqa=True, return_lse=True)
    o, lse = bench_mods.fold_sinks(o, lse, sinks)
    want_o, want_lse = references.attention_lse(*(t.double().numpy() for t in (q, k, v)), causal=True,
                                                **dict(kw, sink_logits=sinks.double().numpy()))
    np.testing.assert_allclose(o.double().numpy(), want_o, atol=1e-5)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=1e-5)
    assert bench_mods.flex_score_mod(None, None) is None


def test_mod_inputs_give_one_modification_each():
    for mod in bench_mods.MODS:
        extra = bench_mods.mod_inputs(bench_mods.ModsCase(mod, 4, 1000), "cpu")
        assert extra["cu_seqlens"].dtype == torch.int32 and extra["cu_seqlens"][-1] == 1000
        on = {key for key in ("softcap", "alibi_slopes", "sink_logits") if extra[key] is not None}
        assert on == {{"softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sink_logits"}[mod]}
    with pytest.raises(ValueError, match="unknown"):
        bench_mods.mod_inputs(bench_mods.ModsCase("rope", 4, 100), "cpu")


@pytest.mark.interpreter("the bench's calls on small CPU tensors need Triton's interpreter; on a GPU "
                         "`python -m course_utils.bench mods` checks the same calls on the GPU before timing them")
@pytest.mark.parametrize("mod", ["softcap", "sinks"])
def test_the_course_provider_and_its_training_step_pass_their_own_checks(mod):
    # The calls the bench times, on small fp32 CPU tensors (the interpreter): checked as the bench checks them.
    (q, k, v), extra, _ = _small(mod)
    case = bench_mods.ModsCase(mod, 4, q.shape[-2])
    ref = bench_mods.reference_forward(q, k, v, extra, rows=16)
    rel, lse_err = bench_mods.forward_error(bench_mods.make_forward("course", q, k, v, case, extra)(), ref)
    assert rel < 1e-5 and lse_err < 1e-5
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if extra["sink_logits"] is not None:
        extra["sink_logits"].requires_grad_()
    do = torch.randn_like(q)
    want = bench_mods.reference_group_grads(q, k, v, do, extra)
    got = tuple(None if t is None else t.detach() for t in bench_mods.make_training_step("course", q, k, v, do, case,
                                                                                          extra)())
    assert (got[4] is None) == (mod != "sinks")
    assert bench_mods.grads_error(got, want) < 1e-4
    wrong = (got[0], got[1], got[2], got[3] * 1.1, got[4])
    assert bench_mods.grads_error(wrong, want) > 0.05  # the comparison can fail


def test_lesson_12_says_what_the_recorded_run_measured():
    # Lesson 12's "Speed" prose: ahead of FlexAttention at some 16k-32k points only, behind at every 8k
    # point; forward + backward ahead only with soft-capping, at 16k-32k; the targets not met.
    from course_utils import results

    fwd, trn = (results.rows("mods_bench", mode=m) for m in ("forward", "training"))
    ahead = [r for r in fwd if r["course_over_flex"] > 1.0]
    assert ahead and all(16384 <= r["N"] <= 32768 for r in ahead)
    assert all(r["course_over_flex"] < 1.0 for r in fwd if r["N"] == 8192)
    ahead_trn = [r for r in trn if r["course_over_flex"] > 1.0]
    assert ahead_trn and all(r["mod"] == "softcap" and r["N"] >= 16384 for r in ahead_trn)
    assert min(r["course_over_flex"] for r in fwd) < 1.3 and min(r["course_over_flex"] for r in trn) < 1.2
