"""Recorded GPU benchmark results, rendered for the lessons.

A lesson never copies a measured number by hand: it calls :func:`table` for a recorded table and
:func:`figure` for one number (a range, a median) taken from ``results/<name>.json``, and
``tests/test_results.py`` checks that the figures quoted in the lessons' prose are the ones these
functions derive. ``results/`` is the repository's folder beside ``course_utils/``; an installed
package falls back to ``course_utils/data/``, which ships a copy of each JSON the lessons read
(``tests/test_bench.py`` checks the copies equal ``results/``).

    >>> from course_utils import results
    >>> results.figure("window_bench", "course_over_flex", mode="forward")   # doctest: +SKIP
    '0.85–1.05×'
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
DATA_DIR = Path(__file__).resolve().parent / "data"

# Each table: its columns, in order, as (key, header, format, unit). Rows hold these keys.
COLUMNS = {
    "window_bench": [
        ("mode", "pass", "", ""), ("W", "W", "d", ""), ("S", "S", "d", ""), ("N", "N", "d", ""),
        ("course_ms", "course ms", ".2f", ""), ("course_tflops", "course TFLOP/s", ".0f", ""),
        ("flex_tflops", "Flex TFLOP/s", ".0f", ""), ("sdpa_mask_tflops", "SDPA+mask TFLOP/s", ".0f", ""),
        ("course_over_flex", "course / Flex", ".2f", "×"),
    ],
    "mods_bench": [
        ("mode", "pass", "", ""), ("mod", "mod", "", ""), ("docs", "docs", "d", ""), ("N", "N", "d", ""),
        ("course_ms", "course ms", ".2f", ""), ("course_tflops", "course TFLOP/s", ".0f", ""),
        ("flex_tflops", "Flex TFLOP/s", ".0f", ""), ("sdpa_tflops", "SDPA TFLOP/s", ".0f", ""),
        ("course_over_flex", "course / Flex", ".2f", "×"),
    ],
    "decode_bench": [
        ("B", "B", "d", ""), ("context", "context", "d", ""), ("course_gbps", "course GB/s", ".0f", ""),
        ("sdpa_best_gbps", "SDPA best GB/s", ".0f", ""), ("ceiling_gbps", "read ceiling GB/s", ".0f", ""),
        ("course_over_sdpa", "course / SDPA best", ".2f", "×"), ("course_over_ceiling", "course / ceiling", ".0f", "%"),
        ("splits", "splits", "", ""), ("paged_gbps", "paged GB/s", ".0f", ""),
        ("paged_over_contiguous", "paged / contiguous", ".2f", "×"),
    ],
    "decode_splits": [
        ("B", "B", "d", ""), ("context", "context", "d", ""), ("splits", "num_splits", "d", ""),
        ("stages", "stages", "d", ""), ("gbps", "GB/s", ".0f", ""), ("of_ceiling", "of the read ceiling", ".0f", "%"),
        ("predicted", "model's busy fraction", ".0f", "%"), ("pick", "model's pick", "", ""),
    ],
    "decode_variants": [
        ("B", "B", "d", ""), ("context", "context", "d", ""), ("round", "round", "d", ""),
        ("cudnn_gbps", "SDPA cuDNN GB/s", ".0f", ""), ("course_over_cudnn", "course / cuDNN", ".2f", "×"),
        ("tma_over_cudnn", "tma / cuDNN", ".2f", "×"), ("fused_over_cudnn", "fused / cuDNN", ".2f", "×"),
    ],
    "ring_bench": [
        ("N", "N", "d", ""), ("pass", "pass", "", ""), ("one_gpu_toks", "1 GPU tok/s", ",.0f", ""),
        ("ring_toks", "ring tok/s", ",.0f", ""), ("ring_over_one_gpu", "ring / 1 GPU", ".2f", "×"),
        ("torch_cp_allgather_toks", "torch CP all-gather tok/s", ",.0f", ""),
        ("torch_cp_alltoall_toks", "torch CP all-to-all tok/s", ",.0f", ""),
        ("ring_over_torch_cp", "ring / faster torch CP", ".2f", "×"),
    ],
    "ring_blocks": [
        ("N", "N", "d", ""), ("provider", "provider", "", ""), ("calls", "calls", "d", ""),
        ("kernels_ms", "kernels ms", ".2f", ""), ("forward_ms", "forward ms", ".2f", ""),
        ("merge_share", "merges, of the forward", ".0f", "%"), ("forward_tflops", "forward TFLOP/s", ".0f", ""),
        ("backward_ms", "backward ms", ".2f", ""), ("course_over_fwd", "course / this, forward speed", ".2f", "×"),
        ("course_over_bwd", "course / this, backward speed", ".2f", "×"),
    ],
    "training_bench": [
        ("N", "N", "d", ""), ("B", "B", "d", ""), ("course_ms", "course ms", ".2f", ""),
        ("course_tflops", "course TFLOP/s", ".0f", ""), ("flash_ms", "SDPA flash ms", ".2f", ""),
        ("cudnn_ms", "SDPA cuDNN ms", ".2f", ""), ("course_over_flash", "course / flash", ".2f", "×"),
        ("course_over_cudnn", "course / cuDNN", ".2f", "×"),
    ],
    "tune_backward": [
        ("run", "run", "d", ""), ("N", "N", "d", ""), ("causal", "causal", "", ""), ("layout", "layout", "", ""),
        ("config", "its fastest configuration", "", ""), ("bwd_ms", "backward ms", ".2f", ""),
        ("cudnn_over_bwd", "cuDNN / this, backward speed", ".2f", "×"),
        ("cudnn_over_total", "cuDNN / this, forward + backward speed", ".2f", "×"),
        ("spills", "spilled registers per thread", "", ""), ("same_bits", "same bits twice", "", ""),
    ],
    "tune_window": [
        ("mode", "pass", "", ""), ("W", "W", "d", ""), ("S", "S", "d", ""),
        ("before_ms", "shipped launch then, ms", ".3f", ""), ("config", "fastest launch", "", ""),
        ("best_ms", "fastest, ms", ".3f", ""), ("flex_ms", "Flex ms", ".3f", ""),
        ("before_over_flex", "shipped then / Flex, speed", ".2f", "×"), ("best_over_flex", "fastest / Flex, speed", ".2f", "×"),
    ],
    "tune_window_fast": [
        ("W", "W", "d", ""), ("S", "S", "d", ""), ("N", "N", "d", ""), ("flex_ms", "Flex ms", ".3f", ""),
        ("lesson_over_flex", "lesson 08's kernel / Flex, speed", ".2f", "×"),
        ("shipped", "fast_window.hopper_config", "", ""),
        ("shipped_over_flex", "hopper_config / Flex, speed", ".2f", "×"), ("config", "fastest launch", "", ""),
        ("best_over_flex", "fastest / Flex, speed", ".2f", "×"),
    ],
    "sm90_compiles": [
        ("kernel", "kernel", "", ""), ("causal", "causal", "", ""), ("launch", "launch", "", ""),
        ("warp_specialize", "warp_specialize", "", ""), ("warps", "warps", "d", ""),
        ("registers", "registers per thread", "d", ""), ("setmaxnreg", "consumers raised to", "", ""),
        ("spills", "spilled per thread", "d", ""), ("shared_kib", "shared memory KiB", ".0f", ""),
        ("partitions", "partitions: (TMA loads, products)", "", ""),
    ],
    "hopper_ws_probe": [
        ("run", "run", "d", ""), ("loop", "consumer loop", "", ""), ("fma", "FMA softmax", "", ""),
        ("persistent", "persistent", "", ""), ("num_buffers", "K/V slots", "d", ""),
        ("causal", "causal", "", ""), ("N", "N", "d", ""), ("B", "B", "d", ""),
        ("hopper_ws", "Gluon, specialised TFLOP/s", ".0f", ""), ("cudnn", "cuDNN TFLOP/s", ".0f", ""),
        ("course", "course TFLOP/s", ".0f", ""), ("over_cudnn", "specialised / cuDNN", ".2f", "×"),
        ("over_course", "specialised / course", ".2f", "×"),
    ],
    "hopper_ws_fp8_probe": [
        ("loop", "consumer loop", "", ""), ("num_buffers", "K/V slots", "d", ""),
        ("causal", "causal", "", ""), ("N", "N", "d", ""), ("B", "B", "d", ""),
        ("hopper_ws", "Gluon FP8 TFLOP/s", ".0f", ""), ("course", "course FP8 (Triton) TFLOP/s", ".0f", ""),
        ("cudnn", "cuDNN bf16 TFLOP/s", ".0f", ""), ("over_cudnn", "Gluon FP8 / cuDNN bf16", ".2f", "×"),
        ("over_course", "Gluon FP8 / course FP8", ".2f", "×"), ("rel_rms", "relative RMS error", ".4f", ""),
    ],
}
COLUMNS["hopper_ws_bwd_probe"] = [
    ("block_m", "dK/dV query rows per tile", "d", ""), ("dq_kernel", "dQ kernel", "", ""),
    ("dq_block_n", "dQ keys per tile", "d", ""), ("num_buffers", "slots", "d", ""), ("causal", "causal", "", ""),
    ("N", "N", "d", ""), ("B", "B", "d", ""), ("hopper_ws", "Gluon backward TFLOP/s", ".0f", ""),
    ("course", "lesson 07's pair TFLOP/s", ".0f", ""), ("cudnn", "cuDNN backward TFLOP/s", ".0f", ""),
    ("over_cudnn", "Gluon / cuDNN, backward", ".2f", "×"), ("over_course", "Gluon / lesson 07's pair", ".2f", "×"),
    ("train_over_cudnn", "forward + backward / cuDNN's, speed", ".2f", "×"),
]
# Another GPU's run of the same probe, or a later one: the same table (the file's info names the GPU).
for _name, _probe in (("hopper_ws_probe_h100", "hopper_ws_probe"), ("hopper_ws_fp8_probe_h100", "hopper_ws_fp8_probe"),
                      ("hopper_ws_probe_overlap_h100", "hopper_ws_probe"),
                      ("hopper_ws_fp8_probe_overlap_h100", "hopper_ws_fp8_probe"),
                      ("hopper_ws_bwd_probe_h100", "hopper_ws_bwd_probe")):
    COLUMNS[_name] = COLUMNS[_probe]


def path(name: str) -> Path:
    """The file ``<name>.json`` of the recorded results; FileNotFoundError when neither folder has it."""
    for folder in (RESULTS_DIR, DATA_DIR):
        if (folder / f"{name}.json").is_file():
            return folder / f"{name}.json"
    raise FileNotFoundError(f"no recorded {name}.json in {RESULTS_DIR} or {DATA_DIR}: it was measured on a GPU "
                            "and is in the course repository's results/ folder.")


def load(name: str) -> dict:
    """The recorded JSON of benchmark ``name`` (e.g. ``"window_bench"``), as written by its bench."""
    return json.loads(path(name).read_text())


def append_run(path: Path, run: dict, what: str) -> None:
    """Append ``run`` to the ``runs`` of the JSON file at ``path``, created with ``what`` (one line) if missing.

    The CPU benchmarks that record several runs of one measurement (``benchmarks/grade_class.py``,
    ``benchmarks/cell_times.py``) keep them this way, so that a test reads their spread.
    """
    data = json.loads(path.read_text()) if path.exists() else {"what": what, "runs": []}
    data["runs"].append(run)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"recorded in {path}")


def _ratio(a, b):
    return a / b if a and b else None


def _window(d):
    by = {(r["mode"], r["window_size"], r["sink_size"], r["n"], r["provider"]): r for r in d["rows"]}
    out = []
    for q in d["ratios"]:
        key = (q["mode"], q["window_size"], q["sink_size"], q["n"])
        tf = {p: (by.get(key + (p,)) or {}).get("tflops") for p in ("course", "flex", "sdpa_mask")}
        out.append(dict(mode=key[0], W=key[1], S=key[2], N=key[3], course_ms=(by.get(key + ("course",)) or {}).get("ms"),
                        course_tflops=tf["course"], flex_tflops=tf["flex"], sdpa_mask_tflops=tf["sdpa_mask"],
                        course_over_flex=q["course_over_flex"]))
    return sorted(out, key=lambda r: (r["mode"] != "forward", r["W"], r["S"], r["N"]))


def _mods(d):
    by = {(r["mode"], r["mod"], r["n_docs"], r["n"], r["provider"]): r for r in d["rows"]}
    out = []
    for q in d["ratios"]:
        key = (q["mode"], q["mod"], q["n_docs"], q["n"])
        tf = {p: (by.get(key + (p,)) or {}).get("tflops") for p in ("course", "flex", "sdpa")}
        out.append(dict(mode=key[0], mod=key[1], docs=key[2], N=key[3], course_ms=(by.get(key + ("course",)) or {}).get("ms"),
                        course_tflops=tf["course"], flex_tflops=tf["flex"], sdpa_tflops=tf["sdpa"],
                        course_over_flex=q["course_over_flex"]))
    order = {"softcap": 0, "alibi": 1, "sinks": 2}
    return sorted(out, key=lambda r: (r["mode"] != "forward", order.get(r["mod"], 9), r["docs"], r["N"]))


def _splits(note):
    """The course's launch at a decode point: lesson 09's split count (an int) or ``"lean"`` (equal shares)."""
    text = str(note).split("=")[-1]
    return int(text) if text.isdigit() else text


def _decode(d):
    return [dict(B=s["batch"], context=s["context"], course_gbps=s["course"], sdpa_best_gbps=s["sdpa_best"],
                 ceiling_gbps=s["ceiling"], course_over_sdpa=s["course_vs_sdpa"],
                 course_over_ceiling=100 * s["course_vs_ceiling"], splits=_splits(s["num_splits"]),
                 paged_gbps=s["course_paged"], paged_over_contiguous=_ratio(s["course_paged"], s["course"]))
            for s in d["summary"]]


def _decode_splits(d):
    ceiling = {(p["batch"], p["context"]): p["ceiling_gbps"] for p in d["points"]}
    return [dict(B=r["batch"], context=r["context"], splits=r["num_splits"], stages=r.get("num_stages", 3),
                 gbps=r["gbps"],
                 of_ceiling=100 * r["gbps"] / ceiling[(r["batch"], r["context"])] if r["gbps"] else None,
                 predicted=100 * r["predicted_busy"], pick="yes" if r["model_pick"] else "")
            for r in d["rows"]]


def _decode_variants(d):
    """Per point and round (benchmarks/tune_decode_variants.py): cuDNN's GB/s and, as a ratio to it, the course's
    launch and each variant's best launch (over its split counts and stages)."""
    out = []
    for b, n, rnd in sorted({(r["batch"], r["context"], r["round"]) for r in d["rows"]}):
        here = [r for r in d["rows"] if (r["batch"], r["context"], r["round"]) == (b, n, rnd) and r.get("gbps")]
        cudnn = next((r["gbps"] for r in here if r["name"] == "sdpa_cudnn"), None)
        best = {name: max((r["gbps"] for r in here if r["name"] == name), default=None)
                for name in ("course", "tma", "fused")}
        out.append(dict(B=b, context=n, round=rnd, cudnn_gbps=cudnn,
                        **{f"{name}_over_cudnn": _ratio(gbps, cudnn) for name, gbps in best.items()}))
    return out


CP_ROTATE_METHODS = ("allgather", "alltoall")  # torch's set_rotate_method: how its context parallel moves K/V


def torch_cp_times(row, key) -> dict:
    """``{rotate method: ms}`` of PyTorch's context parallel in a ``ring_bench`` row (``key``: ``fwd_ms`` or
    ``fwd_bwd_ms``). A row of a run that timed one method only holds it as ``torch_cp_<key>``, with the
    method in its note."""
    got = {m: row.get(f"torch_cp_{m}_{key}") for m in CP_ROTATE_METHODS if f"torch_cp_{m}_{key}" in row}
    if not got and row.get(f"torch_cp_{key}") is not None:
        got = {"alltoall" if "ALL_TO_ALL" in (row.get("torch_cp_note") or "") else "allgather": row[f"torch_cp_{key}"]}
    return got


def _ring(d):
    out = []
    for r in d["rows"]:
        for label, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwd_bwd_ms")):
            tok = {who: (r["n"] / (r[f"{who}_{key}"] / 1e3) if r.get(f"{who}_{key}") else None)
                   for who in ("one_gpu", "ring")}
            cp = {m: (r["n"] / (ms / 1e3) if ms else None) for m, ms in torch_cp_times(r, key).items()}
            best = max((x for x in cp.values() if x), default=None)
            out.append({"N": r["n"], "pass": label, "one_gpu_toks": tok["one_gpu"], "ring_toks": tok["ring"],
                        "ring_over_one_gpu": _ratio(tok["ring"], tok["one_gpu"]),
                        "torch_cp_allgather_toks": cp.get("allgather"), "torch_cp_alltoall_toks": cp.get("alltoall"),
                        "ring_over_torch_cp": _ratio(tok["ring"], best)})
    return out


def _ring_blocks(d):
    by = {(r["n"], r["provider"]): r for r in d["rows"] if "error" not in r}
    out = []
    for (n, provider), r in by.items():
        course = by.get((n, "course"), {})
        out.append(dict(N=n, provider=provider, calls=r["calls"], kernels_ms=r["kernels_ms"], forward_ms=r["forward_ms"],
                        merge_share=100 * (r["forward_ms"] - r["kernels_ms"]) / r["forward_ms"],
                        forward_tflops=r["tflop_fwd"] / r["forward_ms"] * 1e3,
                        backward_ms=r["backward_ms"], course_over_fwd=_ratio(r["forward_ms"], course.get("forward_ms")),
                        course_over_bwd=_ratio(r["backward_ms"], course.get("backward_ms"))))
    return out


def _training(d):
    by = {(r["n"], r["provider"]): r for r in d["rows"] if r["status"] == "ok"}
    out = []
    for n in sorted({r["n"] for r in d["rows"]}):
        c, f, k = (by.get((n, p)) or {} for p in ("course", "sdpa_flash", "sdpa_cudnn"))
        out.append(dict(N=n, B=c.get("batch"), course_ms=c.get("ms"), course_tflops=c.get("tflops"),
                        flash_ms=f.get("ms"), cudnn_ms=k.get("ms"), course_over_flash=_ratio(f.get("ms"), c.get("ms")),
                        course_over_cudnn=_ratio(k.get("ms"), c.get("ms"))))
    return out


def _tune_layout(name: str) -> str:
    if name.startswith("lesson 07"):
        return "lesson 07 (two kernels)"
    mode = name.split()[0]
    return mode + (" + TMA" if name.endswith(" tma") else "")


def _tune_backward(d):
    """Per run, N and causal: lesson 07's kernels and the fastest configuration of each other layout."""
    out = []
    for run, doc in enumerate(d["runs"], 1):
        cases = sorted({(r["n"], r["causal"]) for r in doc["rows"]}, key=lambda c: (not c[1], c[0]))
        for n, causal in cases:
            here = [r for r in doc["rows"] if r["n"] == n and r["causal"] == causal]
            cudnn = next(r for r in here if r["name"] == "sdpa_cudnn")
            best = {}
            for r in here:
                if r.get("bwd_ms") is None or r["name"].startswith("sdpa"):
                    continue
                layout = _tune_layout(r["name"])
                if layout not in best or r["bwd_ms"] < best[layout]["bwd_ms"]:
                    best[layout] = r
            for layout, r in sorted(best.items(), key=lambda kv: kv[1]["bwd_ms"]):
                out.append(dict(run=run, N=n, causal="yes" if causal else "no", layout=layout,
                                config="as lesson 07" if layout.startswith("lesson") else r["name"],
                                bwd_ms=r["bwd_ms"], cudnn_over_bwd=_ratio(cudnn["bwd_ms"], r["bwd_ms"]),
                                cudnn_over_total=_ratio(cudnn["fwd_ms"] + cudnn["bwd_ms"], r["fwd_ms"] + r["bwd_ms"]),
                                spills="—" if r.get("spills") is None else str(r["spills"]),
                                same_bits="yes" if r.get("same_bits") else "no"))
    return out


def _tune_window(d):
    """Per pass, W and S: the launch the window kernels had before, the fastest measured, and Flex's time."""
    out = []
    for mode in ("forward", "forward + backward"):
        cases = sorted({(r["W"], r["S"]) for r in d["rows"] if r["mode"] == mode})
        for w, s in cases:
            here = [r for r in d["rows"] if (r["mode"], r["W"], r["S"]) == (mode, w, s) and r.get("ms")]
            flex = next(r for r in here if r["name"] == "flex")
            before = next(r for r in here if r["name"] in ("course, block_config", "course, default_config", "course, shipped launch"))
            best = min((r for r in here if r["name"] != "flex"), key=lambda r: r["ms"])
            name = best["name"].removeprefix("course ").removeprefix("BackwardConfig")
            out.append(dict(mode=mode, W=w, S=s, before_ms=before["ms"], config=name.strip("()"),
                            best_ms=best["ms"], flex_ms=flex["ms"], before_over_flex=_ratio(flex["ms"], before["ms"]),
                            best_over_flex=_ratio(flex["ms"], best["ms"])))
    return out


def _tune_window_fast(d):
    """Per W, S and N: lesson 08's kernel, the fast window kernel at the launch it ships with and at the fastest."""
    from .kernels.fast_window import hopper_config  # imported here: results.py is read without Triton too

    out = []
    for w, s, n in sorted({(r["W"], r["S"], r["n"]) for r in d["rows"]}):
        here = {r["name"]: r for r in d["rows"] if (r["W"], r["S"], r["n"]) == (w, s, n) and r.get("ms")}
        flex = here["flex"]["ms"]
        cfg = hopper_config(w, 128, n)
        shipped = f"fast {cfg['block_m']}x{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
        best = min((r for r in here.values() if r["name"] != "flex"), key=lambda r: r["ms"])
        out.append(dict(W=w, S=s, N=n, flex_ms=flex,
                        lesson_over_flex=_ratio(flex, (here.get("course, shipped launch") or {}).get("ms")),
                        shipped=shipped.removeprefix("fast "), shipped_over_flex=_ratio(flex, (here.get(shipped) or {}).get("ms")),
                        config=best["name"], best_over_flex=_ratio(flex, best["ms"])))
    return out


def _sm90(d):
    """Lesson 06's fast forward (bf16; also persistent) and lesson 11's FP8 Hopper kernel (D = 128) as compiled for
    sm_90, with and without warp specialisation: ``ws_forward``, ``ws_persistent_forward`` and ``fp8_ws`` of
    ``benchmarks/compile_sm90.py``."""
    out = []
    for section, kernel in (("ws_forward", "bf16 forward (lesson 06)"), ("ws_persistent_forward", "bf16 forward (lesson 06)"),
                            ("fp8_ws", "FP8 forward (lesson 11)")):
        for r in d.get(section, []):
            if r.get("error") or r.get("head_dim", 128) != 128:
                continue
            raised = [int(v) for op, v in r["setmaxnreg"] if op == "inc" and int(v) < 256]
            launch = f"{r['block_m']} x {r['block_n']}, {r['num_stages']} stages"
            if r.get("persistent"):
                launch += ", persistent"
            if r.get("maxnreg"):
                launch += f", at most {r['maxnreg']} registers"
            out.append(dict(kernel=kernel, causal=r["causal"], launch=launch, warp_specialize=r["warp_specialize"],
                            warps=r["warps"], registers=r["registers"],
                            setmaxnreg=str(max(raised)) if raised else None, spills=r["spills"],
                            shared_kib=r["shared"] / 1024,
                            partitions=" ".join(f"({loads}, {dots})" for _, dots, loads in r.get("partitions", []))
                            or None))
    return out


def _loop_of(row) -> str:
    """A probe row's consumer loop: ``loop`` as the kept probe writes it, or the first runs' ``pipeline`` flag."""
    return row.get("loop") or ("pipelined" if row.get("pipeline") else "serial")


def _hopper_ws(d):
    """The timed rows of ``benchmarks/hopper_ws_probe.py`` (lesson 11's Gluon kernel, ``kernels.hopper_ws``)."""
    return [dict(run=r.get("run", 1), loop=_loop_of(r), fma=r.get("fma", False), persistent=r.get("persistent", False),
                 num_buffers=r["num_buffers"], causal=r["causal"], N=r["n"], B=r["b"], hopper_ws=r["hopper_ws"],
                 cudnn=r["cudnn"], course=r["course"], over_cudnn=_ratio(r["hopper_ws"], r["cudnn"]),
                 over_course=_ratio(r["hopper_ws"], r["course"]), rel_rms=r.get("rel_rms"))
            for r in d["rows"] if r["mode"] == "speed" and "hopper_ws" in r]


def _hopper_ws_bwd(d):
    """The timed rows of ``hopper_ws_probe.py --kind bwd``: the Gluon backward (``kernels.hopper_ws_bwd``) beside
    lesson 07's pair and cuDNN's backward; ``train_over_cudnn`` is cuDNN's forward + backward time over the course's
    forward with this backward."""
    return [dict(block_m=r["block_m"], dq_kernel=r["dq_kernel"], dq_block_n=r["dq_block_n"],
                 num_buffers=r["num_buffers"], causal=r["causal"], N=r["n"], B=r["b"], hopper_ws=r["hopper_ws"],
                 course=r["course"], cudnn=r["cudnn"], over_cudnn=_ratio(r["hopper_ws"], r["cudnn"]),
                 over_course=_ratio(r["hopper_ws"], r["course"]), train_over_cudnn=r["train_over_cudnn"])
            for r in d["rows"] if r["mode"] == "speed" and "hopper_ws" in r]


_ROWS = {"window_bench": _window, "mods_bench": _mods, "decode_bench": _decode, "decode_splits": _decode_splits,
         "decode_variants": _decode_variants,
         "ring_bench": _ring, "ring_blocks": _ring_blocks, "training_bench": _training,
         "tune_backward": _tune_backward, "tune_window": _tune_window, "tune_window_fast": _tune_window_fast,
         "sm90_compiles": _sm90, "hopper_ws_probe": _hopper_ws,
         "hopper_ws_probe_h100": _hopper_ws, "hopper_ws_fp8_probe_h100": _hopper_ws,
         "hopper_ws_probe_overlap_h100": _hopper_ws, "hopper_ws_fp8_probe_overlap_h100": _hopper_ws,
         "hopper_ws_bwd_probe_h100": _hopper_ws_bwd}


def rows(name: str, *, doc: dict | None = None, **where) -> list[dict]:
    """The table's rows (dicts keyed as in ``COLUMNS[name]``), those matching ``where``.

    ``where`` maps a key to a value, a tuple of values, or a predicate: ``rows("decode_bench",
    B=lambda b: b <= 16)``. ``doc``: a bench's JSON document not yet written to ``results/``
    (default: the recorded one).
    """
    if name not in _ROWS:
        raise KeyError(f"no table for {name!r}: the known ones are {', '.join(_ROWS)}")

    def keep(row):
        for key, want in where.items():
            got = row[key]
            if callable(want) and not want(got) or isinstance(want, tuple) and got not in want:
                return False
            if not callable(want) and not isinstance(want, tuple) and got != want:
                return False
        return True

    return [r for r in _ROWS[name](load(name) if doc is None else doc) if keep(r)]


def _fmt(value, fmt: str, unit: str = "") -> str:
    if value is None:
        return "—"
    return (format(value, fmt) if fmt else str(value)) + unit


def _column(name, key):
    for col in COLUMNS[name]:
        if col[0] == key:
            return col
    raise KeyError(f"{name} has no column {key!r}: its columns are {', '.join(c[0] for c in COLUMNS[name])}")


def value_range(values, fmt: str = ".2f", unit: str = "×") -> str:
    """``values`` as the lessons write a range: ``"0.85–1.05×"``, one value when both ends round alike."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def figure(name: str, key: str, stat: str = "range", **where) -> str:
    """One recorded number of column ``key``, over the rows matching ``where``, as the lessons write it.

    ``stat`` is ``"range"`` (``"0.85–1.05×"``; one value when both ends round alike), ``"min"``,
    ``"max"``, ``"median"`` or ``"value"`` (exactly one row must match).
    """
    _, _, fmt, unit = _column(name, key)
    values = [r[key] for r in rows(name, **where) if r[key] is not None]
    if not values:
        raise ValueError(f"no recorded {key} in {name} for {where}")
    if stat == "range":
        return value_range(values, fmt, unit)
    if stat == "value" and len(values) != 1:
        raise ValueError(f"{len(values)} rows of {name} match {where}, not one")
    pick = {"min": min, "max": max, "median": statistics.median, "value": lambda v: v[0]}[stat]
    return _fmt(pick(values), fmt, unit)


def markdown(name: str, columns: list[str] | None = None, *, doc: dict | None = None, **where) -> str:
    """The recorded table as markdown: the chosen ``columns`` (default all) of the rows matching ``where``
    (of ``doc``, a bench's document, if given: see :func:`rows`)."""
    cols = [_column(name, k) for k in (columns or [c[0] for c in COLUMNS[name]])]
    info = load(name) if doc is None else doc
    info = info.get("info") or info.get("meta") or {}
    where_run = info.get("gpu") or (f"{info['target']}, compiled without a GPU by triton {info.get('triton', '?')}"
                                    if "target" in info else "?")
    lines = [f"Recorded on {where_run}, {info.get('date', '?')} (`results/{name}.json`).", "",
             "| " + " | ".join(c[1] for c in cols) + " |",
             "|" + "|".join("---" if c[2] == "" else "---:" for c in cols) + "|"]
    for r in rows(name, doc=doc, **where):
        lines.append("| " + " | ".join(_fmt(r[c[0]], c[2], c[3]) for c in cols) + " |")
    return "\n".join(lines)


def counter_lines(name: str) -> list[str]:
    """One line per kernel of a recorded ``benchmarks/ncu_forward.py`` run (``ncu_forward_h100`` and the like): its
    time, tensor-pipe share, registers, spill instructions and largest stalls."""
    lines = []
    for kernel, c in load(name)["kernels"].items():
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in c["top_stalls"].items())
        lines.append(f"{kernel:24s} {c['duration_us']:5.0f} us  tensor pipes {c['tensor_pipe_pct']:4.1f}%  "
                     f"{c['registers_per_thread']:.0f} registers, {c['spill_instructions']:.0f} spill instructions  "
                     f"stalls: {stalls}")
    return lines


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def table(name: str, columns: list[str] | None = None, **where) -> str | None:
    """Show the recorded table of benchmark ``name`` (see :func:`markdown`).

    In a notebook it is displayed as markdown and nothing is returned; elsewhere the markdown
    string is returned.
    """
    text = markdown(name, columns, **where)
    if not _in_notebook():
        return text
    from IPython.display import Markdown, display

    display(Markdown(text))
    return None
