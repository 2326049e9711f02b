"""Issue 24's three full grids, run on an H100 with lesson 11's kernels behind the public entries (the defaults since
the thirty-fourth session): results/SPEED.md's and lesson 08's sentences about them, derived again from the JSON.

Each run checked every output before timing it; each figure quoted is recomputed here from ``results/`` and looked
for, at the precision written, in the sentence that quotes it.
"""

import statistics

from course_utils import results
from course_utils.kernels.fast_backward import sink_walk_fits

from conftest import (REPO, assert_quoted, decode_points, markdown_text, readme_text, speed_text, training_ratios,
                      window_points)

TRAINING = ("training_bench_h100", "training_bench_h100_run2", "training_bench_h100_run3")
WINDOW = ("window_bench_h100", "window_bench_h100_run2")
DECODE = ("decode_bench_h100", "decode_bench_h100_run2", "decode_bench_h100_run3", "decode_bench_h100_run4")


def _training(other: str, n=lambda n: True) -> list[float]:
    """``kernels.flash_attention``'s speed relative to ``other`` in the three runs, at the N matching ``n``."""
    return training_ratios(TRAINING, "course", other, n)


def _window_points(mode: str) -> dict:
    return window_points(WINDOW, mode)


def _decode_points() -> dict:
    return decode_points(DECODE)


def test_the_h100_grids_are_complete_and_checked_what_they_timed():
    """Three training runs (N 1k-16k), two window grids (W 256/1024/4096, S 0/4, N 4k-64k, forward and forward +
    backward: 60 points each) and four decode grids (19 points each), all on the H100, every output checked."""
    for name in TRAINING:
        doc = results.load(name)
        assert doc["info"]["gpu"].startswith("NVIDIA H100") and doc["case"]["causal"]
        assert {r["n"] for r in doc["rows"]} == {1024, 2048, 4096, 8192, 16384}
        assert all(r["status"] == "ok" for r in doc["rows"])
        assert all(r["rel_err"] < 2e-2 for r in doc["rows"] if r["provider"] != "sdpa_flash")
    for name in WINDOW:
        doc = results.load(name)
        assert doc["info"]["gpu"].startswith("NVIDIA H100") and len(doc["ratios"]) == 60
        assert all(r["status"] == "ok" for r in doc["rows"] if r["provider"] in ("course", "flex"))
    for name in DECODE:
        doc = results.load(name)
        assert doc["info"]["gpu"].startswith("NVIDIA H100") and len(doc["summary"]) == 19
    assert all(len(runs) == len(DECODE) for runs in _decode_points().values())


def test_the_speed_record_quotes_the_h100_training_runs_as_recorded():
    """The public entry's forward + backward (its Gluon backward on Hopper) against cuDNN and SDPA flash."""
    long = lambda n: n >= 4096  # noqa: E731
    cudnn, flash = _training("sdpa_cudnn", long), _training("sdpa_flash", long)
    under = sorted(v for v in cudnn if v < 0.9)
    quote = (f"**{results.value_range(cudnn)} cuDNN's** forward + backward at N ≥ 4k ({len(cudnn) - len(under)} of the "
             f"{len(cudnn)} points at 0.9× or more; the other {len(under)} at "
             f"{' and '.join(f'{v:.3f}×' for v in under)}) and **{results.value_range(flash)} SDPA flash**, "
             f"{results.value_range(_training('sdpa_cudnn', lambda n: n < 4096))} cuDNN at N = 1k and 2k")
    assert quote in speed_text(), quote
    assert min(flash) >= 1.5  # results/SPEED.md says the 1.5x target is met at every point


def test_the_speed_record_and_lesson_08_quote_the_h100_window_grids_as_recorded():
    fwd, trn = _window_points("forward"), _window_points("training")
    every = lambda points: results.value_range([v for vs in points.values() for v in vs])  # noqa: E731
    below_fwd = {p: vs for p, vs in fwd.items() if min(vs) < 1.3}
    below_trn = {p: vs for p, vs in trn.items() if min(vs) < 1.2}
    both = lambda below, target: sum(max(vs) < target for vs in below.values())  # noqa: E731
    quotes = [
        f"the forward **{every(fwd)} FlexAttention** (target 1.3×: under it at {len(below_fwd)} of the 30 points in "
        f"one run or both, {both(below_fwd, 1.3)} in both:",
        f"forward + backward **{every(trn)}** (target 1.2×: under it at {len(below_trn)} points in one run or both, "
        f"{both(below_trn, 1.2)} in both:",
        f"W = 4096 without sinks from N = 16k ({results.value_range([v for (w, s, n), vs in fwd.items() for v in vs if w == 4096 and s == 0 and n >= 16384])} forward",
        f"at W = 256 without sinks and N = 4k ({results.value_range(trn[(256, 0, 4096)])})",
    ]
    readme = speed_text()
    assert_quoted(readme, quotes)
    # the points results/SPEED.md names as under the targets in both runs
    assert {p for p, vs in below_fwd.items() if max(vs) < 1.3} == {
        (1024, 0, 16384), (1024, 0, 65536), (4096, 4, 65536), (4096, 0, 16384), (4096, 0, 32768), (4096, 0, 65536)}
    assert {p for p, vs in below_trn.items() if max(vs) < 1.2} == {
        (256, 0, 4096), (256, 0, 8192), (1024, 0, 4096), (4096, 0, 16384), (4096, 4, 4096)}
    assert "with 4 sinks, lesson 07's window kernels and the sinks' split still run the backward: " \
        f"{results.value_range([v for (w, s, n), vs in trn.items() for v in vs if s == 4 and n >= 8192])} from n = 8k" \
        in readme.lower()
    host = {(r["case"], r["provider"]): r for r in results.load("host_overhead_h100")["runs"][0]["rows"]}
    course, flex = host[("W=256 S=0 N=4k", "course")], host[("W=256 S=0 N=4k", "flex")]
    assert course["kernels_ms"] < course["host_ms"]  # launch-bound, as both texts say
    step = (f"the host needs {course['host_ms']:.2f} ms to launch the step whose kernels take {course['kernels_ms']:.2f} "
            f"ms (FlexAttention's: {flex['host_ms']:.2f} and {flex['kernels_ms']:.2f} ms)")
    assert step in readme, step
    lesson = markdown_text("08_sliding_window_and_sinks")
    for quote in (f"forward + backward read **{every(trn)}** FlexAttention",
                  f"{results.value_range([v for (w, s, n), vs in trn.items() for v in vs if w == 1024 and s == 0 and n >= 8192])} "
                  "at `W = 1024` from `N = 8k`, where this table has "
                  f"{results.figure('window_bench', 'course_over_flex', mode='training', W=1024, S=0, N=lambda n: n >= 8192)}",
                  step):
        assert quote in lesson, quote


def test_the_speed_record_quotes_the_h100_decode_runs_as_recorded():
    points = _decode_points()
    ratios = [s["course_vs_sdpa"] for runs in points.values() for s in runs]
    always = sorted(p for p, runs in points.items() if all(s["course_vs_sdpa"] < 1 for s in runs))
    counts = [sum(s["course_vs_sdpa"] < 1 for s in results.load(name)["summary"]) for name in DECODE]
    ceiling = [s["course_vs_ceiling"] for (b, _), runs in points.items() if b >= 16 for s in runs]
    quote = (f"**{results.value_range(ratios)}** the best SDPA backend (cuDNN at every point), under 1.0× at "
             f"{min(counts)}–{max(counts)} of the 19 points in each run by at most {100 * (1 - min(ratios)):.1f}%, "
             f"{len(always)} of them in all four runs")
    readme = speed_text()
    assert quote in readme, quote
    assert f"{100 * min(ceiling):.0f}–{100 * max(ceiling):.0f}% of the read ceiling at B ≥ 16 in all four" in readme
    assert {b for b, _ in always} == {1, 4, 16, 64} and all((16, c) in always for c in (1024, 4096, 16384, 65536))


def test_the_speed_record_quotes_the_h100_decode_sweeps_as_recorded():
    """tune_decode.py on the H100 at five of the points under cuDNN: the best launch, the shipped one, and --lean's
    PDL at twice the splits against what the package runs, from a 64k context at B = 1."""
    by = {}
    for r in results.load("tune_decode_h100")["rows"]:
        by.setdefault((r["batch"], r["context"]), []).append(r)
    best, shipped, counts = [], [], []
    for rows in by.values():
        cudnn = next(r["gbps"] for r in rows if r["name"] == "sdpa_cudnn")
        course = [r for r in rows if not r["name"].startswith("sdpa")]
        counts.append(len(course))
        best.append(max(r["gbps"] for r in course) / cudnn)
        shipped += [r["gbps"] / cudnn for r in course if r.get("shipped")]
    assert len(by) == 5 and len(shipped) == 5 and max(best) < 1  # no launch at cuDNN's speed
    short = by[(16, 1024)]
    top, ship = max(short, key=lambda r: r["gbps"] if "num_stages" in r else 0), next(r for r in short if r.get("shipped"))
    assert (top["num_stages"], ship["num_stages"]) == (3, 4) and f"{top['gbps'] / ship['gbps'] - 1:.0%}" == "2%"
    lean = {}
    for r in results.load("tune_decode_lean_h100")["rows"]:
        if r["batch"] == 1:
            lean.setdefault(r["name"], []).append(r["over_cudnn"])
    readme = speed_text()
    for quote in (f"{min(counts)}–{max(counts)} launches a point",
                  f"the best read {results.value_range(best, '.3f')} cuDNN, the shipped one "
                  f"{results.value_range(shipped, '.3f')}",
                  f"PDL at twice the splits read {results.value_range(lean['pdl x2'], '.3f')} cuDNN, the equal-shares "
                  f"schedule the package ran there {results.value_range(lean['package'], '.3f')}"):
        assert quote in readme, quote


def test_the_speed_record_quotes_the_h200_sweep_behind_b_1_from_64k():
    """results/pdl_splits.json from a 64k context at B = 1: the PDL launch at twice lesson 09's splits against the
    lean schedule ('course' there), per round (three decimals), as results/SPEED.md quotes them beside the H100's sweep;
    the rule that follows from it (fast_decode.lean_rule) gives B = 1 the PDL launch and no other batch."""
    import torch

    from course_utils.kernels import decode, fast_decode

    rows = {r["L"]: r for r in results.load("pdl_splits")["rows"] if r["B"] == 1 and r["L"] >= 65536}
    assert set(rows) == {65536, 131072} and all(r["lean"] and r["splits"] == 16 for r in rows.values())
    fmt = lambda v: results.value_range(v, ".3f")  # noqa: E731
    at64, at128 = rows[65536]["ratio"], rows[131072]["ratio"]
    assert min(at64["pdl x2"]) > max(at64["course"])  # ahead at 64k; at 128k the two overlap
    readme = speed_text()
    assert f"at 64k ({fmt(at64['pdl x2'])} against {fmt(at64['course'])}," in readme
    assert f"the two level at 128k ({fmt(at128['pdl x2'])} against {fmt(at128['course'])})" in readme
    for batch, context, doubles in ((1, 65536, True), (1, 131072, True), (4, 65536, False), (16, 131072, False)):
        splits = decode.pick_num_splits(batch, 8, 1, context, torch.device("cpu"), 64, sm_count=132)
        assert (fast_decode.pdl_num_splits(batch, 8, 1, context // 64, splits, 132) > splits) is doubles


def test_the_speed_record_quotes_the_forwards_with_the_routes_on_as_recorded():
    """Lesson 11's ladder and a main sweep run with the routes on: the public entries' ratios to cuDNN's bf16."""
    ladder = [s for s in results.load("fp8_bench_routes_h100")["summary"] if s["n"] >= 4096]
    doc = results.load("forward_bench_lesson11_h100_run3")
    assert all(r["status"] == "ok" for r in doc["rows"]) and doc["info"]["gpu"].startswith("NVIDIA H100")
    by = {(r["case"], r["n"], r["provider"]): r["tflops"] for r in doc["rows"]}
    sweep = {(case, p): results.value_range([by[(case, n, p)] / by[(case, n, "sdpa_cudnn")] for n in (4096, 8192, 16384)])
             for case in ("main", "noncausal") for p in ("gluon_bf16", "gluon_fp8")}
    readme = speed_text()
    for quote in (f"at **{results.value_range([s['course_bf16_over_cudnn'] for s in ladder])} cuDNN** at N ≥ 4k",
                  f"at **{results.value_range([s['course_fp8_over_cudnn'] for s in ladder])} cuDNN's bf16** (medians",
                  f"Gluon FP8 {sweep[('main', 'gluon_fp8')]} / {sweep[('noncausal', 'gluon_fp8')]} cuDNN's bf16, Gluon bf16 "
                  f"{sweep[('main', 'gluon_bf16')]} / {sweep[('noncausal', 'gluon_bf16')]}"):
        assert quote in readme, quote


def test_lesson_11_quotes_the_public_entries_with_the_routes_on_as_recorded():
    long = lambda n: n >= 4096  # noqa: E731
    cudnn, flash = _training("sdpa_cudnn", long), _training("sdpa_flash", long)
    ladder = [s for s in results.load("fp8_bench_routes_h100")["summary"] if s["n"] >= 4096]
    quote = (f"**{results.value_range(cudnn)} cuDNN's** forward + backward at N ≥ 4k ({sum(v >= 0.9 for v in cudnn)} "
             f"of the {len(cudnn)} points at 0.9× or more) and {results.value_range(flash)} SDPA flash. This lesson's "
             f"ladder, run again with the switches on (`results/fp8_bench_routes_h100.json`), read "
             f"{results.value_range([s['course_bf16_over_cudnn'] for s in ladder])} cuDNN for the public bf16 entry and "
             f"{results.value_range([s['course_fp8_over_cudnn'] for s in ladder])} cuDNN's bf16 for the FP8 entry")
    assert quote in markdown_text("11_hopper_and_fp8"), quote


def test_the_speed_record_quotes_the_host_time_trim_as_measured():
    """The thirty-fifth session's paragraph: the short window step's host time before and after (host_step_h100),
    the Gluon backward's route against lesson 07's pair before and after (route_check_h100), the quick rerun of the
    window grid's shortest points against the grid's two runs, and the fourth training run, each derived again."""
    vr, f = results.value_range, lambda x: f"{x:.2f}×"
    before_call, before, after = (r["us"] for r in results.load("host_step_h100")["runs"][:3])
    assert after["step gluon"] < before["step gluon"] and after["one _descriptor"] < before["one _descriptor"]
    first, second = results.load("route_check_h100")["runs"][:2]
    pairs = [(a, b) for a, b in zip(first["rows"], second["rows"]) if a["mode"] == "training"]
    assert all((a["window_size"], a["n"]) == (b["window_size"], b["n"]) for a, b in pairs) and len(pairs) == 12
    short = {(a["window_size"], a["n"]): (a["on_over_off"], b["on_over_off"]) for a, b in pairs}
    others = [x for a, b in pairs if (a["window_size"], a["n"]) not in ((256, 4096), (1024, 4096))
              for x in (a["on_over_off"], b["on_over_off"])]
    quick = {(q["window_size"], q["n"]): q["course_over_flex"]
             for q in results.load("window_bench_h100_hosttime")["ratios"] if q["mode"] == "training"}
    grid = {p: vs for p, vs in _window_points("training").items() if p[1] == 0}
    cudnn = training_ratios(("training_bench_h100_run4",), "course", "sdpa_cudnn", lambda n: n >= 4096)
    flash = training_ratios(("training_bench_h100_run4",), "course", "sdpa_flash", lambda n: n >= 4096)
    quotes = [
        f"the step's host time fell from {before['step gluon']} µs to {after['step gluon']} µs in one call "
        f"({before_call['step gluon']} µs in an earlier call; lesson 07's route: {before['step lesson07']}–"
        f"{after['step lesson07']} µs)",
        f"at W = 256, 4k **{f(short[(256, 4096)][0])} → {f(short[(256, 4096)][1])}**, at W = 1024, 4k "
        f"**{f(short[(1024, 4096)][0])} → {f(short[(1024, 4096)][1])}**, at every other training point {vr(others)} "
        "in both",
        f"{f(quick[(256, 4096)])} FlexAttention at W = 256, 4k ({vr(grid[(256, 0, 4096)])} in the grid's two runs), "
        f"{f(quick[(256, 8192)])} at 8k ({f(min(grid[(256, 0, 8192)]))}, {f(max(grid[(256, 0, 8192)]))}) and "
        f"**{f(quick[(1024, 4096)])}** at W = 1024, 4k ({f(min(grid[(1024, 0, 4096)]))}, "
        f"{f(max(grid[(1024, 0, 4096)]))}), above the 1.2× target in this run",
        f"{vr(cudnn)} cuDNN at N ≥ 4k ({', '.join(f'{x:.3f}×' for x in cudnn)}), {vr(flash)} SDPA flash",
    ]
    assert quick[(1024, 4096)] >= 1.2 > max(quick[(256, 4096)], quick[(256, 8192)])
    readme = speed_text()
    assert_quoted(readme, quotes)
    lesson = markdown_text("08_sliding_window_and_sinks")
    for quote in (f"from {before['step gluon']} µs to {after['step gluon']} µs",
                  f"`W = 1024` at `N = 4k` from {vr(grid[(1024, 0, 4096)])} to {f(quick[(1024, 4096)])} FlexAttention "
                  "in a quick rerun",
                  f"`W = 256` at `N = 4k` was still the host's ({f(quick[(256, 4096)])})"):
        assert quote in lesson, quote


BOUND_WINDOW = ("window_bench_h100_bound", "window_bench_h100_bound_run2")
BOUND_TRAINING = ("training_bench_h100_run5", "training_bench_h100_run6")
BOUND_DECODE = ("decode_bench_h100_run5", "decode_bench_h100_run6")


def _bound_window(mode: str, names=BOUND_WINDOW) -> dict:
    points = {}
    for name in names:
        doc = results.load(name)
        assert doc["info"]["gpu"].startswith("NVIDIA H100") and len(doc["ratios"]) == 60
        assert all(r["status"] == "ok" for r in doc["rows"] if r["provider"] in ("course", "flex"))
        for q in doc["ratios"]:
            if q["mode"] == mode:
                points.setdefault((q["window_size"], q["sink_size"], q["n"]), []).append(q["course_over_flex"])
    return points


def _training_and_decode(training_names, decode_names):
    """Two training runs' course / cuDNN and course / SDPA flash at N >= 4k; two decode runs' summaries, their
    course / best SDPA ratios, their course / ceiling at B >= 16 and each run's count of points under 1.0x."""
    cudnn = training_ratios(training_names, "course", "sdpa_cudnn", lambda n: n >= 4096)
    flash = training_ratios(training_names, "course", "sdpa_flash", lambda n: n >= 4096)
    decode = [results.load(name)["summary"] for name in decode_names]
    ratios = [s["course_vs_sdpa"] for run in decode for s in run]
    ceiling = [s["course_vs_ceiling"] for run in decode for s in run if s["batch"] >= 16]
    under = [sum(s["course_vs_sdpa"] < 1 for s in run) for run in decode]
    return cudnn, flash, decode, ratios, ceiling, under


def _under(points: dict, target: float) -> tuple[int, int]:
    """(points under ``target`` in one run or both, points under it in both)."""
    return sum(min(v) < target for v in points.values()), sum(max(v) < target for v in points.values())


def test_the_speed_record_quotes_the_bound_launches_as_measured():
    """The thirty-sixth session's paragraph: the short window step's host time with the backward's launches bound
    (host_step_h100's last two runs, one call), the route check again, and the three grids run twice after the
    change (window, training, decode), each figure derived again; lesson 08 quotes the step and the W = 256 point."""
    vr, f = results.value_range, lambda x: f"{x:.2f}×"
    runs = results.load("host_step_h100")["runs"]
    earlier, base, bound = runs[2], runs[3], runs[4]
    assert (base["package"], bound["package"]) == ("4a87a8b", "76bde89")
    b, a = base["us"], bound["us"]
    assert a["step gluon"] < b["step gluon"] and a["hopper_ws_bwd.attention_backward"] < b["hopper_ws_bwd.attention_backward"]
    route = results.load("route_check_h100")["runs"]
    pairs = [(p, q) for p, q in zip(route[1]["rows"], route[2]["rows"]) if p["mode"] == "training"]
    assert all((p["window_size"], p["n"]) == (q["window_size"], q["n"]) for p, q in pairs) and len(pairs) == 12
    now = {(q["window_size"], q["n"]): q["on_over_off"] for _, q in pairs}
    then = {(p["window_size"], p["n"]): p["on_over_off"] for p, _ in pairs}
    others = [v for key, v in now.items() if key not in ((256, 4096), (1024, 4096))]
    train, fwd = _bound_window("training"), _bound_window("forward")
    quick = {(q["window_size"], q["n"]): q["course_over_flex"]
             for q in results.load("window_bench_h100_hosttime")["ratios"] if q["mode"] == "training"}
    cudnn, flash, decode, ratios, ceiling, under = _training_and_decode(BOUND_TRAINING, BOUND_DECODE)
    grid_us = [x["kernel_grid_us"] for x in bound["launches"]]
    run_us = [x["compiled_run_us"] for x in bound["launches"]]
    quotes = [
        f"{min(grid_us):.0f}–{max(grid_us):.0f} µs a launch here against {min(run_us):.0f}–{max(run_us):.0f} µs for the "
        "compiled kernel's own launcher",
        f"the step's host time from {b['step gluon']} µs to {a['step gluon']} µs, and "
        f"`hopper_ws_bwd.attention_backward`'s from {b['hopper_ws_bwd.attention_backward']} to "
        f"{a['hopper_ws_bwd.attention_backward']} µs, in one call; 20 profiled steps make "
        f"{bound['profiled_function_calls_20_steps']} Python calls ({earlier['profiled_function_calls_20_steps']} "
        "after the trim above)",
        f"at W = 256, 4k **{f(then[(256, 4096)])} → {f(now[(256, 4096)])}**, at W = 1024, 4k "
        f"{f(then[(1024, 4096)])} → {f(now[(1024, 4096)])}, at the other training points {vr(others)}",
        f"forward + backward **{vr([v for vs in train.values() for v in vs])}** FlexAttention, under the 1.2× target at "
        f"{_under(train, 1.2)[0]} points in one run or both and {_under(train, 1.2)[1]} in both",
        f"W = 256 without sinks at 4k read **{f(max(train[(256, 0, 4096)]))} and {f(min(train[(256, 0, 4096)]))}** "
        f"({vr(_window_points('training')[(256, 0, 4096)])} in both earlier grids, {f(quick[(256, 4096)])} in the quick "
        f"rerun), at 8k {vr(train[(256, 0, 8192)])}",
        f"The forward: {vr([v for vs in fwd.values() for v in vs])}, under 1.3× at {_under(fwd, 1.3)[0]} points in one "
        f"run or both and {_under(fwd, 1.3)[1]} in both",
        f"training at N ≥ 4k {vr(cudnn)} cuDNN ({', '.join(f'{x:.3f}×' for x in cudnn)}), {vr(flash)} SDPA flash",
        f"decoding {vr(ratios)} the best SDPA backend, under 1.0× at {min(under)}–{max(under)} of the 19 points "
        f"in each run" if min(under) != max(under) else
        f"decoding {vr(ratios)} the best SDPA backend, under 1.0× at {under[0]} of the 19 points in each run",
        f"{100 * min(ceiling):.0f}–{100 * max(ceiling):.0f}% of the read ceiling at B ≥ 16",
    ]
    readme = speed_text()
    assert_quoted(readme, quotes)
    lesson = markdown_text("08_sliding_window_and_sinks")
    times = [x["kernel_grid_us"] / x["compiled_run_us"] for x in bound["launches"]]
    for quote in (f"from {b['step gluon']} µs to {a['step gluon']} µs",
                  f"{min(times):.1f} to {max(times):.1f} times what the compiled kernel's launcher needs",
                  f"`W = 256` at `N = 4k` read {f(min(train[(256, 0, 4096)]))} and {f(max(train[(256, 0, 4096)]))} "
                  "FlexAttention"):
        assert quote in lesson, quote


FWDBOUND_WINDOW = ("window_bench_h100_fwdbound", "window_bench_h100_fwdbound_run2")
FWDBOUND_TRAINING = ("training_bench_h100_run7", "training_bench_h100_run8")
FWDBOUND_DECODE = ("decode_bench_h100_run7", "decode_bench_h100_run8")


def fwdbound_quotes() -> list[str]:
    """The thirty-seventh session's paragraph, each figure derived from results/: the window forward's launch bound
    (host_step_h100's last two runs, one call), the sinks' route check (route_check_h100's fourth run) and the
    three grids run twice after the change."""
    vr, f = results.value_range, lambda x: f"{x:.2f}×"
    runs = results.load("host_step_h100")["runs"]
    base, bound = runs[5], runs[6]
    assert (base["package"], bound["package"]) == ("b2ed599", "d61666e")
    b, a = base["us"], bound["us"]
    launch = {x["kernel"]: x for x in bound["launches"]}["_attn_fwd_fast_window_kernel"]
    sinks = results.load("route_check_h100")["runs"][3]["rows"]
    assert all(r["mode"] == "sinks" and r["status"] == "ok" for r in sinks) and len(sinks) == 8
    by_w = {w: [r["on_over_off"] for r in sinks if r["window_size"] == w] for w in (256, 1024, 4096)}
    agree = sum((r["on_over_off"] > 1) == r["model_picks_gluon"] for r in sinks)
    train, fwd = _bound_window("training", FWDBOUND_WINDOW), _bound_window("forward", FWDBOUND_WINDOW)
    before = _bound_window("training")
    cudnn, flash, decode, ratios, ceiling, under = _training_and_decode(FWDBOUND_TRAINING, FWDBOUND_DECODE)
    below = sorted(1 - s["course_vs_sdpa"] for run in decode for s in run if s["course_vs_sdpa"] < 1)

    def both(key):
        return " and ".join(f(v) for v in train[key])

    # the points the paragraph names in words
    assert {k for k, v in train.items() if min(v) < 1.2} == {(256, 0, 4096), (256, 0, 8192), (1024, 0, 32768),
                                                            (4096, 0, 16384)}
    assert {k for k, v in fwd.items() if min(v) < 1.3} == {(1024, 0, n) for n in (8192, 16384, 32768, 65536)} | {
        (4096, 0, n) for n in (16384, 32768, 65536)} | {(4096, 4, 65536)}
    assert all(sink_walk_fits(1, 8, w, 128, 132) == (w >= 1984) for w in (1983, 1984, 4096))

    return [
        f"`kernel[grid]` {launch['kernel_grid_us']:.0f} µs against {launch['compiled_run_us']:.0f} µs for its launcher",
        f"the forward's host time from {b['forward no grad']} to {a['forward no grad']} µs without grad and from "
        f"{b['forward with grad (gluon route)']} to {a['forward with grad (gluon route)']} µs with it",
        f"the step's from {b['step gluon']} to {a['step gluon']} µs",
        f"the backward alone read {b['gluon: backward alone']} and {a['gluon: backward alone']} µs",
        f"a training step with the Gluon backward at W = 4096 **{vr(by_w[4096])}** as fast as with lesson 07's pair, "
        f"at W = 1024 {vr(by_w[1024])}, at W = 256 {vr(by_w[256])}",
        f"the model's choice agrees with the measurement at {agree} of the {len(sinks)} points",
        f"forward + backward **{vr([v for vs in train.values() for v in vs])}** FlexAttention, under the 1.2× target at "
        f"{_under(train, 1.2)[0]} points in one run or both and {_under(train, 1.2)[1]} in both",
        f"W = 256 without sinks at 4k read {both((256, 0, 4096))} "
        f"({' and '.join(f(v) for v in before[(256, 0, 4096)])} in the two grids before)",
        f"W = 4096 at 4k with 4 sinks {both((4096, 4, 4096))} "
        f"({' and '.join(f(v) for v in before[(4096, 4, 4096)])})",
        f"The forward: {vr([v for vs in fwd.values() for v in vs])}, under 1.3× at {_under(fwd, 1.3)[0]} points in one "
        f"run or both and {_under(fwd, 1.3)[1]} in both",
        f"training at N ≥ 4k {vr(cudnn)} cuDNN ({', '.join(f'{x:.3f}×' for x in cudnn)}), {vr(flash)} SDPA flash",
        f"decoding {vr(ratios)} the best SDPA backend, under 1.0× at "
        + (f"{under[0]}" if min(under) == max(under) else f"{min(under)}–{max(under)}")
        + f" of the 19 points in each run by at most {100 * below[-1]:.1f}%",
        f"{100 * min(ceiling):.0f}–{100 * max(ceiling):.0f}% of the read ceiling at B ≥ 16",
    ]


def test_the_speed_record_quotes_the_bound_window_forward_and_the_sinks_route_as_measured():
    readme = speed_text()
    for quote in fwdbound_quotes():
        assert quote in readme, quote
    sinks = results.load("route_check_h100")["runs"][3]["rows"]
    by_w = {w: results.value_range([r["on_over_off"] for r in sinks if r["window_size"] == w]) for w in (256, 1024, 4096)}
    quote = (f"unsplit Gluon backward ran {by_w[4096]} as fast as one with the split kernels at `W = 4096`, "
             f"{by_w[1024]} at `W = 1024` and {by_w[256]} at `W = 256`")
    assert quote in markdown_text("08_sliding_window_and_sinks"), quote
    w256 = _bound_window("training", FWDBOUND_WINDOW)[(256, 0, 4096)]
    quote = f"two more runs of the grid read {' and '.join(f'{v:.2f}×' for v in sorted(w256))} there"
    assert quote in markdown_text("08_sliding_window_and_sinks"), quote


def test_the_speed_record_quotes_the_thirty_ninth_session_s_h100_runs_as_recorded():
    """The window grid with the persistent Gluon route (merged from three calls), its W = 4096 rerun, the FMA route
    check, and the decode and training runs with B = 1 from 64k on the PDL launch: every quoted number derived."""
    fmt = lambda v: results.value_range(list(v))  # noqa: E731
    grid = results.load("window_bench_h100_persistent")
    ratios = {m: {(r["window_size"], r["sink_size"], r["n"]): r["course_over_flex"] for r in grid["ratios"]
                  if r["mode"] == m} for m in ("forward", "training")}
    assert all(len(v) == 30 for v in ratios.values())
    fwd, train = ratios["forward"], ratios["training"]
    under_fwd = sorted(k for k, v in fwd.items() if v < 1.3)
    assert under_fwd == [(1024, 0, 16384), (1024, 0, 32768), (4096, 0, 65536), (4096, 4, 32768), (4096, 4, 65536)]
    under_before = [sum(r["course_over_flex"] < 1.3 for r in results.load(name)["ratios"] if r["mode"] == "forward")
                    for name in ("window_bench_h100_fwdbound", "window_bench_h100_fwdbound_run2")]
    under_train = sorted(k for k, v in train.items() if v < 1.2)
    assert under_train == [(256, 0, 4096), (1024, 0, 4096), (4096, 0, 32768), (4096, 0, 65536)]
    rerun = {(r["window_size"], r["n"]): r["course_over_flex"] for r in results.load(
        "window_bench_h100_persistent_w4096")["ratios"] if r["mode"] == "training"}
    fma = results.load("route_check_fma_h100")
    assert fma["shipped"]["GLUON_FMA"] is False and all(r["status"] == "ok" for r in fma["rows"])
    plain = [r["on_over_off"] for r in fma["rows"] if r["window_size"] is None]
    windows = [r["on_over_off"] for r in fma["rows"] if r["window_size"] is not None]
    decode = {(s["batch"], s["context"]): s for s in results.load("decode_bench_h100_run9")["summary"]}
    dec = [s["course_vs_sdpa"] for s in decode.values()]
    ceiling = [s["course_vs_ceiling"] for b, _ in decode for s in [decode[(b, _)]] if b >= 16]
    assert all(decode[(1, c)]["num_splits"] == "pdl num_splits=32" for c in (65536, 131072))
    before = [s["course_vs_sdpa"] for name in ("decode_bench_h100_run7", "decode_bench_h100_run8")
              for s in results.load(name)["summary"] if s["batch"] == 1 and s["context"] >= 65536]
    cudnn = training_ratios(("training_bench_h100_run9",), "course", "sdpa_cudnn", lambda n: n >= 4096)
    flash = training_ratios(("training_bench_h100_run9",), "course", "sdpa_flash", lambda n: n >= 4096)
    w4096 = [fwd[(4096, 0, n)] for n in (16384, 32768, 65536)]
    quotes = [
        f"the forward **{fmt(fwd.values())}** FlexAttention, under 1.3× at {len(under_fwd)} of the 30 points",
        f"1.3× at {len(under_fwd)} of the 30 points (W = 1024 without sinks at 16k and 32k, W = 4096 without sinks at "
        f"64k, with 4 sinks at 32k and 64k: {fmt([fwd[k] for k in under_fwd])}), against {under_before[0]} and "
        f"{under_before[1]} in the two grids before",
        f"W = 4096 without sinks from 16k read {', '.join(f'{v:.2f}×' for v in w4096[:2])} and {w4096[2]:.2f}×",
        f"Forward + backward {fmt(train.values())}, under 1.2× at {len(under_train)} points",
        f"(steps paced by the host, {train[(256, 0, 4096)]:.2f}× and {train[(1024, 0, 4096)]:.2f}×)",
        f"at 32k ({train[(4096, 0, 32768)]:.2f}×) and at 64k ({train[(4096, 0, 65536)]:.2f}×; the same point in the "
        f"next call read {rerun[(4096, 65536)]:.2f}×",
        f"the public forward {plain[0]:.3f}× and {plain[1]:.3f}× as fast with it at plain causal 8k and 16k, "
        f"{fmt(windows)} (median {statistics.median(windows):.3f}×) at the {len(windows)} window points",
        f"those two points read {fmt([decode[(1, c)]['course_vs_sdpa'] for c in (65536, 131072)])} the best SDPA "
        f"backend ({fmt(before)} in the runs before)",
        f"the grid {fmt(dec)}, under 1.0× at {sum(v < 1 for v in dec)} of the 19 points by at most "
        f"{1 - min(dec):.1%}",
        f"{results.value_range([100 * v for v in ceiling], '.0f', '%')} of the read ceiling at B ≥ 16",
        f"Training at N ≥ 4k {fmt(cudnn)} cuDNN, {fmt(flash)} SDPA flash",
    ]
    readme = speed_text()
    assert_quoted(readme, quotes)


def test_lesson_11_quotes_the_fma_route_check():
    """Lesson 11's sentence on dispatch.GLUON_FMA: the route check's two plain causal points, as recorded."""
    rows = [r for r in results.load("route_check_fma_h100")["rows"] if r["window_size"] is None]
    assert [r["n"] for r in rows] == [8192, 16384]
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert (f"public forward {rows[0]['on_over_off']:.3f}× and {rows[1]['on_over_off']:.3f}× as fast with the causal "
            "mask at 8k and 16k in the route check") in text


def test_the_speed_record_quotes_the_probes_behind_the_noncausal_persistent_route():
    """dispatch.GLUON_NONCAUSAL_PERSISTENT's evidence: the two H100 forward probes' serial loop without the FMA softmax,
    persistent grid against a program per tile, each beside cuDNN; causal, the persistent grid read less."""
    by = {}
    for name in ("hopper_ws_probe_h100", "hopper_ws_probe_overlap_h100"):
        for r in results.load(name)["rows"]:
            if r.get("mode") == "speed" and "hopper_ws" in r and r["loop"] == "serial" and not r["fma"]:
                by.setdefault((r["causal"], r["n"], bool(r.get("persistent"))), []).append(r["hopper_ws"] / r["cudnn"])
    persistent, per_tile = by[(False, 16384, True)], by[(False, 16384, False)]
    assert len(persistent) == len(per_tile) == 2 and min(persistent) > max(per_tile)
    assert max(by[(True, 16384, True)]) < min(by[(True, 16384, False)])  # causal: the persistent grid read less
    quote = (f"{persistent[0]:.3f}× and {persistent[1]:.3f}× cuDNN against {per_tile[0]:.3f}× and {per_tile[1]:.3f}× "
             "for a program per tile in the two forward probes at 16k")
    assert quote in speed_text(), quote


def _route_rows(*names) -> dict:
    """Over the recorded route checks ``names`` (results/ names, every row timed): (mode, N) -> each run's speed of
    the route against itself off (``on_over_off``), in run order."""
    by = {}
    for name in names:
        for r in results.load(name)["rows"]:
            assert r["status"] == "ok", r
            by.setdefault((r["mode"], r["n"]), []).append(r["on_over_off"])
    return by


def test_lesson_11_quotes_the_fp8_transpose_route_checks():
    """fp8.FAST_TRANSPOSE's evidence (lesson 11, after exercise 4): the two H100 route checks of the FP8 entry with V's
    tiled transpose against torch's copy, each point's range over the two runs; and the persistent grid's check, which
    read under 1.0x at every point (fp8.GLUON_PERSISTENT stays off)."""
    by = _route_rows("route_check_fp8_h100", "route_check_fp8_min4k_h100_run2")
    transpose = {n: results.value_range(by[("fp8transpose", n)]) for n in (4096, 8192, 16384)}
    assert all(len(by[("fp8transpose", n)]) == 2 and min(by[("fp8transpose", n)]) > 1.0 for n in (4096, 8192, 16384))
    quote = (f"ran **{transpose[4096]}** as fast at 4k, {transpose[8192]} at 8k and {transpose[16384]} at 16k as with "
             "torch's copy: at 4k the attention itself is short enough")
    assert quote in " ".join(markdown_text("11_hopper_and_fp8").split()), quote
    persistent = [v for (mode, _), vs in by.items() if mode.startswith("fp8persistent") for v in vs]
    assert len(persistent) == 6 and max(persistent) < 1.0


def test_speed_md_quotes_the_forty_first_session_s_h100_runs_as_recorded():
    """results/SPEED.md's bullet on the H100 runs of the forty-first session: the transpose's route checks, lesson 11's ladder
    with it (two runs) beside the H100's last one, the noise in the second run, the FP8 persistent grid and the bf16
    threshold at 4k, each figure recomputed from results/."""
    rc = _route_rows("route_check_fp8_h100", "route_check_fp8_min4k_h100_run2", "route_check_min4k_h100")
    ladders = [results.load(n)["summary"] for n in ("fp8_bench_transpose_h100", "fp8_bench_transpose_h100_run2")]
    fp8 = lambda keep: [s["course_fp8_over_cudnn"] for run in ladders for s in run if keep(s["n"])]  # noqa: E731
    before = [s["course_fp8_over_cudnn"] for s in results.load("fp8_bench_routes_h100")["summary"] if s["n"] >= 4096]
    noisy = next(s for s in ladders[1] if s["n"] == 16384 and s["causal"])
    persistent = [v for (mode, _), vs in rc.items() if mode.startswith("fp8persistent") for v in vs]
    vr = results.value_range
    quotes = [
        f"made it {vr(rc[('fp8transpose', 4096)])} / {vr(rc[('fp8transpose', 8192)])} / "
        f"{vr(rc[('fp8transpose', 16384)])} as fast at 4k / 8k / 16k in two route checks",
        f"the FP8 entry **{vr(fp8(lambda n: n >= 4096))} cuDNN's bf16** at N ≥ 4k, {vr(fp8(lambda n: n == 16384))} at 16k "
        f"and {vr(fp8(lambda n: n == 4096))} at 4k, where the H100's last ladder",
        f"read {vr(before)}. The runs are noisy: in the second, the public bf16 entry's ratio to cuDNN spanned "
        f"{noisy['course_bf16_over_cudnn_min']:.2f}–{noisy['course_bf16_over_cudnn_max']:.2f}× over its two repeats at "
        "causal 16k",
        f"persistent grid read {vr(persistent)} a program per tile and stays off",
        f"read {vr(rc[('min4k', 4096)], '.3f')} causal and {vr(rc[('min4k_noncausal', 4096)], '.3f')} without the mask "
        "against lesson 06's kernel",
    ]
    text = speed_text()
    for quote in quotes:
        assert " ".join(quote.split()) in text, quote


def test_the_readme_quotes_the_step_state_probe_as_recorded():
    """The README's sentence on benchmarks/step_state.py's H100 run: the W = 256 step fresh, after FlexAttention's
    compile, in a second process, the collector's runs and the host's enqueue time, from results/step_state_h100*.json."""
    rows = results.load("step_state_h100")["rows"] + results.load("step_state_h100_node0")["rows"]
    at = lambda state, skip=0: [r for r in rows if r["state"] == state and r.get("window_size") == 256][skip]  # noqa: E731
    fresh, after, second = at("fresh"), at("after flex"), at("fresh", 1)
    gc_runs = max(max(r["gc_runs_per_step"]) for r in rows if r.get("gc_runs_per_step"))
    host = [r["host_ms"] for r in rows if r.get("window_size") == 256 and r.get("host_ms")]
    vr = lambda v: results.value_range(v, unit="")  # noqa: E731
    quote = (f"the step read {vr(fresh['do_bench_ms'])} ms fresh and {vr(after['do_bench_ms'])} ms after "
             f"FlexAttention's compile in one process, the collector ran in at most {round(gc_runs * 100)} of 100 "
             f"steps, and a second process read {vr(second['do_bench_ms'])} ms (the host has one NUMA node). The host's "
             f"time to enqueue the step moved with it ({vr(host)} ms)")
    assert quote in readme_text(), quote


def test_lesson_11_quotes_the_threshold_s_route_checks_at_4k_as_recorded():
    """Lesson 11's sentence on ``dispatch.GLUON_MIN_N = 4096``: the public forward at 4k with the Gluon route against
    lesson 06's kernel, causal and not, over the four H100 route checks that timed it."""
    rc = _route_rows("route_check_fp8_min4k_h100_run2", "route_check_min4k_h100", "route_check_min4k_h100_run3",
                     "route_check_h100_min4k")
    vr = results.value_range
    assert len(rc[("min4k", 4096)]) == len(rc[("min4k_noncausal", 4096)]) == 4
    quote = (f"at 4k the public forward read {vr(rc[('min4k', 4096)])} as fast with the causal mask and "
             f"{vr(rc[('min4k_noncausal', 4096)])} without it with this route in four route checks on the H100")
    assert quote in " ".join(markdown_text("11_hopper_and_fp8").split()), quote


def test_lesson_11_quotes_the_window_at_4k_that_keeps_its_own_threshold_as_recorded():
    """Lesson 11's reason for ``dispatch.GLUON_WINDOW_MIN_N``: the window forward at W = 1024 without sinks, 4k, in the
    two H100 grids with the window's route from 4k against the five grids before it (H100 and H200)."""
    def ms(names):
        return [r["ms"] for name in names for r in results.load(name)["rows"]
                if r["provider"] == "course" and r["mode"] == "forward" and r["window_size"] == 1024
                and r["sink_size"] == 0 and r["n"] == 4096]

    after = ms(["window_bench_h100_min4k", "window_bench_h100_min4k_run2"])
    before = ms(["window_bench_h100_persistent", "window_bench_h100_run2", "window_bench_h200", "window_bench_h200_run2",
                 "window_bench_h200_run3"])
    assert len(after) == 2 and len(before) == 5 and min(after) > max(before)
    vr = results.value_range
    quote = (f"the forward at W = 1024 without sinks, N = 4k read {vr(after, '.2f', ' ms')}, where lesson 08's kernel "
             f"had read {vr(before, '.2f', ' ms')} in the five grids before")
    assert quote in " ".join(markdown_text("11_hopper_and_fp8").split()), quote


MIN4K_WINDOW_CHECKS = ("route_check_min4k_h100_run4", "route_check_min4k_window_h100_run2",
                      "route_check_min4k_window_h100_run3")


def _min4k_window_rows():
    """The three H100 route checks of the window at 4k (``min4k_window``): (W, S) -> their rows, in run order."""
    by = {}
    for name in MIN4K_WINDOW_CHECKS:
        for r in results.load(name)["rows"]:
            if r["mode"] == "min4k_window":
                assert r["status"] == "ok" and r["n"] == 4096, r
                by.setdefault((r["window_size"], r["sink_size"]), []).append(r)
    assert sorted(by) == [(1024, 0), (1024, 4), (4096, 0), (4096, 4)] and all(len(v) == 3 for v in by.values())
    return by


def test_lesson_11_quotes_the_window_s_route_checks_at_4k_as_recorded():
    """Lesson 11's reason the window keeps ``dispatch.GLUON_WINDOW_MIN_N = 8192``: the three route checks of the
    window at 4k, the route behind at W = 1024 without sinks in one of them and ahead at every other point."""
    by = _min4k_window_rows()
    doubt = by[(1024, 0)]
    others = [r["on_over_off"] for key, rows in by.items() if key != (1024, 0) for r in rows]
    behind = sum(r["on_over_off"] < 1.0 for r in doubt)
    assert behind == 1 and min(others) > 1.0  # the sentence's "behind once, ahead twice" and "ahead elsewhere"
    vr = results.value_range
    quote = (f"at W = 1024 without sinks the route read {vr([r['on_over_off'] for r in doubt])} (behind once, ahead "
             f"twice), at the other three points (W = 1024 with 4 sinks, W = 4096 with and without) {vr(others)}. The "
             f"point in doubt is a call of {vr([r[k] for r in doubt for k in ('on_ms', 'off_ms')], '.2f', ' ms')} "
             "(the route checks' readings)")
    assert quote in " ".join(markdown_text("11_hopper_and_fp8").split()), quote
    from course_utils.kernels import dispatch

    assert dispatch.GLUON_WINDOW_MIN_N == 8192 and all(
        results.load(name)["shipped"]["GLUON_WINDOW_MIN_N"] == 8192 for name in MIN4K_WINDOW_CHECKS)


def test_speed_md_quotes_the_forty_third_session_s_window_checks_as_recorded():
    """results/SPEED.md's bullet on the forty-third session: the three route checks of the window at 4k, the window bench at
    4k with the window's threshold at 4096 and at 8192 (course / FlexAttention, forward), and the plain forward at 4k
    in the first check, recomputed from results/."""
    by = _min4k_window_rows()
    doubt = [r["on_over_off"] for r in by[(1024, 0)]]
    others = [r["on_over_off"] for key, rows in by.items() if key != (1024, 0) for r in rows]
    bench = {t: [r["course_over_flex"] for r in results.load(f"window_bench_4k_window_min_n_{t}_h100")["ratios"]
                 if r["mode"] == "forward" and r["n"] == 4096] for t in (4096, 8192)}
    assert len(bench[4096]) == len(bench[8192]) == 4
    plain = {r["mode"]: r["on_over_off"] for r in results.load(MIN4K_WINDOW_CHECKS[0])["rows"]}
    vr = results.value_range
    quotes = [f"at W = 1024 without sinks the route read {vr(doubt)}, at the other three points {vr(others)}",
              f"read the forward at {vr(bench[4096])} FlexAttention with it and {vr(bench[8192])} without",
              f"timed plain attention at 4k too: {plain['min4k']:.3f}× with the causal mask, "
              f"{plain['min4k_noncausal']:.3f}× without"]
    text = speed_text()
    for quote in quotes:
        assert quote in text, quote


def test_speed_md_quotes_the_forty_second_session_s_h100_runs_as_recorded():
    """results/SPEED.md's bullet on the forty-second session: the four route checks of the Gluon forward at 4k, then the
    training bench, lesson 11's ladder and the decode grid, two runs each, recomputed from results/."""
    routes = _route_rows("route_check_min4k_h100", "route_check_fp8_min4k_h100_run2", "route_check_min4k_h100_run3",
                         "route_check_h100_min4k")
    rc = {mode: routes[(mode, 4096)] for mode in ("min4k", "min4k_noncausal")}
    assert len(rc["min4k"]) == len(rc["min4k_noncausal"]) == 4
    runs = ["training_bench_h100_min4k", "training_bench_h100_min4k_run2"]
    cudnn = training_ratios(runs, "course", n=lambda n: n >= 4096)
    flash = training_ratios(runs, "course", "sdpa_flash", n=lambda n: n >= 4096)
    first_4k = training_ratios(runs[:1], "course", n=lambda n: n == 4096)
    under = [r for r in cudnn if r < 0.9]
    ladders = [results.load(n)["summary"] for n in ("fp8_bench_gluon_h100_min4k", "fp8_bench_gluon_h100_min4k_run2")]
    entry = lambda key: [s[key] for run in ladders for s in run if s["n"] >= 4096]  # noqa: E731
    decode = decode_points(["decode_bench_h100_min4k", "decode_bench_h100_min4k_run2"])
    unders = {sum(v[i]["course_vs_sdpa"] < 1.0 for v in decode.values()) for i in range(2)}
    ceiling = [s["course_vs_ceiling"] * 100 for (b, _), v in decode.items() if b >= 16 for s in v]
    vr = results.value_range
    assert len(unders) == 1 and len(under) == 1 and under == first_4k and len(cudnn) == 6
    quotes = [
        f"read it {vr(rc['min4k'], '.3f')} lesson 06's kernel with the causal mask and "
        f"{vr(rc['min4k_noncausal'], '.3f')} without it",
        f"**{vr(cudnn)} cuDNN** at N ≥ 4k, under 0.9× at one of the six points ({under[0]:.3f}×, N = 4k in the "
        f"first run), and **{vr(flash)} SDPA flash**",
        f"the FP8 entry **{vr(entry('course_fp8_over_cudnn'))} cuDNN's bf16** at N ≥ 4k, the bf16 entry "
        f"**{vr(entry('course_bf16_over_cudnn'))}**",
        f"**{vr([s['course_vs_sdpa'] for v in decode.values() for s in v])}** the best SDPA backend, under 1.0× at "
        f"{unders.pop()} of the {len(decode)} points in each run, and {vr(ceiling, '.0f', '%')} of the read ceiling at "
        "B ≥ 16",
    ]
    text = speed_text()
    for quote in quotes:
        assert " ".join(quote.split()) in text, quote


def test_speed_md_quotes_the_forty_fourth_session_s_ladder_as_recorded():
    """results/SPEED.md's bullet on the forty-fourth session: lesson 11's ladder with the entries as they ship (the
    FP8 entry's tiled transpose, the Gluon forwards from 4k), its per-point medians recomputed from results/."""
    summary = results.load("fp8_bench_gluon_h100_min4k_run3")["summary"]
    assert len(summary) == 10 and results.load("fp8_bench_gluon_h100_min4k_run3")["info"]["gpu"].endswith("H100 80GB HBM3")
    entry = lambda key, keep: [s[key] for s in summary if keep(s["n"])]  # noqa: E731
    vr = results.value_range
    at_4k = entry("course_fp8_over_cudnn", lambda n: n == 4096)
    assert len(at_4k) == 2 and len({f"{v:.2f}" for v in at_4k}) == 1  # "causal and not": one figure for both
    quote = (f"the FP8 entry **{vr(entry('course_fp8_over_cudnn', lambda n: n >= 4096))} cuDNN's bf16** at N ≥ 4k "
             f"({at_4k[0]:.2f}× at 4k, causal and not), the bf16 entry "
             f"**{vr(entry('course_bf16_over_cudnn', lambda n: n >= 4096))}**")
    assert quote in speed_text(), quote


def test_the_readme_leaves_the_h100_sessions_to_speed_md():
    """The README's speed section shows the H200's runs the targets name; the H100 sessions after them are a section
    of results/SPEED.md, which the README points to by its title, and none of their bullets stay in the README."""
    title = "After the H200's runs, on an H100"
    assert f"## {title} (forty-first to fiftieth sessions)" in speed_text()
    text = readme_text()
    assert f'[results/SPEED.md](results/SPEED.md) ("{title}")' in text
    for bullet in ("forty-first session", "forty-second session, on an H100", "forty-third session, on an H100"):
        assert bullet not in text and bullet in speed_text(), bullet


def test_notes_quote_the_forty_sixth_session_s_softmax_a_b_as_recorded():
    """results/NOTES.md's section on the two softmax changes timed against the kernels before them
    (benchmarks/gluon_ab.py), and GPU_VALIDATION.md's line on the run: every ratio they quote, recomputed from
    results/gluon_ab_h100.json; and SPEED.md's bullet and lesson 11's paragraph on it."""
    doc = results.load("gluon_ab_h100")
    rows = doc["rows"]
    assert doc["info"]["gpu"].endswith("H100 80GB HBM3") and all(r["status"] == "ok" for r in rows)
    assert sorted((r["kind"], r["n"], r["causal"]) for r in rows) == sorted(
        (kind, n, causal) for kind in ("fp8", "bf16") for n in (4096, 8192, 16384) for causal in (True, False))
    vr = results.value_range
    pick = lambda kind, f: [f(r) for r in rows if r["kind"] == kind]  # noqa: E731
    porder = lambda r: r["base_ms"] / r["porder_ms"]  # noqa: E731
    tree = pick("fp8", lambda r: r["current_over_porder"])
    assert sum(t < 1 for t in tree) == 5
    notes = " ".join((REPO / "results" / "NOTES.md").read_text().split())
    assert_quoted(notes, [
        f"Speed: **{vr(pick('fp8', porder))} the kernel before** (FP8); the same bf16 kernel, unchanged, read "
        f"{vr(pick('bf16', porder))} itself",
        f"Speed: **{vr(tree)} the kernel without it** (FP8, five of six points slower) and "
        f"**{vr(pick('bf16', lambda r: r['current_over_porder']))}** (bf16)",
        f"the kernels as shipped read {vr(pick('fp8', lambda r: r['base_over_cudnn']))} cuDNN's bf16 (FP8, the kernel "
        f"alone, without V's copy) and {vr(pick('bf16', lambda r: r['base_over_cudnn']))} (bf16)"])
    log = " ".join((REPO / "results" / "GPU_VALIDATION.md").read_text().split())
    assert (f"the first change **{vr(pick('fp8', porder))}** the kernel before (FP8), the trees **{vr(tree)}** (FP8) "
            f"and **{vr(pick('bf16', lambda r: r['current_over_porder']))}** (bf16)") in log
    assert (f"in its registers' order read {vr(pick('fp8', porder))} the kernel before, the row max and sum as trees "
            f"{vr(tree)} (FP8) and {vr(pick('bf16', lambda r: r['current_over_porder']))} (bf16)") in speed_text()
    assert_quoted(markdown_text("11_hopper_and_fp8"), [
        f"it read **{vr(pick('fp8', porder))}** the kernel before",
        f"**{vr(tree)}** in FP8, {vr(pick('bf16', lambda r: r['current_over_porder']))} in bf16"])


def test_notes_quote_the_forty_eighth_session_s_walks_as_recorded():
    """results/NOTES.md's paragraph on the walks timed once on an H100 (benchmarks/gluon_ab.py --orders, and the
    backward's kind): every ratio it quotes, recomputed from results/gluon_ab_walk_h100.json."""
    doc = results.load("gluon_ab_walk_h100")
    rows = doc["rows"]
    assert doc["info"]["gpu"].endswith("H100 80GB HBM3") and all(r["status"] == "ok" for r in rows)

    def pick(kind, key, causal=None):
        return [r[key] for r in sorted(rows, key=lambda r: r["n"]) if r["kind"] == kind
                and (causal is None or r["causal"] == causal)]

    each = lambda values: ", ".join(f"{v:.3f}x" for v in values)  # noqa: E731
    span = lambda values: f"{min(values):.3f}x-{max(values):.3f}x"  # noqa: E731
    notes = " ".join((REPO / "results" / "NOTES.md").read_text().split())
    assert_quoted(notes, [
        f"the bf16 route without the mask (the persistent grid) {each(pick('bf16', 'grouped_over_current', False))} "
        "at 4k, 8k, 16k",
        f"the Gluon backward {each(pick('bwd', 'grouped_over_current', True))} with the causal mask and "
        f"{each(pick('bwd', 'grouped_over_current', False))} without",
        f"the FP8 entry's persistent grid walked so {span(pick('fp8', 'persistent_grouped_over_current'))} of its "
        f"program-per-tile route (its default walk {span(pick('fp8', 'persistent_over_current'))})",
        f"The program-per-tile forward walked so read {span(pick('fp8', 'grouped_over_current'))} (FP8) and "
        f"{span(pick('bf16', 'grouped_over_current', True))} (bf16, causal)",
        f"FP8's wide tiles read {span(pick('fp8', 'wide_over_current'))} the 128-key tiles (two slots) and "
        f"{span(pick('fp8', 'wide3_over_current'))} with three"])


def test_the_walks_routes_quote_their_route_checks_as_recorded():
    """dispatch.GLUON_WALK_KV_HEADS and fast_backward.GLUON_WALK_ROWS were switched on from two H100 route checks
    (results/route_check_walk_h100{,_run2}.json): every reading results/NOTES.md and the two switches' comments quote,
    recomputed; every walked output and gradient equal to the default walk's; and the switches as the checks left them
    (on, at the rows the checks timed)."""
    from course_utils.kernels import dispatch, fast_backward

    runs = [results.load(name) for name in ("route_check_walk_h100", "route_check_walk_h100_run2")]
    for doc in runs:
        assert doc["info"]["gpu"].endswith("H100 80GB HBM3") and doc["shipped"]["GLUON_WALK_KV_HEADS"] is False
        assert all(r["status"] == "ok" and r["rel_diff"] == 0 for r in doc["rows"])

    def each(run, mode):
        rows = sorted((r for r in run["rows"] if r["mode"] == mode), key=lambda r: r["n"])
        assert [r["n"] for r in rows] == [4096, 8192, 16384]
        return ", ".join(f"{r['on_over_off']:.3f}x" for r in rows)

    fwd, causal, plain = ([each(run, mode) for run in runs] for mode in ("walk", "walkbwd", "walkbwd_noncausal"))
    notes = " ".join((REPO / "results" / "NOTES.md").read_text().split())
    assert_quoted(notes, [
        f"The forward without the mask walked a kv head at a time read {fwd[0]} and {fwd[1]} at 4k, 8k, 16k",
        f"four rows, {causal[0]} and {causal[1]} with the causal mask, {plain[0]} and {plain[1]} without"])
    slash = lambda text: text.replace(", ", " / ")  # noqa: E731  (the comments' form)
    for module, quote in ((dispatch, f"{slash(fwd[0])} and {slash(fwd[1])} faster with it at 4k / 8k / 16k"),
                          (fast_backward, f"{slash(causal[0])} and {slash(causal[1])} causal, {slash(plain[0])} "
                                          f"and {slash(plain[1])} not")):
        source = " ".join(" ".join(line.strip().lstrip("#").split()) for line in
                          open(module.__file__).read().splitlines() if line.strip().startswith("#"))
        assert quote in source, (module.__name__, quote)
    # with the forty-eighth session's A/B: three readings of each point
    ab = {(r["kind"], r["causal"], r["n"]): r["grouped_over_current"]
          for r in results.load("gluon_ab_walk_h100")["rows"] if r["kind"] in ("bf16", "bwd")}
    three = {(mode, n): [ab[(kind, causal, n)]] + [r["on_over_off"] for run in runs for r in run["rows"]
                                                   if (r["mode"], r["n"]) == (mode, n)]
             for mode, kind, causal in (("walk", "bf16", False), ("walkbwd", "bwd", True),
                                        ("walkbwd_noncausal", "bwd", False)) for n in (4096, 8192, 16384)}
    assert all(len(v) == 3 for v in three.values())
    assert min(v for (mode, _), vs in three.items() if mode == "walk" for v in vs) > 1.01
    span = lambda values: f"{min(values):.3f}x-{max(values):.3f}x"  # noqa: E731
    others = [v for (mode, n), vs in three.items() if mode != "walk" and (mode, n) != ("walkbwd", 4096) for v in vs]
    assert_quoted(notes, [f"the forward's all above 1.01x, the backward's causal 4k point (where the load model puts "
                          f"the last SM 13% past the mean) {span(three[('walkbwd', 4096)])}, its other points "
                          f"{span(others)}", "none read under 0.98x"])
    assert min(v for vs in three.values() for v in vs) >= 0.98
    # lesson 11 ("The backward in Gluon"): the two route checks' ranges
    checked = {key: vs[1:] for key, vs in three.items()}
    vr = lambda values: results.value_range(values, ".3f")  # noqa: E731
    rest = [v for (mode, n), vs in checked.items() if mode != "walk" and (mode, n) != ("walkbwd", 4096) for v in vs]
    lesson = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert_quoted(lesson, [
        f"timed the training step with that walk at **{vr(checked[('walkbwd', 4096)])}** the step without it at "
        f"causal 4k, and {vr(rest)} at 8k, 16k and without the mask",
        f"read {vr([v for (mode, _), vs in checked.items() if mode == 'walk' for v in vs])} in the same checks"])
    assert dispatch.GLUON_WALK_KV_HEADS is True
    assert fast_backward.GLUON_WALK_ROWS == 4  # route_check.WALK_ROWS (tests/test_tune_scripts.py)


WALK_GRIDS = dict(ladder=("fp8_bench_gluon_h100_walk", "fp8_bench_gluon_h100_walk_run2"),
                  train=("training_bench_h100_walk", "training_bench_h100_walk_run2"),
                  window=("window_bench_h100_walk", "window_bench_h100_walk_run2"),
                  decode=("decode_bench_h100_walk", "decode_bench_h100_walk_run2"))


def _window_ms(name, mode, provider, window_size, sink_size=0, n=4096) -> float:
    """One timed row of a recorded window grid: ``provider``'s ms at that point."""
    (row,) = [r for r in results.load(name)["rows"] if r.get("mode") == mode and r["provider"] == provider
              and r.get("window_size") == window_size and r.get("sink_size") == sink_size and r.get("n") == n]
    assert row["status"] == "ok"
    return row["ms"]


def test_the_fiftieth_session_s_grids_are_quoted_as_recorded():
    """results/SPEED.md's bullet on the fiftieth session and results/NOTES.md's section on it: the grids run with both
    walks on by default, twice on one H100, every ratio and time they quote recomputed from the JSON."""
    vr, grids = results.value_range, WALK_GRIDS
    for names in grids.values():
        assert all(results.load(name)["info"]["gpu"].endswith("H100 80GB HBM3") for name in names)
    summary = [s for name in grids["ladder"] for s in results.load(name)["summary"]]
    assert len(summary) == 20 and all(r["status"] == "ok" for name in grids["ladder"]
                                      for r in results.load(name)["rows"])
    entry = lambda key, keep: vr([s[f"{key}_over_cudnn"] for s in summary if keep(s)])  # noqa: E731
    train = lambda other: vr(training_ratios(grids["train"], "course", other, lambda n: n >= 4096))  # noqa: E731
    dec = [[s["course_vs_sdpa"] for s in results.load(name)["summary"]] for name in grids["decode"]]
    assert [len(d) for d in dec] == [19, 19]
    ceiling = [100 * s["course_vs_ceiling"] for name in grids["decode"] for s in results.load(name)["summary"]
               if s["batch"] >= 16]
    ratios = {mode: [{(r["window_size"], r["sink_size"], r["n"]): r["course_over_flex"]
                      for r in results.load(name)["ratios"] if r["mode"] == mode} for name in grids["window"]]
              for mode in ("forward", "training")}
    under_fwd = [sorted(k for k, v in run.items() if v < 1.3) for run in ratios["forward"]]
    under_train = [sorted(k for k, v in run.items() if v < 1.2) for run in ratios["training"]]
    assert under_fwd == [[(4096, 0, 65536), (4096, 4, 65536)]] * 2
    assert under_train[0] == [(256, 0, 4096), (1024, 0, 4096)]
    assert under_train[1] == [(256, 0, 4096), (256, 4, 4096), (1024, 0, 4096), (4096, 0, 16384), (4096, 0, 32768)]
    every = lambda mode: vr([v for run in ratios[mode] for v in run.values()])  # noqa: E731
    assert_quoted(speed_text(), [
        f"**{train('sdpa_cudnn')} cuDNN** at N ≥ 4k and **{train('sdpa_flash')} SDPA flash**",
        f"the FP8 entry **{entry('course_fp8', lambda s: s['n'] >= 4096)} cuDNN's bf16** at N ≥ 4k "
        f"({entry('course_fp8', lambda s: s['n'] == 4096)} at",
        f"4k), the bf16 entry **{entry('course_bf16', lambda s: s['n'] >= 4096)}** "
        f"({entry('course_bf16', lambda s: s['n'] == 4096 and s['causal'])} causal at 4k, "
        f"{entry('course_bf16', lambda s: s['n'] == 8192 and not s['causal'])} without the mask at 8k)",
        f"**{vr(dec[0] + dec[1])}** the best SDPA backend, under 1.0× at {sum(v < 1 for v in dec[0])} of the 19",
        f"points in each run (by at most {1 - min(dec[0] + dec[1]):.1%}), and {vr(ceiling, '.0f', '%')} of the read "
        f"ceiling at B ≥ 16",
        f"the forward **{every('forward')}** FlexAttention, under 1.3× only at W = 4096",
        f"forward + backward **{every('training')}**, under 1.2× at {len(under_train[0])} and {len(under_train[1])} "
        f"of the 30"])
    assert sum(v < 1 for v in dec[1]) == sum(v < 1 for v in dec[0])
    x = lambda text: text.replace("×", "x").replace("–", "x-")  # noqa: E731  (NOTES.md writes 1.40x-1.42x)
    lowest_16k = min(s["course_fp8_over_cudnn"] for s in summary if s["n"] == 16384)
    bf16_over = [s for s in summary if s["course_bf16_over_cudnn"] >= 1.0 and s["n"] >= 4096]
    assert bf16_over and all(s["n"] == 16384 and not s["causal"] for s in bf16_over)
    assert min(training_ratios(grids["train"], "course", "sdpa_cudnn", lambda n: n >= 4096)) > 0.9
    ms = lambda name, provider, w, s=0, mode="training": f"{_window_ms(name, mode, provider, w, s):.3f}"  # noqa: E731
    run1, run2 = grids["window"]
    earlier = [n for n in ("window_bench_h100", "window_bench_h100_run2", "window_bench_h100_bound",
                           "window_bench_h100_bound_run2", "window_bench_h100_fwdbound",
                           "window_bench_h100_fwdbound_run2", "window_bench_h100_hosttime", "window_bench_h100_min4k",
                           "window_bench_h100_min4k_run2", "window_bench_h100_persistent")]
    assert len(earlier) == 10  # "the ten earlier H100 grids": every one with that point (persistent_w4096 has not)
    def before(provider):
        """``provider``'s step at W = 256 (plain causal: no window), N = 4k, over the earlier grids, as NOTES
        writes it."""
        window_size = None if provider == "causal" else 256
        return vr([_window_ms(n, "training", provider, window_size) for n in earlier], ".3f", " ms").replace("–", "-")

    forwards = [_window_ms(name, "forward", p, w, s) for name in grids["window"]
                for p, w, s in (("causal", None, 0), ("course", 4096, 0), ("course", 4096, 4))]
    notes = " ".join((REPO / "results" / "NOTES.md").read_text().split())
    assert_quoted(notes, [
        f"the FP8 entry read {x(entry('course_fp8', lambda s: s['n'] == 16384))} cuDNN's bf16 at 16k (its lowest "
        f"reading {lowest_16k:.4f}x), {x(entry('course_fp8', lambda s: s['n'] == 8192))} at 8k and "
        f"{x(entry('course_fp8', lambda s: s['n'] == 4096))} at 4k",
        f"the bf16 entry read 1.0x or more only at 16k without the mask "
        f"({x(entry('course_bf16', lambda s: s['n'] == 16384 and not s['causal']))}) and was furthest under it at "
        f"causal 4k ({x(entry('course_bf16', lambda s: s['n'] == 4096 and s['causal']))})",
        f"the step took {ms(run1, 'course', 4096)} ms and {ms(run2, 'course', 4096)} ms ({ms(run1, 'course', 4096, 4)} "
        f"and {ms(run2, 'course', 4096, 4)} with 4 sinks) where plain causal attention took {ms(run1, 'causal', None)} "
        f"and {ms(run2, 'causal', None)} ms in the same runs",
        f"The forwards alone read the same ({vr(forwards, '.3f', ' ms').replace('–', '-')})",
        f"W = 256 without sinks read {ms(run1, 'course', 256)} and {ms(run2, 'course', 256)} ms "
        f"({ratios['training'][0][(256, 0, 4096)]:.2f}x FlexAttention in both runs), where the ten earlier H100 grids "
        f"read {before('course')}; FlexAttention's step there read {ms(run1, 'flex', 256)} and "
        f"{ms(run2, 'flex', 256)} ms, against {before('flex')} before",
        f"the plain causal step, which the kernels pace, read {ms(run1, 'causal', None)} and "
        f"{ms(run2, 'causal', None)} ms, against {before('causal')} before the walks",
        "(1.28x-1.30x here)"])
    assert f"{ratios['training'][1][(256, 0, 4096)]:.2f}" == f"{ratios['training'][0][(256, 0, 4096)]:.2f}"
    w4096 = sorted(run[(4096, s, 65536)] for run in ratios["forward"] for s in (0, 4))
    assert f"{w4096[0]:.2f}x-{w4096[-1]:.2f}x" == "1.28x-1.30x"


def test_the_causal_walk_s_switch_quotes_its_kernel_a_b():
    """dispatch.GLUON_WALK_CAUSAL's comment: the forty-eighth session's kernel A/B of the program-per-tile walk (bf16,
    causal; results/gluon_ab_walk_h100.json), as NOTES.md quotes it; the switch off until a route check times it."""
    from course_utils.kernels import dispatch

    rows = [r for r in results.load("gluon_ab_walk_h100")["rows"] if r["kind"] == "bf16" and r["causal"]]
    assert sorted(r["n"] for r in rows) == [4096, 8192, 16384] and all(r["status"] == "ok" for r in rows)
    span = f"{min(r['grouped_over_current'] for r in rows):.3f}x-{max(r['grouped_over_current'] for r in rows):.3f}x"
    source = " ".join(" ".join(line.strip().lstrip("#").split()) for line in
                      open(dispatch.__file__).read().splitlines() if line.strip().startswith("#"))
    assert f"results/gluon_ab_walk_h100.json: {span} bf16)" in source
    notes = " ".join((REPO / "results" / "NOTES.md").read_text().split())
    assert f"and {span} (bf16, causal)" in notes
    assert dispatch.GLUON_WALK_CAUSAL is False


def test_the_fp8_walk_s_switch_quotes_its_kernel_a_b():
    """fp8.GLUON_WALK's comment: the forty-eighth session's kernel A/B of the FP8 program per tile walked a kv head
    at a time (results/gluon_ab_walk_h100.json), each point as recorded; the switch off until a route check."""
    from course_utils.kernels import fp8

    rows = {(r["causal"], r["n"]): r for r in results.load("gluon_ab_walk_h100")["rows"] if r["kind"] == "fp8"}
    assert all(r["status"] == "ok" for r in rows.values())
    each = lambda causal: " / ".join(f"{rows[(causal, n)]['grouped_over_current']:.3f}x"  # noqa: E731
                                     for n in (4096, 8192, 16384))
    source = " ".join(" ".join(line.strip().lstrip("#").split()) for line in
                      open(fp8.__file__).read().splitlines() if line.strip().startswith("#"))
    assert f"read {each(True)} causal and {each(False)} without the mask at 4k / 8k / 16k" in source
    plain = [rows[(False, n)]["grouped_over_current"] for n in (4096, 8192, 16384)]
    notes = " ".join((REPO / "results" / "NOTES.md").read_text().split())
    assert (f"its program per tile walked so read {min(plain):.3f}x-{max(plain):.3f}x without the mask and "
            f"{each(True).replace(' / ', ', ')} with it at 4k, 8k, 16k") in notes
    assert fp8.GLUON_WALK is False
