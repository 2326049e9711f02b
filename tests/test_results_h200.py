"""Issue 23's ladder and issue 24's three full grids on the H200 the issues name (fortieth session, main at eae06bf,
after the whole suite passed there): the README's targets table and its sentences about these runs, derived again
from the JSON.

Each run checked every output before timing it; each figure quoted is recomputed here from ``results/`` and looked
for, at the precision written, in the sentence that quotes it.
"""

import statistics

from course_utils import results

from conftest import assert_quoted, decode_points, markdown_text, readme_text, training_ratios, window_points

TRAINING = ("training_bench_h200", "training_bench_h200_run2", "training_bench_h200_run3")
WINDOW = ("window_bench_h200", "window_bench_h200_run2", "window_bench_h200_run3")
DECODE = ("decode_bench_h200", "decode_bench_h200_run2", "decode_bench_h200_run3")
LADDER = ("fp8_bench_routes_h200", "fp8_bench_routes_h200_run2")
ROUTES = ("route_check_fma_h200", "route_check_h200")
LONG = lambda n: n >= 4096  # noqa: E731
fmt = lambda values: results.value_range(list(values))  # noqa: E731


def _window_points(mode: str) -> dict:
    return window_points(WINDOW, mode)


def _decode_points() -> dict:
    return decode_points(DECODE)


def _ladder(key: str, causal=None) -> list[float]:
    """``key`` (a ratio to cuDNN's bf16, the median of its repeats) at N ≥ 4k over both ladders."""
    return [s[key] for name in LADDER for s in results.load(name)["summary"]
            if LONG(s["n"]) and (causal is None or s["causal"] == causal)]


def test_the_h200_runs_are_complete_and_checked_what_they_timed():
    """Three training runs (N 1k-16k), three window grids (60 points each), three decode grids (19 points each), two
    ladders (N 1k-16k, causal and not), all on one H200 with the routes as shipped, every output checked first."""
    for name in TRAINING:
        doc = results.load(name)
        assert doc["info"]["gpu"] == "NVIDIA H200" and doc["case"]["causal"]
        assert {r["n"] for r in doc["rows"]} == {1024, 2048, 4096, 8192, 16384}
        assert all(r["status"] == "ok" for r in doc["rows"])
        assert all(r["rel_err"] < 2e-2 for r in doc["rows"] if r["provider"] != "sdpa_flash")
    for name in WINDOW:
        doc = results.load(name)
        assert doc["info"]["gpu"] == "NVIDIA H200" and len(doc["ratios"]) == 60
        assert all(r["status"] == "ok" for r in doc["rows"] if r["provider"] in ("course", "flex"))
    for name in DECODE:
        doc = results.load(name)
        assert doc["info"]["gpu"] == "NVIDIA H200" and len(doc["summary"]) == 19
    for name in LADDER:
        doc = results.load(name)
        assert doc["info"]["gpu"] == "NVIDIA H200" and doc["repeats"] == 2
        assert {(s["n"], s["causal"]) for s in doc["summary"]} == {(n, c) for n in (1024, 2048, 4096, 8192, 16384)
                                                                  for c in (True, False)}
    for name in ROUTES:
        doc = results.load(name)
        assert doc["info"]["gpu"] == "NVIDIA H200" and doc["shipped"]["GLUON_FMA"] is True
        assert doc["shipped"]["GLUON_NONCAUSAL_PERSISTENT"] is True
        assert all(r["status"] == "ok" for r in doc["rows"])


def test_the_readme_s_targets_table_is_the_recorded_h200_runs():
    """The table at the top of the README's speed section: each measured cell derived again, each verdict from it."""
    cudnn = training_ratios(TRAINING, "course", "sdpa_cudnn", LONG)
    flash = training_ratios(TRAINING, "course", "sdpa_flash", LONG)
    fwd, trn = _window_points("forward"), _window_points("training")
    decode = _decode_points()
    ratios = [s["course_vs_sdpa"] for runs in decode.values() for s in runs]
    ceiling = [s["course_vs_ceiling"] for (b, _), runs in decode.items() if b >= 16 for s in runs]
    every = lambda points: results.value_range([v for vs in points.values() for v in vs])  # noqa: E731
    in_all = lambda points, target: sum(max(vs) < target for vs in points.values())  # noqa: E731
    bf16, fp8 = _ladder("course_bf16_over_cudnn"), _ladder("course_fp8_over_cudnn")
    rows = [
        f"| forward, bf16 (`kernels.flash_attention`), N ≥ 4k, causal and not | ≥ 1.0× cuDNN | "
        f"{results.value_range(bf16)} (2 runs) | {'yes' if min(bf16) >= 1 else 'no'} |",
        f"| forward, FP8 (`kernels.flash_attention_fp8`), N ≥ 4k, causal and not | ≥ 1.4× cuDNN's bf16 | "
        f"{results.value_range(fp8)} (2 runs) | {'yes' if min(fp8) >= 1.4 else 'no'} |",
        f"| forward + backward, N ≥ 4k | ≥ 0.9× cuDNN | {results.value_range(cudnn)} (3 runs) | "
        f"at {sum(v >= 0.9 for v in cudnn)} of {len(cudnn)} points |",
        f"| forward + backward, N ≥ 4k | ≥ 1.5× SDPA flash | {results.value_range(flash)} (3 runs) | "
        f"{'yes' if min(flash) >= 1.5 else 'no'} |",
        f"| window forward, W 256–4096, S 0 and 4, N 4k–64k | ≥ 1.3× FlexAttention at every point | {every(fwd)} (3 runs) "
        f"| no: under at {in_all(fwd, 1.3)} of {len(fwd)} points in all three runs |",
        f"| window forward + backward, the same grid | ≥ 1.2× FlexAttention at every point | {every(trn)} (3 runs) | "
        f"no: under at {in_all(trn, 1.2)} of {len(trn)} points in all three runs |",
        f"| decode, B 1–64, contexts 1k–128k | ≥ 1.0× the best SDPA backend at every point | "
        f"{results.value_range(ratios)} (3 runs) | no: under at "
        f"{sum(all(s['course_vs_sdpa'] < 1 for s in runs) for runs in decode.values())} of {len(decode)} points in every run |",
        f"| decode, B ≥ 16 | ≥ 90% of the read ceiling | {100 * min(ceiling):.0f}–{100 * max(ceiling):.0f}% (3 runs) | "
        f"{'yes' if min(ceiling) >= 0.9 else 'no'} |",
    ]
    assert_quoted(readme_text(), rows)
    assert in_all(fwd, 1.3) > 0 and in_all(trn, 1.2) > 0  # the window rows' "no"
    assert min(bf16) < 1 and min(fp8) < 1.4  # the forward rows' "no"


def test_the_readme_quotes_the_h200_grids_point_by_point():
    """The fortieth session's bullet: the training, window and decode grids' points under their targets, run by run."""
    x = lambda values: ", ".join(f"{v:.2f}×" for v in values)  # noqa: E731
    cudnn = training_ratios(TRAINING, "course", "sdpa_cudnn", LONG)  # run by run, N = 4k, 8k, 16k in each
    assert [round(v, 3) for v in cudnn].index(min(round(v, 3) for v in cudnn)) == 0  # the lowest: N = 4k, run 1
    at_4k = cudnn[0::3]
    fwd, trn = _window_points("forward"), _window_points("training")
    fwd_under = {k: v for k, v in fwd.items() if min(v) < 1.3}
    trn_under = {k: v for k, v in trn.items() if min(v) < 1.2}
    assert list(fwd_under) == [(4096, 0, 65536)]
    assert sorted(trn_under) == [(256, 0, 4096), (256, 0, 8192), (256, 4, 4096), (1024, 0, 4096)]
    once = {k: min(v) for k, v in trn_under.items() if sum(r < 1.2 for r in v) == 1}
    assert sorted(once) == [(256, 0, 8192), (256, 4, 4096), (1024, 0, 4096)]
    decode = _decode_points()
    short = sorted(k for k, runs in decode.items() if all(s["course_vs_sdpa"] < 1 for s in runs))
    assert short == sorted(k for k, runs in decode.items() if any(s["course_vs_sdpa"] < 1 for s in runs))
    assert short == [(1, 131072), (4, 65536), (4, 131072), (16, 1024), (16, 4096), (16, 16384), (16, 65536),
                     (16, 131072)]
    worst = min(s["course_vs_sdpa"] for runs in decode.values() for s in runs)
    ceiling = [100 * s["course_vs_ceiling"] for (b, _), runs in decode.items() if b >= 16 for s in runs]
    assert all(s["sdpa_best_backend"] == "sdpa_cudnn" for runs in decode.values() for s in runs)
    quotes = [
        f"**{fmt(cudnn)} cuDNN** at N ≥ 4k, {sum(v >= 0.9 for v in cudnn)} of the 9 points at 0.9× or more (the "
        f"ninth {at_4k[0]:.3f}×, N = 4k in the first run; {at_4k[1]:.3f}× and {at_4k[2]:.3f}× in the other two)",
        f"**{fmt(training_ratios(TRAINING, 'course', 'sdpa_flash', LONG))} SDPA flash**",
        f"the forward **{fmt(v for vs in fwd.values() for v in vs)}** FlexAttention, under 1.3× at one point in all "
        f"three runs: W = 4096 without sinks at 64k ({x(fwd[(4096, 0, 65536)])})",
        f"forward + backward **{fmt(v for vs in trn.values() for v in vs)}**, under 1.2× at W = 256 without sinks at "
        f"4k in all three runs ({x(trn[(256, 0, 4096)])}) and at three points in one run each (W = 256 with 4 sinks "
        f"at 4k {once[(256, 4, 4096)]:.2f}×, W = 256 without sinks at 8k {once[(256, 0, 8192)]:.2f}×, W = 1024 "
        f"without sinks at 4k {once[(1024, 0, 4096)]:.2f}×)",
        f"under 1.0× at the same {len(short)} of the 19 points in every run, by at most {1 - worst:.1%}",
        f"**{fmt(s['course_vs_sdpa'] for runs in decode.values() for s in runs)}** the best SDPA backend (cuDNN at "
        "every point)",
        f"It reads {results.value_range(ceiling, '.0f', '%')} of the read ceiling at B ≥ 16",
    ]
    assert_quoted(readme_text(), quotes)


def test_the_readme_quotes_the_h200_step_that_the_grid_timed_slower():
    """W = 256 without sinks at 4k: the route check (no FlexAttention in its process) timed the step well under what
    the grid's three runs read for it, where FlexAttention's step, timed just before in the same process, moved with
    it from run to run."""
    check = {(r["mode"], r["window_size"], r["n"]): r for r in results.load("route_check_h200")["rows"]}
    step = check[("training", 256, 4096)]["on_ms"]
    grid = {p: [r["ms"] for name in WINDOW for r in results.load(name)["rows"]
                if r["provider"] == p and r["mode"] == "training" and r["window_size"] == 256
                and r["sink_size"] == 0 and r["n"] == 4096] for p in ("course", "flex")}
    assert min(grid["course"]) > 1.5 * step
    order = lambda v: sorted(range(3), key=v.__getitem__)  # noqa: E731
    assert order(grid["course"]) == order(grid["flex"])  # the two moved together
    quote = (f"the route check timed the same step at {step:.2f} ms where the grid's three runs read "
             f"{', '.join(f'{v:.2f}' for v in grid['course'])} ms, and FlexAttention's step beside it "
             f"{', '.join(f'{v:.2f}' for v in grid['flex'])} ms")
    assert quote in readme_text(), quote


def test_the_readme_quotes_the_h200_ladder_and_route_checks():
    """The forward ladder by mask, and the route checks: each route against itself off, the FMA softmax, the
    persistent non-causal grid, and the sinks model's choice against the measurement."""
    checks = [results.load(name)["rows"] for name in ROUTES]
    route = {m: [r["on_over_off"] for r in checks[1] if r["mode"] == m] for m in ("forward", "training")}
    fma = [[r["on_over_off"] for r in rows if r["mode"] == "fma"] for rows in checks]
    persistent = [r["on_over_off"] for rows in checks for r in rows if r["mode"] == "persistent"]
    sinks = [r for r in checks[1] if r["mode"] == "sinks"]
    agree = sum((r["on_over_off"] > 1) == r["model_picks_gluon"] for r in sinks)
    assert all(len(f) == 18 for f in fma) and len(persistent) == 4
    quotes = [
        f"the public bf16 entry **{fmt(_ladder('course_bf16_over_cudnn', True))} cuDNN** with the causal mask and "
        f"**{fmt(_ladder('course_bf16_over_cudnn', False))}** without it at N ≥ 4k, the FP8 entry "
        f"**{fmt(_ladder('course_fp8_over_cudnn'))} cuDNN's bf16**",
        f"forward {fmt(route['forward'])} at its {len(route['forward'])} points, forward + backward "
        f"{fmt(route['training'])} at its {len(route['training'])}",
        f"the model's choice of backward for sinks agrees with the measurement at {agree} of the {len(sinks)} points",
        f"the FMA softmax {fmt(fma[0] + fma[1])} at its 18 points in two checks (medians "
        f"{statistics.median(fma[0]):.3f}× and {statistics.median(fma[1]):.3f}×)",
        f"non-causal attention on the persistent grid {fmt(persistent)} at 8k and 16k",
    ]
    assert_quoted(readme_text(), quotes)


def test_the_readme_quotes_the_h200_persistent_probe():
    """hopper_ws_probe.py --persistent only --loops serial on the H200: the Gluon kernel against cuDNN, with and
    without the FMA softmax, at its three speed points."""
    rows = [r for r in results.load("hopper_ws_probe_persistent_h200")["rows"] if r["mode"] == "speed"]
    by = {(r["fma"], r["causal"], r["n"]): r["hopper_ws"] / r["cudnn"] for r in rows}
    points = ((True, 16384), (False, 16384), (True, 4096))
    assert all(by[(True, *p)] > by[(False, *p)] for p in points)
    quote = ("with it " + " / ".join(f"{by[(True, *p)]:.2f}×" for p in points) + " cuDNN (causal 16k / non-causal "
             "16k / causal 4k with B = 4), without it " + " / ".join(f"{by[(False, *p)]:.2f}×" for p in points))
    assert quote in readme_text(), quote


def test_the_readme_quotes_nsight_compute_on_the_h200():
    """The Gluon forward's serial loop under Nsight Compute on the H200 reads the tensor-pipe figure of the H100's."""
    h200 = results.load("ncu_forward_h200")
    assert h200["gpu"] == "NVIDIA H200"
    pipe = h200["kernels"]["gluon_serial"]["tensor_pipe_pct"]
    h100 = [results.load(name)["kernels"]["gluon_serial"]["tensor_pipe_pct"]
            for name in ("ncu_forward_h100", "ncu_forward_h100_fixed")]
    assert all(abs(pipe - v) < 0.5 for v in h100)
    quote = f"the Gluon forward's counters as on the H100: its tensor pipes busy {pipe:.1f}% of the time"
    assert quote in readme_text(), quote


def test_lesson_11_quotes_the_h200_runs():
    """Lesson 11's paragraph on the routes: the H200's ladders and training runs, derived again."""
    cudnn = training_ratios(TRAINING, "course", "sdpa_cudnn", LONG)
    quote = (f"the same switches read **{fmt(_ladder('course_bf16_over_cudnn', True))} cuDNN** for the public bf16 "
             f"entry with the causal mask and {fmt(_ladder('course_bf16_over_cudnn', False))} without it, "
             f"**{fmt(_ladder('course_fp8_over_cudnn'))} cuDNN's bf16** for the FP8 entry, and **{fmt(cudnn)} cuDNN** "
             f"for forward + backward ({sum(v >= 0.9 for v in cudnn)} of {len(cudnn)} points at 0.9× or more), "
             f"{fmt(training_ratios(TRAINING, 'course', 'sdpa_flash', LONG))} SDPA flash")
    causal = [s for name in LADDER for s in results.load(name)["summary"] if LONG(s["n"]) and s["causal"]]
    reached = [s for s in causal if s["course_bf16_over_cudnn"] >= 1]
    assert len(causal) == 6 and len(reached) == 1
    quote_reached = (f"The causal bf16 forward reached cuDNN at one of its six readings (N = {reached[0]['n'] // 1024}k, "
                     f"{reached[0]['course_bf16_over_cudnn']:.2f}×)")
    assert quote_reached in markdown_text("11_hopper_and_fp8"), quote_reached
    assert quote in markdown_text("11_hopper_and_fp8"), quote


def test_lesson_08_quotes_the_h200_grids():
    """Lesson 08's two H200 sentences: the forward over the three grids with the route on, and the host-paced point
    (the grid's course and FlexAttention steps, run by run, against the route check's)."""
    fwd, trn = _window_points("forward"), _window_points("training")
    text = markdown_text("08_sliding_window_and_sinks")
    check = {(r["mode"], r["window_size"], r["n"]): r for r in results.load("route_check_h200")["rows"]}
    ms = {p: [r["ms"] for name in WINDOW for r in results.load(name)["rows"]
              if r["provider"] == p and r["mode"] == "training" and r["window_size"] == 256
              and r["sink_size"] == 0 and r["n"] == 4096] for p in ("course", "flex")}
    under = [k for k, v in fwd.items() if min(v) < 1.3]
    assert under == [(4096, 0, 65536)]
    quotes = [
        f"read the forward at **{fmt(v for vs in fwd.values() for v in vs)} FlexAttention**. Only W = 4096 without "
        f"sinks at 64k stayed under 1.3×, at {', '.join(f'{v:.2f}×' for v in fwd[under[0]][:2])} and "
        f"{fwd[under[0]][2]:.2f}×",
        f"three runs of the grid read that point at {', '.join(f'{v:.2f}×' for v in trn[(256, 0, 4096)][:2])} and "
        f"{trn[(256, 0, 4096)][2]:.2f}× FlexAttention. The course's step took "
        f"{', '.join(f'{v:.2f}' for v in ms['course'][:2])} and {ms['course'][2]:.2f} ms there, and FlexAttention's, "
        f"timed just before it in the same process, {', '.join(f'{v:.2f}' for v in ms['flex'][:2])} and "
        f"{ms['flex'][2]:.2f} ms",
        f"timed the same step at {check[('training', 256, 4096)]['on_ms']:.2f} ms",
    ]
    assert_quoted(text, quotes)


def test_lessons_07_and_09_quote_the_h200_runs():
    """Lesson 07: the training runs with the routes beside the lesson pair's recorded table; lesson 09: the decode
    grids' range, ceiling and the points under cuDNN in every run."""
    cudnn = training_ratios(TRAINING, "course", "sdpa_cudnn", LONG)
    flash = training_ratios(TRAINING, "course", "sdpa_flash", LONG)
    pair = [training_ratios(("training_bench",), "course", other, LONG) for other in ("sdpa_cudnn", "sdpa_flash")]
    assert max(pair[0]) < min(cudnn) and max(pair[1]) < min(flash)
    quote = (f"read **{fmt(cudnn)} cuDNN's** forward + backward at N ≥ 4k and {fmt(flash)} SDPA flash. This lesson's "
             f"pair read {fmt(pair[0])} and {fmt(pair[1])} in the table below")
    assert quote in markdown_text("07_backward"), quote
    decode = _decode_points()
    ratios = [s["course_vs_sdpa"] for runs in decode.values() for s in runs]
    ceiling = [s["course_vs_ceiling"] for (b, _), runs in decode.items() if b >= 16 for s in runs]
    short = sum(all(s["course_vs_sdpa"] < 1 for s in runs) for runs in decode.values())
    quote = (f"read **{fmt(ratios)} the best SDPA backend** and {100 * min(ceiling):.0f}–{100 * max(ceiling):.0f}% of "
             f"the read ceiling at `B ≥ 16`. The course stayed under cuDNN at the same {short} of {len(decode)} points "
             f"in every run, by at most {1 - min(ratios):.1%}")
    assert quote in markdown_text("09_decoding"), quote


def test_the_readme_compares_the_h200_runs_with_the_last_runs_before_the_routes():
    """The training and window bullets' "before": the H200's recorded runs of 2026-12-04 (lesson 07's pair; lesson 06's
    machinery for the window forward), derived again."""
    before = [fmt(training_ratios(("training_bench",), "course", other, LONG)) for other in ("sdpa_cudnn", "sdpa_flash")]
    window = window_points(("window_bench",), "forward")
    assert results.load("training_bench")["info"]["gpu"] == results.load("window_bench")["info"]["gpu"] == "NVIDIA H200"
    quotes = [f"lesson 07's pair) read {before[0]} and {before[1]}.",
              f"read the forward at {fmt(v for vs in window.values() for v in vs)}. The forward + backward"]
    assert_quoted(readme_text(), quotes)


def test_notes_quote_the_ladders_drop_from_16k_to_4k():
    """results/NOTES.md's forty-eighth section: each provider's TFLOP/s at 4k over 16k (medians of the repeats) in
    the two ladders, and the persistent route against the program-per-tile Gluon kernel at both lengths."""
    from pathlib import Path

    def tflops(rows, provider, causal, n):
        return statistics.median(r["tflops"] for r in rows if r["provider"] == provider and r["causal"] == causal
                                 and r["n"] == n and r["status"] == "ok")

    runs = [results.load(name)["rows"] for name in LADDER]
    drop = {(p, c): [tflops(rows, p, c, 4096) / tflops(rows, p, c, 16384) for rows in runs]
            for p in ("course_bf16", "course_fp8", "sdpa_cudnn", "gluon_bf16") for c in (True, False)}
    route = {n: [tflops(rows, "course_bf16", False, n) / tflops(rows, "gluon_bf16", False, n) for rows in runs]
             for n in (4096, 16384)}
    f3 = lambda key: results.value_range(drop[key], ".3f", "")  # noqa: E731
    notes = " ".join((Path(__file__).resolve().parents[1] / "results" / "NOTES.md").read_text().split())
    assert_quoted(notes, [
        f"with the causal mask the public bf16 entry {f3(('course_bf16', True))} in both runs, the FP8 entry "
        f"{f3(('course_fp8', True))} and cuDNN {f3(('sdpa_cudnn', True))}; without it {f3(('course_bf16', False))}, "
        f"{f3(('course_fp8', False))} and {f3(('sdpa_cudnn', False))}, where lesson 11's Gluon bf16 kernel on a "
        f"program per tile (the ladder's Gluon column) keeps {f3(('gluon_bf16', False))}",
        f"it fell from {results.value_range(route[16384], '.2f', 'x')} the program-per-tile kernel at 16k to "
        f"{results.value_range(route[4096], '.2f', 'x')} at 4k"])
