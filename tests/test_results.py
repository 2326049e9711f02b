"""The lessons' recorded figures come from results/*.json (issue 22).

`course_utils.results` renders the recorded tables; here every figure the lessons' prose quotes
from a benchmark is derived again from the JSON and compared at the precision written, and the
stored outputs of the cells that show a recorded table must be what the helper renders now.
"""

import contextlib
import io
import re
import statistics
from pathlib import Path

import nbformat
import pytest

from course_utils import results

from conftest import markdown_text, readme_text, speed_text

SOLUTIONS = Path(__file__).resolve().parent.parent / "solutions"
ROOT = SOLUTIONS.parent
TABLES = ["window_bench", "decode_bench", "decode_variants", "ring_bench", "ring_blocks", "training_bench", "tune_backward", "tune_window",
          "tune_window_fast"]
NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?(?:–[0-9][0-9,]*(?:\.[0-9]+)?)?)([×%]?)"

# (lesson, the quoting text with {} for the figure, benchmark, column, stat, which rows)
W08, W09, W10, W07 = "08_sliding_window_and_sinks", "09_decoding", "10_ring_attention", "07_backward"
FWD, TRN = dict(mode="forward"), dict(mode="training")
QUOTES = [
    (W08, "the forward runs at **{} FlexAttention", "window_bench", "course_over_flex", "range", FWD),
    (W08, "FlexAttention** (median {})", "window_bench", "course_over_flex", "median", FWD),
    (W08, "at `W = 4096` ({})", "window_bench", "course_over_flex", "range", dict(FWD, W=4096)),
    (W08, "where the course reaches {} TFLOP/s from `N = 8k`", "window_bench", "course_tflops", "range",
     dict(FWD, W=256, N=lambda n: n >= 8192)),
    (W08, "ms with 4 sinks against {} ms without**", "window_bench", "course_ms", "value", dict(TRN, W=1024, S=0, N=32768)),
    (W08, "the tuned launch: **{} ms with 4 sinks", "window_bench", "course_ms", "value", dict(TRN, W=1024, S=4, N=32768)),
    (W08, "without**, {} FlexAttention at `N = 32k`", "window_bench", "course_over_flex", "value",
     dict(TRN, W=1024, S=4, N=32768)),
    (W08, "`N` ≥ 8k: {} at `W = 1024`", "window_bench", "course_over_flex", "range",
     dict(TRN, W=1024, S=4, N=lambda n: n >= 8192)),
    (W08, "{} at `W = 256` (FlexAttention's", "window_bench", "course_over_flex", "range",
     dict(TRN, W=256, S=4, N=lambda n: n >= 8192)),
    (W08, "and {} at `W = 4096`; at", "window_bench", "course_over_flex", "range",
     dict(TRN, W=4096, S=4, N=lambda n: n >= 8192)),
    (W08, "at `N = 4k`, {}.", "window_bench", "course_over_flex", "range", dict(TRN, S=4, N=4096)),
    (W08, "stays near FlexAttention's speed: {} at `W = 4096`", "window_bench", "course_over_flex", "range",
     dict(TRN, W=4096, S=0)),
    (W08, "and at `W = 256` {} at the two shortest", "window_bench", "course_over_flex", "range",
     dict(TRN, W=256, S=0, N=lambda n: n <= 8192)),
    (W08, "The old launch ran at {} FlexAttention's forward speed", "tune_window", "before_over_flex", "range", FWD),
    (W08, "FlexAttention's forward speed, the fastest at {}.", "tune_window", "best_over_flex", "range", FWD),
    (W08, "the machinery alone took the forward from {} FlexAttention", "tune_window_fast", "lesson_over_flex",
     "range", {}),
    (W08, "FlexAttention to {} at `W = 256`", "tune_window_fast", "shipped_over_flex", "range", dict(W=256)),
    (W08, "at `W = 256` and to {} above", "tune_window_fast", "shipped_over_flex", "range", dict(W=(1024, 4096))),
    (W09, "read only {} of the read ceiling", "decode_splits", "of_ceiling", "range", dict(B=64, splits=1, stages=3)),
    (W09, "and reads {} of the ceiling there", "decode_bench", "course_over_ceiling", "range", dict(B=64)),
    (W09, "course reads at {} the best SDPA backend", "decode_bench", "course_over_sdpa", "range", dict(B=1)),
    (W09, "at `B = 1`, {} over the whole sweep", "decode_bench", "course_over_sdpa", "range", {}),
    (W09, "those points read {} the best SDPA backend", "decode_bench", "course_over_sdpa", "range",
     dict(splits="lean")),
    (W09, "costs something: {} the contiguous", "decode_bench", "paged_over_contiguous", "range",
     dict(B=lambda b: b <= 16)),
    (W09, "the two are about level, {})", "decode_bench", "paged_over_contiguous", "range", dict(B=64)),
    (W09, "splits that cache in {})", "decode_bench", "splits", "value", dict(B=1, context=16384)),
    (W09, "programs, 396 at once) read {} of the ceiling", "decode_splits", "of_ceiling", "range",
     dict(B=64, splits=1, stages=3)),
    (W09, "It read {} cuDNN against the course's", "decode_variants", "tma_over_cudnn", "range", {}),
    (W09, "against the course's {} on the same points", "decode_variants", "course_over_cudnn", "range", {}),
    (W09, "from a 64k context ({} for both)", "decode_variants", "tma_over_cudnn", "range", dict(context=lambda n: n >= 65536)),
    (W09, "from a 64k context ({} for both)", "decode_variants", "course_over_cudnn", "range", dict(context=lambda n: n >= 65536)),
    (W09, "behind them at short contexts ({} against", "decode_variants", "tma_over_cudnn", "range", dict(B=1, context=1024)),
    (W09, "against {} at `B = 1`, 1k)", "decode_variants", "course_over_cudnn", "range", dict(B=1, context=1024)),
    (W09, "At `B = 4` it read {} cuDNN", "decode_variants", "fused_over_cudnn", "range", dict(B=4)),
    (W09, "cuDNN (the course {}); at", "decode_variants", "course_over_cudnn", "range", dict(B=4)),
    (W09, "contexts it lost, {} against", "decode_variants", "fused_over_cudnn", "range", dict(B=1, context=(4096, 16384))),
    (W09, "against {}, which we have not explained", "decode_variants", "course_over_cudnn", "range",
     dict(B=1, context=(4096, 16384))),
    (W09, "(the course {} in this run, fused", "decode_variants", "course_over_cudnn", "range", dict(B=1, context=1024)),
    (W09, "in this run, fused {})", "decode_variants", "fused_over_cudnn", "range", dict(B=1, context=1024)),
    (W09, "1k–4k contexts (the course {}, fused", "decode_variants", "course_over_cudnn", "range", dict(B=16, context=(1024, 4096))),
    (W09, "1k–4k contexts (the course 0.99×, fused {})", "decode_variants", "fused_over_cudnn", "range",
     dict(B=16, context=(1024, 4096))),
    (W10, "the ring ran at {} one GPU", "ring_bench", "ring_over_one_gpu", "range", {}),
    (W10, "and at {} PyTorch's context parallel", "ring_bench", "ring_over_torch_cp", "range", {}),
    (W10, "with their merges run at {} cuDNN's speed", "ring_blocks", "course_over_fwd", "range", dict(provider="cudnn")),
    (W10, "cuDNN's speed and {} SDPA flash's", "ring_blocks", "course_over_fwd", "range", dict(provider="flash")),
    (W10, "backward blocks run at {} cuDNN's", "ring_blocks", "course_over_bwd", "range", dict(provider="cudnn")),
    (W10, "The merges are {} of the course's forward", "ring_blocks", "merge_share", "range", dict(provider="course")),
    (W07, "The course takes {} ms", "training_bench", "course_ms", "range", {}),
    (W07, "ms: {} faster than SDPA's flash", "training_bench", "course_over_flash", "range", {}),
    (W07, "flash backend and {} of cuDNN's", "training_bench", "course_over_cudnn", "range", {}),
    (W07, "the fastest such kernel took {} ms", "tune_backward", "bwd_ms", "value",
     dict(run=3, N=4096, layout="atomic")),
    (W07, "against the pair's {} ms", "tune_backward", "bwd_ms", "value",
     dict(run=3, N=4096, layout="lesson 07 (two kernels)")),
    (W07, "The fastest such launch took {} ms at `N = 4096`", "tune_backward", "bwd_ms", "value",
     dict(run=4, N=4096, layout="pair")),
    (W07, "against {} ms for this lesson's in the same run", "tune_backward", "bwd_ms", "value",
     dict(run=4, N=4096, layout="lesson 07 (two kernels)")),
    (W07, "and at `N = 16384` {} against", "tune_backward", "bwd_ms", "value", dict(run=4, N=16384, layout="pair")),
    (W07, "against {} ms: the backward's kernels", "tune_backward", "bwd_ms", "value",
     dict(run=4, N=16384, layout="lesson 07 (two kernels)")),
]


def _benchmark(name):
    """``benchmarks/<name>.py`` as a module (the tuning scripts' candidate lists)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numbers(text: str) -> list[float]:
    return [float(x.replace(",", "")) for x in text.split("–")]


def _decimals(text: str) -> int:
    return len(text.split("–")[-1].partition(".")[2])


def problems(text: str, quote) -> list[str]:
    """What is wrong with one quoted figure in ``text``: missing, or not what the JSON holds."""
    lesson, template, name, key, stat, where = quote
    before, after = (re.escape(re.sub(r"\s+", " ", part)) for part in template.split("{}"))
    found = re.findall(before + NUMBER + after, text)
    if not found:
        return [f"{lesson}: no text matching {template!r}"]
    unit = results._column(name, key)[3]
    values = [r[key] for r in results.rows(name, **where) if r[key] is not None]
    out = []
    for number, quoted_unit in found:
        if quoted_unit and quoted_unit != unit:
            out.append(f"{lesson}: {template!r} quotes {number}{quoted_unit}, the column's unit is {unit!r}")
        digits = _decimals(number)
        if stat == "range":
            want = [min(values), max(values)]
        elif stat == "median":
            want = [statistics.median(values)]
        else:
            assert len(values) == 1, (quote, values)
            want = values
        want = [round(v, digits) for v in want]
        got = _numbers(number)
        if len(got) == 1 and len(want) == 2 and want[0] == want[1]:
            want = want[:1]
        if got != want:
            shown = "–".join(f"{v:.{digits}f}" for v in want)
            out.append(f"{lesson}: {template!r} quotes {number}{quoted_unit}; {name}.json gives {shown}{unit}")
    return out


@pytest.mark.parametrize("name", TABLES)
def test_helper_renders_each_recorded_table(name):
    text = results.markdown(name)
    lines = text.splitlines()
    assert lines[0].startswith("Recorded on ") and f"results/{name}.json" in lines[0]
    body = [line for line in lines[4:] if line.startswith("| ")]
    assert len(body) == len(results.rows(name)) > 0
    assert "None" not in text and "nan" not in text
    assert results.table(name) == text  # outside a notebook the string comes back


def test_missing_results_raise_one_sentence():
    with pytest.raises(FileNotFoundError, match="no recorded nothing_here.json"):
        results.load("nothing_here")


def test_figure_formats_as_the_lessons_write():
    ratios = [r["course_over_flex"] for r in results.load("window_bench")["ratios"] if r["mode"] == "forward"]
    assert results.figure("window_bench", "course_over_flex", mode="forward") == \
        f"{min(ratios):.2f}–{max(ratios):.2f}×"  # two decimals, an en dash, the unit once
    assert results.figure("window_bench", "course_over_flex", "median", mode="forward") == \
        f"{statistics.median(ratios):.2f}×"
    percent = [r["course_over_ceiling"] for r in results.rows("decode_bench", B=64)]
    lo, hi = f"{min(percent):.0f}", f"{max(percent):.0f}"
    assert results.figure("decode_bench", "course_over_ceiling", B=64) == (lo if lo == hi else f"{lo}–{hi}") + "%"


@pytest.mark.parametrize("quote", QUOTES, ids=[f"{q[0][:2]}:{q[1][:30]}" for q in QUOTES])
def test_quoted_figure_is_recorded(quote):
    assert problems(markdown_text(quote[0]), quote) == []


def test_a_changed_figure_fails():
    """The check above is not vacuous: a figure edited (in memory) to one the JSON lacks is caught."""
    quote = QUOTES[0]
    text = markdown_text(quote[0])
    right = results.figure(*quote[2:4], quote[4], **quote[5])
    assert right in text
    low = right.split("–")[0]
    wrong = text.replace(right, right.replace(low, f"{float(low) + 0.01:.2f}", 1), 1)
    assert problems(wrong, quote) and f"window_bench.json gives {right}" in problems(wrong, quote)[0]
    assert problems(text.replace(right, "0.9–1.1×", 1), quote)  # a coarser but wrong rounding too


def test_forward_figures_quoted_in_lessons_06_and_09():
    forward = results.load("forward_bench")
    tflops, gbps = forward["ceilings"]["matmul_tflops"], forward["ceilings"]["copy_gbps"]
    assert f"{tflops:.0f} TFLOP/s of bf16 matrix products and {gbps:.0f} GB/s" in markdown_text("09_decoding")
    ridge = round(tflops * 1e3 / gbps / 5) * 5  # quoted to the nearest 5
    assert f"about {ridge} FLOPs per byte" in markdown_text("09_decoding")
    quick = {r["n"]: r["tflops"] for r in results.load("forward_bench_quick")["rows"] if r["provider"] == "compiled"}
    assert f"{quick[1024]:.0f} TFLOP/s at N = 1024 and {quick[4096]:.0f} at N = 4096" in markdown_text("06_performance")
    steps = {(s["n"], s["step"]): s["tflops"] for s in forward["ladder"]["steps"]}
    both = [steps[(n, "+ TMA descriptors")] / steps[(n, "+ exp2, folded scale")] - 1 for n in (4096, 16384)]
    assert "together they gained " + " / ".join(f"+{100 * x:.0f}%" for x in both) in markdown_text("06_performance")


def _table_cells():
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and ".table(" in cell.source and "recorded" in cell.source:
                yield pytest.param(cell, id=f"{path.stem}[{i}]")


@pytest.mark.parametrize("cell", list(_table_cells()))
def test_stored_table_outputs_are_current(cell, monkeypatch):
    """A cell showing a recorded table was executed against today's JSON (no stale 'no run yet')."""
    rendered = []
    monkeypatch.setattr(results, "table", lambda *a, **k: rendered.append(results.markdown(*a, **k)))
    with contextlib.redirect_stdout(io.StringIO()):
        exec(cell.source, {"DEVICE": "cpu", "ON_GPU": False})
    stored = [o["data"]["text/markdown"] for o in cell.outputs if "text/markdown" in o.get("data", {})]
    assert stored == rendered


def test_lesson_09_quotes_the_split_sweep_s_worst_pick():
    """Lesson 09: 'at each of its seven points the pick reads at least 99% of the best count's GB/s'."""
    points = results.load("decode_splits")["points"]
    worst = min(p["pick_over_best"] for p in points)
    text = markdown_text(W09)
    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    assert f"at each of its {words[len(points)]} points the pick reads at least {int(worst * 100)}%" in text


def test_lesson_08_reads_the_short_window_steps_as_launch_bound():
    """results/host_overhead.json, both runs: at N = 4k, W = 256 the course's kernels take less time than the host
    needs to launch the step, and about 1/1.3 of FlexAttention's kernels; the sinks' step went from 15 launches
    to 6 (one kernel adds the partials) and its time fell. Lesson 08 says so."""
    runs = results.load("host_overhead")["runs"]
    ratios = []
    for run in runs:
        by = {(r["case"], r["provider"]): r for r in run["rows"]}
        course, flex = by[("W=256 S=0 N=4k", "course")], by[("W=256 S=0 N=4k", "flex")]
        assert course["kernels_ms"] < course["host_ms"] and course["kernels_ms"] < 0.4
        ratios.append(flex["kernels_ms"] / course["kernels_ms"])
    assert all(f"{r:.1f}" == "1.3" for r in ratios)
    before, after = (next(r for r in run["rows"] if (r["case"], r["provider"]) == ("W=1024 S=4 N=4k", "course"))
                     for run in (runs[0], runs[-1]))
    assert (before["launches"], after["launches"]) == (15, 6) and after["gpu_ms"] < before["gpu_ms"]
    text = markdown_text(W08)
    assert "the kernels alone were 1.3× faster than FlexAttention's in both of that file's runs" in text
    assert "the partials used to be added by ten small torch operations" in text
    # the table's own run: W = 256 without sinks, forward + backward, at the two shortest sequences
    at = {n: results.figure("window_bench", "course_over_flex", "value", mode="training", W=256, S=0, N=n)
          for n in (4096, 8192)}
    assert f"({at[4096]} at `N = 4k` and {at[8192]} at `8k` in this table's run, while the kernels alone" in text


def test_lesson_07_counts_the_backward_s_time_from_the_recorded_profile():
    """Lesson 07's 'Where the backward's time goes': every figure derived from results/ncu_backward.json (the
    kernels in launch order: preprocess, dK/dV, dQ; cuDNN's largest kernel is its backward proper)."""
    p = results.load("ncu_backward")["providers"]
    pre, dkdv, dq = p["course"]["kernels"]
    assert [k["kernel_name"] for k in (pre, dkdv, dq)] == ["attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"]
    cudnn = max(p["sdpa_cudnn"]["kernels"], key=lambda k: k["duration_us"])
    total, cudnn_total = p["course"]["total_us"], p["sdpa_cudnn"]["total_us"]
    needed = (cudnn_total / 0.9 - pre["duration_us"]) / 7  # the pair's 7 products at 0.9x cuDNN's time
    quotes = [
        f"kernels took **{total:.0f} µs**: dK/dV {dkdv['duration_us']:.0f} µs "
        f"({100 * dkdv['duration_us'] / total:.0f}%), dQ {dq['duration_us']:.0f} µs, the `delta` preprocess "
        f"{pre['duration_us']:.0f} µs",
        f"took **{cudnn_total:.0f} µs**, {cudnn['duration_us']:.0f} of them in one kernel",
        f"{dkdv['tensor_pipe_pct']:.1f}% of the active cycles in the dK/dV kernel, {dq['tensor_pipe_pct']:.1f}% in "
        f"the dQ kernel, {cudnn['tensor_pipe_pct']:.1f}% in cuDNN's",
        f"**{dkdv['duration_us'] / 4:.0f} µs per product** in the dK/dV kernel, **{dq['duration_us'] / 3:.0f}** in "
        f"the dQ kernel, **{cudnn['duration_us'] / 5:.0f}** in cuDNN's",
        f"dK and dV for 128 keys in {dkdv['registers_per_thread']:.0f} registers",
        f"({dkdv['achieved_occupancy_pct']:.1f}% of the warps resident, against {dq['achieved_occupancy_pct']:.1f}% "
        f"for the {dq['registers_per_thread']:.0f}-register dQ kernel)",
        f"would take {needed:.0f} µs per product, {100 * (1 - needed / (cudnn['duration_us'] / 5)):.0f}% less than "
        f"cuDNN's own kernel",
    ]
    text = markdown_text(W07)
    for quote in quotes:
        assert quote in text, f"lesson 07 should quote the recorded profile: {quote!r}"
    assert dq["duration_us"] / 3 < cudnn["duration_us"] / 5 < dkdv["duration_us"] / 4, \
        "the lesson says the dQ kernel is faster per product than cuDNN's and the dK/dV kernel slower"
    readme = speed_text()
    for quote in (f"({dkdv['tensor_pipe_pct']:.1f}% in dK/dV, {dq['tensor_pipe_pct']:.1f}% in dQ, "
                  f"{cudnn['tensor_pipe_pct']:.1f}% in cuDNN's backward kernel)",
                  f"{dkdv['duration_us'] / 4:.0f} µs per product in dK/dV, {dq['duration_us'] / 3:.0f} in dQ, "
                  f"{cudnn['duration_us'] / 5:.0f} in cuDNN's kernel",
                  f"would need {needed:.0f} µs per product"):
        assert quote in readme, f"results/SPEED.md should quote the recorded profile: {quote!r}"


def test_the_speed_record_quotes_the_decode_variants_from_the_recorded_run():
    """results/SPEED.md's sentence on the two decode rewrites: each range is the recorded one, over every point and round,
    and neither variant reached cuDNN in any round at B = 1 or at B = 16 with 1k-4k contexts."""
    readme = speed_text()
    fig = {key: results.figure("decode_variants", f"{key}_over_cudnn") for key in ("course", "tma", "fused")}
    assert (f"descriptors read {fig['tma']} cuDNN and the combine fused into the split kernel {fig['fused']}, "
            f"against the course's {fig['course']} in the same run; neither reached cuDNN at B = 1 or at B = 16 "
            "with 1k–4k contexts") in readme
    date = results.load("decode_variants")["info"]["date"]
    assert f"`benchmarks/tune_decode_variants.py`, {date}, two rounds" in readme
    there = results.rows("decode_variants", B=1) + results.rows("decode_variants", B=16, context=(1024, 4096))
    assert there and max(max(r["tma_over_cudnn"], r["fused_over_cudnn"]) for r in there) < 1.0


def test_the_short_window_reruns_are_quoted_as_recorded():
    """results/window_short_calls.json (two reruns of lesson 08's shortest points after short forwards went to pointer
    loads): lesson 08 and results/SPEED.md quote its forward ratio at W = 256, N = 4k without sinks over both runs, the
    results/SPEED.md also the other forward points and forward + backward without sinks; each run's ratios are its rows'."""
    doc = results.load("window_short_calls")
    assert len(doc["runs"]) == 2
    for run in doc["runs"]:
        ms = {(r["mode"], r["window_size"], r["sink_size"], r["n"], r["provider"]): r["ms"] for r in run["rows"]}
        for r in run["ratios"]:
            point = (r["mode"], r["window_size"], r["sink_size"], r["n"])
            assert r["course_over_flex"] == ms[point + ("flex",)] / ms[point + ("course",)]

    def span(keep):
        values = [r["course_over_flex"] for run in doc["runs"] for r in run["ratios"] if keep(r)]
        return f"{min(values):.2f}–{max(values):.2f}×"

    def short(r):
        return (r["window_size"], r["sink_size"], r["n"]) == (256, 0, 4096)

    fwd = span(lambda r: r["mode"] == "forward" and short(r))
    others = span(lambda r: r["mode"] == "forward" and not short(r))
    training = span(lambda r: r["mode"] == "training" and r["sink_size"] == 0)
    assert f"the shortest points read **{fwd} FlexAttention at that one**" in markdown_text(W08)
    readme = speed_text()
    assert f"**{fwd}** FlexAttention's forward at W = 256, N = 4k without sinks, and {others} at the other" in readme
    assert f"forward + backward there stayed host-bound ({training} without sinks)" in readme


def test_the_speed_record_quotes_both_decode_runs_and_the_lean_points():
    """results/SPEED.md's decode sentence: the shipped run's and the second run's ranges over the grid, how many points
    read below the best SDPA backend in each, and the lean schedule's points (context >= 64k) in both runs."""
    readme = speed_text()
    runs = [results.load("decode_bench")["summary"], results.load("decode_bench_run2")["summary"]]

    def span(values):
        return f"{min(values):.2f}–{max(values):.2f}×"

    ratios = [[s["course_vs_sdpa"] for s in run] for run in runs]
    assert f"{span(ratios[0])} the best SDPA backend in the shipped run, {span(ratios[1])} in the second" in readme
    below = [sum(r < 1 for r in run) for run in ratios]
    assert f"below it at {below[0]} and {below[1]} of the {len(ratios[0])} points" in readme
    lean = [s["course_vs_sdpa"] for run in runs for s in run if str(s["num_splits"]) == "lean"]
    assert {s["context"] for run in runs for s in run if str(s["num_splits"]) == "lean"} == {65536, 131072}
    assert len(lean) == 14 and f"those seven points read {span(lean)} cuDNN in both runs" in readme


def test_lesson_11_quotes_the_programmatic_dependent_launch_probe():
    """results/pdl_probe.json: decode at B = 1 and 1k with and without PDL (ratios to cuDNN over two rounds), the
    change at every other decode point, and the backward's dQ-behind-dK/dV launch against the plain launches."""
    doc = results.load("pdl_probe")
    first = next(r for r in doc["decode"] if (r["B"], r["L"]) == (1, 1024))
    plain, pdl = (first["ratios"][k] for k in ("course", "pdl_trigger"))
    others = [change for r in doc["decode"] if (r["B"], r["L"]) != (1, 1024)
              for change in (max(r["pdl_trigger"]) / max(r["course"]) - 1, min(r["pdl_trigger"]) / min(r["course"]) - 1)]
    backward = [x for r in doc["backward"] for x in r["speedup_vs_course"]["pdl"]]
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert (f"read {min(pdl):.3f}–{max(pdl):.3f}× cuDNN against {min(plain):.3f}–{max(plain):.3f}× for the plain "
            "launches") in text
    assert f"the change was {min(others):+.1%} to {max(others):+.1%}".replace("+-", "-") in text
    assert f"the pair ran at {min(backward):.2f}–{max(backward):.2f}× the plain launches' speed" in text
    assert min(backward) < 1 < max(backward)  # "does not" pay: the spread straddles the plain launches


def _span(values) -> str:
    """``lo–hi`` at two decimals (one number when they round alike), as the lessons write a range of ratios."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return lo if lo == hi else f"{lo}–{hi}"


def test_lesson_09_quotes_the_pdl_split_sweep():
    """results/pdl_splits.json at B = 1 and 1k: the plain launch of lesson 09's count and the PDL launch of twice it
    (ratios to the better cuDNN round), cuDNN's spread between the rounds, and the recorded run's ratio there."""
    text = " ".join(markdown_text("09_decoding").split())
    row = next(r for r in results.load("pdl_splits")["rows"] if (r["B"], r["L"]) == (1, 1024))

    cudnn = row["gbps"]["cudnn"]
    recorded = next(s for s in results.load("decode_bench")["summary"] if (s["batch"], s["context"]) == (1, 1024))
    assert recorded["num_splits"] == "pdl num_splits=8" and row["splits"] == 4
    assert (f"the plain launch of 4 splits read {_span(row['ratio']['course'])}× cuDNN there and this one "
            f"{_span(row['ratio']['pdl x2'])}× (`results/pdl_splits.json`), and the recorded run reads "
            f"{recorded['course_vs_sdpa']:.2f}×") in text
    assert f"moved by {round(100 * (max(cudnn) / min(cudnn) - 1))}% between the sweep's two rounds" in text


def test_lesson_11_quotes_the_pdl_split_sweep():
    """Lesson 11's PDL section: B = 1 and 1k, twice lesson 09's splits with the PDL merge against the plain launch."""
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    row = next(r for r in results.load("pdl_splits")["rows"] if (r["B"], r["L"]) == (1, 1024))

    assert (f"{2 * row['splits']} splits instead of {row['splits']} read {_span(row['ratio']['pdl x2'])}× cuDNN "
            f"against {_span(row['ratio']['course'])}× for the plain launch of {row['splits']}") in text


def test_lesson_11_quotes_the_warp_specialised_compiles():
    """results/sm90_compiles.json (compiled here with the H200's triton 3.6): the 4-warp warp-specialised loop is 12
    warps with the consumers' registers raised by setmaxnreg and nothing spilled; the 8-warp one changed nothing
    (tune_fast.json: the same registers and shared memory, and the same time within about 1%)."""
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    doc = results.load("sm90_compiles")
    fast = results.load("tune_fast")
    assert doc["info"]["triton"] == fast["env"]["triton"]
    ws = [r for r in doc["ws_forward"] if r["warp_specialize"]]
    assert ws and all(r["warps"] == 12 and r["spills"] == 0 for r in ws)
    raised = {int(v) for r in ws for op, v in r["setmaxnreg"] if op == "inc" and int(v) < 256}
    assert len(raised) == 1
    assert (f"a producer partition and **two consumer warpgroups of {ws[0]['block_m'] // 2} query rows each**, "
            f"{ws[0]['warps']} warps, the consumers' registers raised to {raised.pop()} by `setmaxnreg`, no spills") in text
    rows = {(r["n"], r["name"]): r for r in fast["rows"]}
    for n in (4096, 16384):
        plain, spec = rows[n, "128x128 w8 s3 kv-grouped"], rows[n, "128x128 w8 s3+ws kv-grouped"]
        assert plain["info"] == spec["info"] and abs(spec["tflops"] / plain["tflops"] - 1) < 0.015
    regs, kib = re.fullmatch(r"regs (\d+), spills 0, smem (\d+) KiB", plain["info"]).groups()
    assert f"where it changed nothing (the same {regs} registers and {kib} KiB, and the same time within about 1%)" in text


def test_the_backward_spills_notes_quotes_are_the_recorded_compiles():
    """NOTES' twenty-sixth-session figures for lesson 07's and 08's dK/dV kernels come from results/sm90_compiles.json,
    which covers every launch tune_backward.py --pair and tune_window.py --backward time."""
    doc = results.load("sm90_compiles")
    pair = {(tuple(r["config"]), r["kernel"]): r for r in doc["backward_pair"]}
    window = {(r["window_size"], tuple(r["config"]), r["kernel"]): r for r in doc["window_backward"]}
    tune_backward = _benchmark("tune_backward")
    assert {c for c, _ in pair} == set(tune_backward.PAIR)
    shipped = pair[(64, 128, 128, 32, 8, 3, 8, 3), "_attn_bwd_dkdv"]
    assert shipped["spills"] == 40 and pair[(64, 128, 128, 32, 8, 3, 8, 3), "_attn_bwd_dq"]["registers"] == 125
    notes = " ".join((ROOT / "results" / "NOTES.md").read_text().split())
    assert f"spills at its shipped Hopper launch (64 x 128, 8 warps, 3 stages: {shipped['spills']})" in notes
    assert pair[(64, 64, 64, 64, 4, 2, 4, 2), "_attn_bwd_dkdv"]["spills"] == 96
    assert pair[(32, 128, 128, 32, 4, 2, 8, 3), "_attn_bwd_dkdv"]["spills"] == 210
    unspilled = {(16, 64, 128, 32, 4, 2, 8, 3): 253, (32, 128, 128, 32, 8, 3, 8, 3): 245,
                 (16, 128, 128, 32, 8, 3, 8, 3): 218, (32, 64, 128, 32, 8, 3, 8, 3): 238}
    for c, regs in unspilled.items():
        r = pair[c, "_attn_bwd_dkdv"]
        assert r["spills"] == 0 and r["registers"] == regs, (c, r)
    assert window[1024, (32, 64, 64, 32, 4, 3, 4, 3), "_attn_bwd_dkdv_window"]["spills"] == 98
    assert window[4096, (64, 128, 128, 64, 8, 3, 8, 3), "_attn_bwd_dkdv_window"]["spills"] == 144
    assert all(r["spills"] == 0 for (w, c, kernel), r in window.items() if kernel == "attn_bwd_dq_window")


def test_the_flat_backward_figures_are_the_recorded_compiles():
    """fast_backward's and tune_backward.py's figures for the flat mode's dK/dV kernel (sm_90, triton 3.6): no spills
    at the launches quoted, 12 warps warp-specialised, every FLAT launch recorded causal and not."""
    from course_utils.kernels import fast_backward as fb

    doc = results.load("sm90_compiles")
    dkdv_rows = [r for r in doc["flat_backward"] if r["kernel"] == "_attn_bwd_dkdv_flat"]
    flat = {(r["config"], r["causal"]): r for r in dkdv_rows if r["window_size"] is None}
    windowed = [r for r in dkdv_rows if r["window_size"] is not None]
    tune_window = _benchmark("tune_window")
    assert sorted(r["config"] for r in windowed) == sorted(
        fb.FastBackwardConfig(*c).short() for c in tune_window.FLAT_BACKWARD_CANDIDATES)
    window_text = " ".join((ROOT / "benchmarks" / "tune_window.py").read_text().split())
    assert all(r["spills"] == 0 and r["window_size"] == 1024 for r in doc["flat_backward"] if r["window_size"])
    assert "Compiled for sm_90 with triton 3.6 at W = 1024, none spills" in window_text
    tune_backward = _benchmark("tune_backward")
    configs = [fb.FastBackwardConfig(*c) for c in tune_backward.FLAT]
    assert {k for k in flat} == {(c.short(), causal) for c in configs for causal in (True, False)}
    for c in configs:
        for causal in (True, False):
            r = flat[c.short(), causal]
            assert r["warps"] == (12 if c.warp_specialize and c.num_warps == 4 else c.num_warps), r
    tune_text = " ".join((ROOT / "benchmarks" / "tune_backward.py").read_text().split())
    wide, narrow = flat["flat dkdv 64x128 w8 s3 dq 128x32", True], flat["flat dkdv 32x128 w8 s2 dq 128x32", True]
    assert wide["spills"] == narrow["spills"] == 0
    assert (f"none spills: 64 x 128 on 8 warps {wide['registers']} registers (lesson 07's dK/dV kernel spills # "
            f"40 at the same launch), 32 x 128 on 8 warps {narrow['registers']}") in tune_text
    ws = flat["flat dkdv 32x128 w4 s2 ws dq 128x32", True]
    assert ws["spills"] == 0 and ws["warps"] == 12 and f"12 warps of {ws['registers']} registers" in tune_text
    # the default is the unspecialised 32 x 128 launch (the specialised ones deadlock on the H200), as its comment says
    assert fb.FLAT_DEFAULT.short() == "flat dkdv 32x128 w8 s2 dq 128x32" and narrow["registers"] == 209
    fb_text = " ".join(line.lstrip("# ") for line in (ROOT / "course_utils" / "kernels" / "fast_backward.py")
                       .read_text().splitlines())
    assert f"32 x 128 on 8 warps, not specialised ({narrow['registers']} registers, no spills" in fb_text
    # flat_dq: the dQ kernel of every such launch recorded (with and without the window), specialised where asked
    dq_rows = [r for r in doc["flat_backward"] if r["kernel"] == "_attn_bwd_dq_flat"]
    plain = [c for c in configs if c.flat_dq]  # recorded causal and not
    with_window = [c for c in map(lambda c: fb.FastBackwardConfig(*c), tune_window.FLAT_BACKWARD_CANDIDATES)
                   if c.flat_dq]  # recorded at W = 1024
    flat_dq = plain + with_window
    assert len(dq_rows) == 2 * len(plain) + len(with_window) and plain and with_window
    for r in dq_rows:
        c = next(c for c in flat_dq if c.short() == r["config"])
        assert r["spills"] == 0 and r["warps"] == (12 if c.warp_specialize and c.num_warps == 4 else c.num_warps), r
    ws_dq = {(r["config"].split(" dq ")[1].split()[0], r["registers"]) for r in dq_rows if r["warps"] == 12}
    assert {size for size, _ in ws_dq} == {"128x32", "128x64"} and {regs for _, regs in ws_dq} == {168}
    assert ("the dQ kernel is # 12 warps of 168 registers and no spills at 128 x 32 and 128 x 64 "
            "(results/sm90_compiles.json's flat_backward)") in tune_text


def test_the_warp_specialised_fp8_launches_are_the_recorded_compiles():
    """tune_fp8.py --hopper --ws's launches as its comment and lesson 11 say (sm_90, triton 3.6): every specialised one
    12 warps of 168 registers raised to 232 by setmaxnreg, no spills; hopper_config's launch recorded beside them."""
    import argparse

    rows = results.load("sm90_compiles")["fp8_ws"]
    tune_fp8 = _benchmark("tune_fp8")
    options = argparse.Namespace(maxnreg=False, exp_poly=False, exp_f16=False, ws=True)
    for d in (128, 64):
        for causal in (True, False):
            want = [(c["BLOCK_M"], c["BLOCK_N"], c["num_stages"], bool(c.get("WARP_SPECIALIZE")))
                    for c in tune_fp8.hopper_candidates(options, d, causal)]
            got = [(r["block_m"], r["block_n"], r["num_stages"], r["warp_specialize"]) for r in rows
                   if (r["head_dim"], r["causal"]) == (d, causal)]
            assert got == want and not want[0][3] and all(w[3] for w in want[1:])
    ws = [r for r in rows if r["warp_specialize"]]
    raised = {int(v) for r in ws for op, v in r["setmaxnreg"] if op == "inc" and int(v) < 256}
    assert all(r["warps"] == 12 and r["spills"] == 0 and r["registers"] == 168 for r in ws) and raised == {232}
    tune_text = " ".join((ROOT / "benchmarks" / "tune_fp8.py").read_text().split())
    assert "each makes 12 warps of 168 registers raised to 232 by setmaxnreg, with no spills" in tune_text
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert ("the FP8 loop becomes the same producer and two consumers, 12 warps, no spills "
            "(`results/sm90_compiles.json`'s `fp8_ws`)") in text


def test_lesson_07_quotes_its_kernels_spills_from_the_recorded_compile():
    """Lesson 07's two-layouts section: its dQ kernel's registers and its dK/dV kernel's spills at the Hopper launch,
    from results/sm90_compiles.json (the launch default_config picks on Hopper for bf16, D = 128)."""
    import torch

    from course_utils.kernels.backward import default_config

    cfg = default_config(128, "cuda", (9, 0), torch.bfloat16)
    launch = (cfg.dkdv_block_m, cfg.dkdv_block_n, cfg.dq_block_m, cfg.dq_block_n,
              cfg.dkdv_warps, cfg.dkdv_stages, cfg.dq_warps, cfg.dq_stages)
    pair = {(tuple(r["config"]), r["kernel"]): r for r in results.load("sm90_compiles")["backward_pair"]}
    dkdv, dq = pair[launch, "_attn_bwd_dkdv"], pair[launch, "_attn_bwd_dq"]
    text = " ".join(markdown_text("07_backward").split())
    assert dq["spills"] == 0 and f"This lesson's dQ kernel fits without that ({dq['registers']} registers)" in text
    assert f"spills too, but less: {dkdv['spills']} values per thread at its Hopper launch" in text
    assert f"in 255 registers (and spills {dkdv['spills']})" in text and dkdv["registers"] == 255


def test_the_warp_specialised_window_launches_are_the_recorded_compiles():
    """tune_window.py's FAST_WS_CANDIDATES, as its comment says: 12 warps of 168 registers, no spills (sm_90, triton 3.6)."""
    tune_window = _benchmark("tune_window")
    rows = results.load("sm90_compiles")["ws_window_forward"]
    assert {(r["block_m"], r["block_n"], 4, r["num_stages"]) for r in rows} == set(tune_window.FAST_WS_CANDIDATES)
    regs = {r["registers"] for r in rows}
    assert all(r["warps"] == 12 and r["spills"] == 0 for r in rows) and len(regs) == 1
    assert {r["sink_size"] for r in rows} == {0, 4}  # the sink tiles and the band in one loop specialise too
    assert "(results/sm90_compiles.json's ws_window_forward, S = 0 and 4)" in " ".join(
        line.lstrip("# ") for line in (ROOT / "benchmarks" / "tune_window.py").read_text().splitlines())
    text = " ".join((ROOT / "benchmarks" / "tune_window.py").read_text().split())
    assert f"warpgroups, 12 warps of {regs.pop()} registers, no spills" in text


def test_lesson_06_quotes_lesson_05s_compiles_on_4_and_8_warps():
    """Section 8's registers hypothesis, tested by compiling for sm_90: lesson 05's kernel at its Hopper launch and on 4
    warps (results/sm90_compiles.json), against the fast kernel's 4-warp, 2-stage spills (tune_fast.json)."""
    rows = {r["name"]: r for r in results.load("sm90_compiles")["lesson05_forward"]}
    own, w4s2, w4s3 = rows["lesson 05's launch"], rows["4 warps, 2 stages"], rows["4 warps, 3 stages"]
    assert own["warps"] == 8 and w4s2["warps"] == w4s3["warps"] == 4
    fast = next(r for r in results.load("tune_fast")["rows"] if r["n"] == 4096 and r["name"] == "128x64 w4 s2 kv-grouped")
    fast_spills = int(re.search(r"spills (\d+)", fast["info"]).group(1))
    text = " ".join(markdown_text("06_performance").split())
    assert (f"its own launch: {own['registers']} registers, nothing spilled. On 4 warps: {w4s2['registers']} registers "
            f"and {w4s2['spills']} values per thread spilled with 2 stages ({w4s3['spills']} with 3), where the fast "
            f"kernel with TMA loads spills {fast_spills}") in text
    assert own["spills"] == 0 < fast_spills < w4s2["spills"] < w4s3["spills"]


def test_the_readme_quotes_the_t4_compile_as_recorded():
    """README's T4 row: the forward kernels' spills on sm_75 (results/sm90_compiles.json's t4_lessons), every kernel in
    the T4's 64 KiB of shared memory."""
    rows = results.load("sm90_compiles")["t4_lessons"]
    forward = [r for r in rows if "forward" in r["kernel"] or r["kernel"] == "flash_attention_kernel"]
    assert len(forward) == 8 and all(r["shared"] <= 64 * 1024 for r in rows)
    lo, hi = (f(r["spills"] * 4 for r in forward) / 1024 for f in (min, max))
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"the forward kernels spill {lo:.1f}-{hi:.1f} KiB per thread" in readme


def test_the_compile_table_renders_the_recorded_forward_compiles():
    """results.table("sm90_compiles") (lesson 11): one row per D = 128 launch of ws_forward and fp8_ws, the consumers'
    setmaxnreg only where specialised, and a header that says the figures were compiled, not measured on a GPU."""
    doc = results.load("sm90_compiles")
    rows = results.rows("sm90_compiles")
    want = len(doc["ws_forward"]) + len(doc["ws_persistent_forward"]) + sum(r["head_dim"] == 128 for r in doc["fp8_ws"])
    assert len(rows) == want and {r["kernel"] for r in rows} == {"bf16 forward (lesson 06)", "FP8 forward (lesson 11)"}
    assert all((r["setmaxnreg"] == "232") == r["warp_specialize"] for r in rows)
    assert any("at most 128 registers" in r["launch"] for r in rows)
    md = results.markdown("sm90_compiles")
    assert md.startswith(f"Recorded on sm_90, compiled without a GPU by triton {doc['info']['triton']}")


def test_lesson_11s_reading_of_the_partitions_is_the_recorded_one():
    """Lesson 11: in every specialised forward (bf16 and FP8) the producer issues the TMA copies and no product,
    and each of two consumers runs the tile's two products and no copy (results/sm90_compiles.json's partitions)."""
    doc = results.load("sm90_compiles")
    rows = [r for section in ("ws_forward", "ws_persistent_forward", "fp8_ws", "ws_window_forward") for r in doc[section]
            if r["warp_specialize"]]
    assert rows and all(r["warps"] == 12 for r in rows)
    for r in rows:
        (producer, dots, loads), *consumers = r["partitions"]
        assert producer == "default" and dots == 0 and loads >= 3, r
        assert [(d, n) for _, d, n in consumers] == [(2, 0), (2, 0)], r
    assert all(not r["partitions"] for r in doc["ws_forward"] if not r["warp_specialize"])
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert ("The producer issues every TMA copy and no matrix product; each consumer runs the tile's two products, "
            "`Q Kᵀ` and `P V`, on its 64 rows") in text


def test_the_persistent_specialised_forwards_are_the_recorded_compiles():
    """tune_fast.py's persistent VARIANTS, as its comment says (sm_90, triton 3.6): 12 warps of 168 registers, no
    spills, 144 / 208 KiB for 128 x 64 / 128 x 128, causal and not."""
    rows = results.load("sm90_compiles")["ws_persistent_forward"]
    tune_fast = _benchmark("tune_fast")
    want = {(c[0], c[1], c[3]) for c, extra in tune_fast.VARIANTS if extra.get("persistent")}
    assert {(r["block_m"], r["block_n"], r["num_stages"]) for r in rows} == want and len(rows) == 2 * len(want)
    assert all(r["warps"] == 12 and r["registers"] == 168 and r["spills"] == 0 for r in rows)
    kib = sorted({r["shared"] // 1024 for r in rows})
    text = " ".join(line.lstrip("# ") for line in (ROOT / "benchmarks" / "tune_fast.py").read_text().splitlines())
    assert f"12 warps of 168 registers, no spills, {kib[0]} / {kib[1]} KiB" in text
    lesson = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert f"(12 warps again, {kib[0]} KiB at `128 x 64`; on the H200 it hangs too)" in lesson


def test_the_hang_the_lesson_reports_is_the_recorded_one():
    """results/ws_smoke_h200.txt (benchmarks/ws_smoke.py on the H200): the unspecialised launch ran, every specialised
    one was killed; lesson 11 says so, and the kernels refuse such launches on a GPU."""
    import importlib.util

    lines = (ROOT / "results" / "ws_smoke_h200.txt").read_text().splitlines()
    verdicts = {line.split()[0]: line.split()[1] for line in lines if line.strip()}
    spec = importlib.util.spec_from_file_location("ws_smoke", ROOT / "benchmarks" / "ws_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    assert set(verdicts) == set(smoke.CASES)
    assert verdicts.pop("plain") == "ran" and set(verdicts.values()) == {"HUNG"}
    text = " ".join(markdown_text("11_hopper_and_fp8").split())
    assert "**Then it ran on the H200, and never finished.**" in text and "results/ws_smoke_h200.txt" in text



def _signed_percent(x: float, decimals: int = 0) -> str:
    """A gain as lessons write it: ``+27%``, ``−0.4%`` (a minus sign, not a hyphen)."""
    return f"{'+' if x >= 0 else '−'}{abs(100 * x):.{decimals}f}%"


def test_lesson_06_reads_its_tuning_ladder_and_launch_grid_from_the_recorded_run():
    """Lesson 06's ladder, step by step (each step's gain over the one before at N = 4096 / 16384; the two experiments
    against the autotuned kernel), and section 5's launch grid (lesson 05's kernel at five launches, N = 4096): every
    figure derived from results/forward_bench.json. The README quotes the ladder's two largest steps the same way."""
    ladder = results.load("forward_bench")["ladder"]
    tf = {(s["step"], s["n"]): s["tflops"] for s in ladder["steps"] if s["status"] == "ok"}
    order = ["baseline rewrite", "+ two-phase causal loop", "+ exp2, folded scale", "+ longest rows first",
             "+ TMA descriptors", "+ two programs per SM", "+ GQA groups side by side", "+ autotune"]
    base = dict(zip(order[1:], order)) | {"lazy rescale (experiment)": "+ autotune",
                                          "QK^T pipelined by hand (experiment)": "+ autotune"}
    written = {"+ two-phase causal loop": "Two-phase causal loop", "+ exp2, folded scale": "`exp2` with the scale folded in",
               "+ longest rows first": "Longest rows first", "+ TMA descriptors": "TMA descriptors",
               "+ two programs per SM": "Two programs per SM", "+ GQA groups side by side": "GQA groups side by side",
               "+ autotune": "Autotune", "lazy rescale (experiment)": "Lazy rescaling (an experiment)",
               "QK^T pipelined by hand (experiment)": "`Q Kᵀ` pipelined by hand (an experiment)"}
    gains = {step: [tf[(step, n)] / tf[(before, n)] - 1 for n in (4096, 16384)] for step, before in base.items()}
    text = markdown_text("06_performance")
    for step, label in written.items():
        small = step == "+ autotune"  # under a percent at 4k: written with one decimal
        both = " / ".join(_signed_percent(g, 1 if small and abs(g) < 0.01 else 0) for g in gains[step])
        assert f"**{label}: {both}" in text, (step, both)
    two_phase, two_programs = (" / ".join(_signed_percent(g) for g in gains[s])
                               for s in ("+ two-phase causal loop", "+ two programs per SM"))
    assert f"two-phase causal loop ({two_phase} at N = 4096 / 16384)" in readme_text()
    assert f"two programs share each SM came next ({two_programs};" in readme_text()
    assert f"Making two programs fit on one SM gave us {two_programs}" in text
    grid = {(g["block_m"], g["block_n"], g["num_warps"], g["num_stages"]): g["tflops"]
            for g in ladder["course_grid"] if g["n"] == 4096 and g["status"] == "ok"}
    slowest, eight, best, two_stages = grid[(128, 64, 4, 3)], grid[(128, 64, 8, 3)], grid[(128, 128, 8, 3)], \
        grid[(128, 64, 4, 2)]
    assert slowest == min(grid.values()) and best == max(grid.values())
    assert f"The same code spans {slowest:.0f} to {best:.0f} TFLOP/s at N = 4096" in text
    assert f"split the same tile across two warpgroups: {_signed_percent(eight / slowest - 1)}." in text
    assert 1 - eight / best < 0.05 and "is within 5%" in text  # lesson 05's default against the best
    assert f"**2 stages instead of 3: {_signed_percent(two_stages / slowest - 1)}.**" in text


def _main_sweep() -> dict:
    """results/forward_bench.json's main case (bf16, causal, GQA 32/8, D = 128, 16k tokens, the H200): (provider, N) ->
    its row, the rows that ran."""
    return {(r["provider"], r["n"]): r for r in results.load("forward_bench")["rows"]
            if r["case"] == "main" and r["status"] == "ok"}


def _naive_profile():
    """results/naive_profile.txt (lesson 06's profiler cell, run on the H200): per N, one pass's ms, the total ms and
    each kernel's (ms, passes, name) in the order printed."""
    runs, current = {}, None
    for line in (ROOT / "results" / "naive_profile.txt").read_text().splitlines():
        head = re.match(r"N=(\d+) B=\d+: one pass over the scores [0-9.]+ GB = ([0-9.]+) ms", line)
        row = re.match(r"\s*([0-9.]+) ms =\s*([0-9.]+) passes\s+x\d+\s+(.*)", line)
        total = re.match(r"\s*([0-9.]+) ms in these", line)
        if head:
            current = runs[int(head[1])] = {"pass_ms": float(head[2]), "kernels": []}
        elif row and current is not None:
            current["kernels"].append((float(row[1]), float(row[2]), row[3]))
        elif total and current is not None:
            current["total_ms"] = float(total[1])
    return runs


def test_lesson_06_reads_the_main_sweep_and_the_naive_profile_from_the_recorded_runs():
    """Lesson 06's figures on the main case (bf16, causal, GQA 32/8, D = 128, 16k tokens, the H200's sweep in
    results/forward_bench.json): naive attention's memory and speed, cuDNN's and SDPA flash's range, the course's
    kernels against both; and the profiler's passes (results/naive_profile.txt) at 4k and 16k."""
    main = _main_sweep()
    ns = sorted({n for _, n in main})
    tf = lambda p, keep=lambda n: True: [main[(p, n)]["tflops"] for n in ns if keep(n)]  # noqa: E731
    ratio = lambda a, b, keep=lambda n: True: [main[(a, n)]["tflops"] / main[(b, n)]["tflops"]  # noqa: E731
                                               for n in ns if keep(n)]
    vr = results.value_range
    long, short = (lambda n: n >= 4096), (lambda n: n <= 2048)
    peak = [main[("naive", n)]["peak_mib"] / 1024 for n in (ns[0], ns[-1])]
    naive, cudnn, flash = tf("naive"), tf("sdpa_cudnn", lambda n: n >= 2048), tf("sdpa_flash")
    text = markdown_text("06_performance")
    assert f"({peak[0]:.1f} GiB at N = 1k to {peak[1]:.1f} GiB at N = 16k" in text
    assert all(abs(x - 30) <= 6 for x in naive) and "Naive manages about 30 TFLOP/s" in text
    rounded = lambda xs: f"{round(min(xs), -1):.0f}–{round(max(xs), -1):.0f}"  # noqa: E731  to the nearest ten
    assert f"cuDNN is the fastest ({rounded(cudnn)} TFLOP/s at N ≥ 2048)" in text
    assert 260 <= min(flash) and max(flash) <= 330 and "backend reaches only 260–330" in text
    assert f"runs **{vr(ratio('course', 'sdpa_flash', long))}** faster than SDPA's flash backend at N ≥ 4096" in text
    assert (f"at every N ({vr(ratio('fast', 'sdpa_flash'))}; {vr(ratio('fast', 'sdpa_flash', long))} at N ≥ 4096), "
            f"and lesson 05's kernel as taught does too ({vr(ratio('course', 'sdpa_flash'))})") in text
    assert (f"It reaches **{vr(ratio('fast', 'sdpa_cudnn', long))} of cuDNN** at N ≥ 4096 and "
            f"{vr(ratio('fast', 'sdpa_cudnn', short))} at N ≤ 2048") in text
    profile = _naive_profile()
    at4k, at16k = profile[4096], profile[16384]
    passes = at4k["total_ms"] / at4k["pass_ms"]
    assert (f"one call keeps the GPU busy for {at4k['total_ms']:.1f} ms, where one pass over the scores at the "
            f"measured copy rate takes {at4k['pass_ms']:.1f} ms: about **{passes:.0f} passes' worth**") in text
    name = lambda run, part: next(p for _, p, k in run["kernels"] if part in k)  # noqa: E731
    assert (f"{at16k['total_ms'] / at16k['pass_ms']:.1f} passes' worth, with `masked_fill_` "
            f"{name(at16k, 'elementwise_kernel<128'):.1f} and the softmax {name(at16k, 'SoftMax'):.1f}") in text
    assert (f"| `masked_fill_` with the `[N, N]` boolean mask | 2 | {name(at4k, 'elementwise_kernel<128'):.1f} | "
            f"| `softmax` | 2 | {name(at4k, 'SoftMax'):.1f} |") in text


def test_lesson_07_times_its_backward_alone_from_the_recorded_run():
    """Lesson 07's backward alone: results/tune_backward.json's first run (causal, the H200), at 4k and 16k, and the
    TFLOP/s at 16k with the backward counted as 2.5 forwards (B = 1, 32 query heads, D = 128, half the pairs)."""
    ms = {r["N"]: r["bwd_ms"] for r in results.rows("tune_backward", run=1, causal="yes",
                                                      layout="lesson 07 (two kernels)")}
    n = 16384
    tflops = 2.5 * 4 * 32 * n * n * 128 / 2 / (ms[n] * 1e-3) / 1e12
    quote = (f"took {ms[4096]:.2f} ms at 4k and {ms[n]:.2f} ms at 16k (about {tflops:.0f} TFLOP/s at 16k, counting 2.5 "
             "forward passes of work)")
    assert quote in markdown_text(W07), quote


def test_lessons_08_to_10_quote_their_other_recorded_runs_as_recorded():
    """The figures lessons 08-10 take from runs outside their benchmarks' tables: a sweep's JSON where one is kept
    (lesson 09's long-context and PDL sweeps, lesson 10's merge), else the line of results/GPU_VALIDATION.md or
    results/NOTES.md that recorded them, which must say the same (there written with a hyphen and an x)."""
    vr = results.value_range
    long = {(r["num_splits"], r["num_stages"]): r for r in results.load("tune_decode_long")["runs"][1]["rows"]
            if r["batch"] == 4 and r["context"] == 131072 and r["name"].startswith("course")}
    shipped = next(r for r in long.values() if r["shipped"])
    doubled = long[(2 * shipped["num_splits"], shipped["num_stages"])]
    best = shipped["sdpa_best_gbps"]
    pdl = next(r for r in results.load("pdl_splits")["rows"] if (r["B"], r["L"]) == (1, 1024))
    cudnn = pdl["gbps"]["cudnn"]
    point_us = 1 * 8 * 1024 * 128 * 2 * 2 / (max(cudnn) * 1e9) * 1e6  # K and V of 8 kv heads, bf16
    text = markdown_text(W09)
    assert (f"at `B = 4` and 128k {shipped['gbps'] / best:.2f}× cuDNN with the model's count against "
            f"{doubled['gbps'] / best:.2f}× with twice as many splits") in text
    assert (f"(cuDNN's own rate at this {point_us:.0f} µs point moved by {100 * (max(cudnn) / min(cudnn) - 1):.0f}% "
            "between the sweep's two rounds)") in text
    ring = {(r["n"], r["provider"]): r["forward_ms"] for r in results.load("ring_blocks")["rows"]}
    gain = [ring[(n, "course")] / ring[(n, "course_fused_merge")] - 1 for n, p in ring if p == "course_fused_merge"]
    assert f"the rank's forward {vr([100 * g for g in gain], '.0f', '%')} faster than the torch merge" in markdown_text(W10)
    log, notes = ((ROOT / "results" / name).read_text() for name in ("GPU_VALIDATION.md", "NOTES.md"))
    recorded = [  # (lesson, its words, where the run was recorded, the record's words)
        (W08, "took **15.05 ms with 4 sinks**. The split below brought the same run down to 7.50 ms", log,
         "W = 1024, N = 32k 15.05 → 7.50 ms"),
        (W08, "points rose from 0.89–1.08× to 1.00–1.73× in the run that added that kernel", log,
         "**1.00-1.73x at N = 4k (was 0.89-1.08x)**"),
        (W08, "was the exception in the run before (0.63×)", notes, "N = 4k without sinks 1.42x -> 0.63x"),
        (W09, "read 0.44–0.76× (`results/GPU_VALIDATION.md`", log, "0.44-0.76"),
        (W09, "measured 0.20–1.01× SDPA (`results/GPU_VALIDATION.md`)", log, "course / best SDPA 0.20–1.01×"),
        (W10, "(2–5% in the eleventh session's", log, "(2-5% faster)"),
    ]
    for lesson, words, record, said in recorded:
        assert words in markdown_text(lesson), words
        assert said in record, said


def test_lesson_11_quotes_its_earlier_measurements_as_recorded():
    """Lesson 11's figures from runs other than its ladder: lesson 06's forward against SDPA flash (one decimal), the
    FP8 kernels' tensor pipes (results/ncu_forward.json), the tuned FP8 launch's 4 stages against 3
    (results/tune_fp8.json), and the FP8 ladder's earlier runs as results/GPU_VALIDATION.md recorded them."""
    main = {key: r["tflops"] for key, r in _main_sweep().items()}
    fast = [main[("fast", n)] / main[("sdpa_flash", n)] for p, n in main if p == "fast"]
    kernels = results.load("ncu_forward")["kernels"]
    pipes = [kernels[k]["tensor_pipe_pct"] for k in ("fp8", "fp8_hopper")]
    rows = [r for r in results.load("tune_fp8")["rows"] if (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"]) == (128, 128, 8)]
    stages = {(r["n"], r["causal"], r["num_stages"]): r["tflops"] for r in rows}
    four_vs_three = [stages[(n, c, 4)] / stages[(n, c, 3)] for n, c, s in stages if s == 3]
    assert len(four_vs_three) == 4 and max(abs(x - 1) for x in four_vs_three) < 0.01
    text = markdown_text("11_hopper_and_fp8")
    assert f"tuned the course's forward on an H200 to {min(fast):.1f}–{max(fast):.1f}× PyTorch's FlashAttention" in text
    assert f"tensor pipes busy only {min(pipes):.0f}–{max(pipes):.0f}% of the time" in text
    assert "128 × 128 tiles with 8 warps and 3 stages (4 stages within 1%)" in text
    log = (ROOT / "results" / "GPU_VALIDATION.md").read_text()
    assert ("The run before the Hopper launch (the lesson kernel at its tuned launch, `results/GPU_VALIDATION.md`) "
            "read 0.63–1.03×; the two runs before this one, without the register caps of the section after next, "
            "0.88–1.24× and 0.91–1.23× (1.09–1.24× and 1.10–1.23× at N ≥ 4096)") in text
    for said in ("the lesson kernel at 0.63-1.03x", "FP8 0.88-1.24x cuDNN's bf16, 1.09-1.24x at N >= 4k",
                 "FP8 0.91-1.23x cuDNN's bf16, 1.10-1.23x at N >= 4k"):
        assert said in log, said


def test_the_readme_s_lesson_06_table_is_the_recorded_sweep():
    """The README's table of lesson 06's kernel (the H200's main case, results/forward_bench.json), row by row, the
    sentence under it, and the run-to-run spread it quotes from results/NOTES.md."""
    main = {key: r["tflops"] for key, r in _main_sweep().items()}
    ns = sorted({n for _, n in main})
    text = readme_text()
    for n in ns:
        flash, cudnn, lesson05, fast = (main[(p, n)] for p in ("sdpa_flash", "sdpa_cudnn", "course", "fast"))
        row = (f"| {n} | {flash:.0f} | {cudnn:.0f} | {lesson05:.0f} | {fast:.0f} | {fast / flash:.2f}× | "
               f"{fast / cudnn:.2f}× | {lesson05 / flash:.2f}× |")
        assert row in text, row
    vr = results.value_range
    long = [n for n in ns if n >= 4096]
    assert (f"FlashAttention backend at every N ({vr([main[('fast', n)] / main[('sdpa_flash', n)] for n in long])} at "
            f"N ≥ 4096) and reaches {vr([main[('fast', n)] / main[('sdpa_cudnn', n)] for n in long])} of cuDNN at "
            "N ≥ 4096 in this run") in text
    assert min(main[("fast", n)] / main[("sdpa_flash", n)] for n in ns) > 1  # "at every N"
    assert ("moved the ratios at N = 4096 between 0.89× and 0.92× of cuDNN and 1.48× and 1.53× of flash" in text
            and "0.89–0.92× of cuDNN and 1.48–1.53× of SDPA flash at N = 4096 across runs" in
            " ".join((ROOT / "results" / "NOTES.md").read_text().split()))


def test_the_readme_quotes_the_class_grading_runs_as_recorded():
    """The README's grading times (benchmarks/grade_class.py on the 2-core CPU machine, results/grade_class.json): the
    last three runs (two of one learner, one of four) as they are, the three before them (before the NumPy lessons'
    grading stopped importing torch) in a clause, and every correct learner's exercises passed in each run."""
    runs = results.load("grade_class")["runs"]
    assert len(runs) == 6 and all(r["correct_not_passed"] == 0 and r["cores"] == 2 for r in runs)
    span = lambda values, f=".0f": results.value_range(values, f, "")  # noqa: E731

    def one_and_four(group):
        one, four = [r for r in group if r["learners"] == 1], [r for r in group if r["learners"] == 4]
        assert len(one) == 2 and len(four) == 1
        return one, four[0]

    (one, four), (one_before, four_before) = one_and_four(runs[3:]), one_and_four(runs[:3])
    now = (f"one learner's six notebooks: {span([r['wall_s'] for r in one])} s with `--jobs 2` "
           f"({span([r['cpu_s'] for r in one])} CPU-seconds; {span([r['one_correct_sequential_s'] for r in one])} s one "
           f"notebook after another; two runs, load average {span([r['load_average'] for r in one], '.1f')}), peak "
           f"{span([r['peak_gib'] for r in one], '.2f')} GiB for the grader and its processes; 4 learners: "
           f"{four['wall_s']:.0f} s ({four['wall_s'] / 4:.0f} s per learner, {four['cpu_s'] / 4:.0f} CPU-seconds per "
           f"learner; load average {four['load_average']:.1f}), peak {four['peak_gib']:.2f} GiB")
    assert now in readme_text(), now
    before = (f"before the NumPy lessons' grading stopped importing torch, the same runs read "
              f"{span([r['wall_s'] for r in one_before])} s and {four_before['wall_s']:.0f} s, peak "
              f"{span([r['peak_gib'] for r in one_before + [four_before]], '.2f')} GiB")
    assert before in readme_text(), before


def test_lesson_09_s_drain_term_is_fitted_where_the_rest_of_the_model_overshoots():
    """Lesson 09's reason for ``decode.DRAIN_WAVES``: at B = 64 (one split of the 3-stage launch) the recorded sweep
    read less of the ceiling than the model without that term predicts, at every context of results/decode_splits.json."""
    from course_utils.kernels import decode

    rows = results.rows("decode_splits", B=64, splits=1, stages=3)
    without = [100 * decode.split_busy_fraction(64, 8, 1, -(-r["context"] // 64), 1, 132, decode.PROGRAMS_PER_SM,
                                                drain=0.0) for r in rows]
    assert len(rows) == 3 and all(r["of_ceiling"] < w - 5 for r, w in zip(rows, without))
    quote = f"where the rest of the model predicts {results.value_range(without, '.0f', '%')}"
    assert quote in markdown_text(W09), quote


def test_the_readme_s_path_says_lesson_12_s_benchmark_is_recorded_and_short():
    """The README's table of lessons: lesson 12's benchmark against FlexAttention is recorded (results/mods_bench.json,
    on the H200), and it falls short: the course's forward behind FlexAttention at every 8k point, as lesson 12 says."""
    recorded = results.load("mods_bench")
    assert recorded["info"]["gpu"] == "NVIDIA H200"
    at_8k = [r["course_over_flex"] for r in recorded["ratios"] if r["mode"] == "forward" and r["n"] == 8192]
    assert at_8k and max(at_8k) < 1.0
    assert "the benchmark against it, recorded on the H200 (`results/mods_bench.md`), falls short of FlexAttention" \
        in readme_text()
    assert "behind it at every 8k point" in markdown_text("12_packed_sequences_and_score_mods")


def test_the_readme_quotes_ci_s_time_as_recorded():
    """The README's "Tests and CI": the test minutes and the whole runs' of the clean-clone runs results/NOTES.md
    records (pytest's own seconds, then the whole run's), the first three from before the NumPy lessons' grading
    stopped importing torch."""
    notes = " ".join((ROOT / "results" / "NOTES.md").read_text().split())
    section = notes[notes.index("**CI's time, 2026-12-07**"):]
    runs = [(int(t) / 60, int(a) / 60) for t, a in re.findall(r"[0-9a-f]{7} (\d+) s of tests, (\d+) s in all", section)]
    assert len(runs) == 6
    before, after = runs[:3], runs[3:]
    span = lambda values: results.value_range(values, ".0f", "")  # noqa: E731
    quote = (f"{span([t for t, _ in after])} minutes of tests there in three clean-clone runs, "
             f"{span([a for _, a in after])} in all ({span([t for t, _ in before])} minutes of tests in three runs before "
             "the NumPy lessons' grading stopped importing torch), all of 2026-12-07 on an otherwise idle machine; "
             "`results/NOTES.md`)")
    assert quote in readme_text(), quote


def test_the_readme_quotes_how_long_each_lesson_runs_as_recorded():
    """The README's "every lesson runs top to bottom in seconds": benchmarks/cell_times.py's run on the CPU machine
    (results/cell_times.json), each notebook's time with its kernel's start and the slowest cell of all, derived
    again; every solution notebook is in the run, with as many code cells as it has now."""
    run = next(r for r in results.load("cell_times")["runs"] if r["machine"].startswith("no GPU"))
    stems = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    assert sorted(n["notebook"] for n in run["notebooks"]) == stems
    for row in run["notebooks"]:
        nb = nbformat.read(ROOT / "solutions" / f"{row['notebook']}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
        assert len(row["cells"]) == len(code), row["notebook"]  # a cell added or removed since: measure again
    worst, stem = max((c["seconds"], n["notebook"]) for n in run["notebooks"] for c in n["cells"])
    line = next(c["first_line"] for n in run["notebooks"] for c in n["cells"]
                if (c["seconds"], n["notebook"]) == (worst, stem))
    quote = (f"each solution notebook took {results.value_range([n['wall_s'] for n in run['notebooks']], '.1f', '')} s "
             f"with its kernel's start, and its slowest cell {worst:.1f} s ({stem}'s `{line}`); "
             f"`python benchmarks/cell_times.py` measures it (`results/cell_times.json`, {run['date'][:10]})")
    assert quote in readme_text(), quote
