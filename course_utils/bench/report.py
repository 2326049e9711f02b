"""Writing results: CSV, JSON and markdown tables; reading the recorded ones back."""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import json
import platform
from pathlib import Path

from .cases import ALL_PROVIDERS, CSV_FIELDS, LABELS, LESSON11_RATIOS, RATIOS, RESULTS_DIR, STEM, Case


def write_sweep(path, rows: list[dict]) -> None:
    """A tuning script's measured ``rows`` as JSON at ``path``, with :func:`environment_info` beside them."""
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps(dict(info=environment_info(), rows=rows), indent=1) + "\n")
    print(f"wrote {path}")


def environment_info() -> dict:
    """GPU name, versions and date, recorded next to every result."""
    info = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = torch.cuda.get_device_name()
            info["capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
            info["sm_count"] = p.multi_processor_count
            info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
            info["cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        pass
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def ratio_table(rows: list[dict]) -> dict:
    """``{(case, n): {"fast/sdpa_flash": x, ...}}`` from the rows' TFLOP/s (lesson 11's ratios where a run timed
    those providers)."""
    by = {}
    for r in rows:
        by.setdefault((r["case"], r["n"]), {})[r["provider"]] = r["tflops"]
    out = {}
    for key, t in by.items():
        out[key] = {
            f"{a}/{b}": (t[a] / t[b]) if t.get(a) and t.get(b) else None for a, b in _ratios(rows)
        }
    return out


def _ratios(rows: list[dict]) -> tuple:
    """The ratio columns: ``RATIOS``, then lesson 11's of the providers these rows hold."""
    timed = {r["provider"] for r in rows}
    return RATIOS + tuple(pair for pair in LESSON11_RATIOS if pair[0] in timed)


def _cell(row: dict | None, field: str, fmt: str) -> str:
    if row is None:
        return "-"
    if row.get(field) is None:
        return row.get("status", "-") if row.get("status") != "ok" else "-"
    return format(row[field], fmt)


def find_row(rows: list[dict], provider: str, mode: str, n: int, case: dict) -> dict | None:
    """Lessons 08 and 12's benches: the row of ``provider`` in ``mode`` ("forward" or "training") at ``n`` whose
    fields match ``case`` (``{"window_size": 1024, "sink_size": 4}``, ...); the plain causal rows match any case."""
    for r in rows:
        if (r["provider"], r["mode"], r["n"]) == (provider, mode, n) and (
                provider == "causal" or all(r[f] == value for f, value in case.items())):
            return r
    return None


def course_over_flex(rows: list[dict], fields: tuple) -> list[dict]:
    """course / FlexAttention TFLOP/s for every (mode, the case's ``fields``, N) where both were timed."""
    out = []
    for r in rows:
        if r["provider"] != "course" or not r["tflops"]:
            continue
        case = {f: r[f] for f in fields}
        flex = find_row(rows, "flex", r["mode"], r["n"], case)
        if flex and flex["tflops"]:
            out.append(dict(mode=r["mode"], **case, n=r["n"], course_over_flex=r["tflops"] / flex["tflops"]))
    return out


def merge_rows_by(old: list[dict], new: list[dict], key) -> list[dict]:
    """``old`` with every row that ``new`` measures again replaced (the same ``key(row)``), then the rest of
    ``new``: a sweep split over several runs (``--append``)."""
    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + list(new)


def markdown_tables(rows: list[dict], cases: list[dict] | None = None, info: dict | None = None) -> str:
    """The results as markdown: per case, TFLOP/s with ratio columns, then peak memory."""
    lines = []
    if info:
        lines.append(
            f"Measured on {info.get('gpu', '?')} ({info.get('date', '?')}): torch {info.get('torch', '?')}, "
            f"triton {info.get('triton', '?')}, CUDA {info.get('cuda', '?')}, cuDNN {info.get('cudnn', '?')}. "
            "Forward pass, median of `triton.testing.do_bench`; TFLOP/s = 4·B·Hq·N²·D / time, halved when causal."
        )
        lines.append("")
    titles = {c["name"]: c for c in (cases or [])}
    ratios = ratio_table(rows)
    case_names = list(dict.fromkeys(r["case"] for r in rows))
    providers = [p for p in ALL_PROVIDERS if any(r["provider"] == p for r in rows)]
    ratio_pairs = _ratios(rows)
    for name in case_names:
        crows = [r for r in rows if r["case"] == name]
        c = titles.get(name)
        title = Case(**{**c, "ns": tuple(c["ns"])}).title() if c else name
        lines.append(f"### {name}: {title}")
        lines.append("")
        head = ["N", "B"] + [LABELS[p] for p in providers] + [f"{a}/{b.replace('sdpa_', '')}" for a, b in ratio_pairs]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---:|" * len(head))
        for n in list(dict.fromkeys(r["n"] for r in crows)):
            at = {r["provider"]: r for r in crows if r["n"] == n}
            b = next(iter(at.values()))["batch"]
            cells = [str(n), str(b)] + [_cell(at.get(p), "tflops", ".0f") for p in providers]
            for a, bb in ratio_pairs:
                x = ratios.get((name, n), {}).get(f"{a}/{bb}")
                cells.append("-" if x is None else f"{x:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"Peak memory per call (MiB, output included), {name}:")
        lines.append("")
        head = ["N"] + [LABELS[p] for p in providers]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---:|" * len(head))
        for n in list(dict.fromkeys(r["n"] for r in crows)):
            at = {r["provider"]: r for r in crows if r["n"] == n}
            lines.append("| " + " | ".join([str(n)] + [_cell(at.get(p), "peak_mib", ".0f") for p in providers]) + " |")
        lines.append("")
        notes = sorted({f"{LABELS[r['provider']]}: {r['note']}" for r in crows if r["note"] and r["provider"] != "fast"})
        configs = [f"N={r['n']}: {r['note']}" for r in crows if r["provider"] == "fast" and r["note"]]
        if configs:
            lines.append("Fast kernel's autotuned configs: " + "; ".join(configs) + ".")
            lines.append("")
        for note in notes:
            lines.append(f"- {note}")
        if notes:
            lines.append("")
    return "\n".join(lines)


def ladder_markdown(ladder: dict) -> str:
    """The tuning ladder as a markdown table (TFLOP/s per step and N)."""
    ns = ladder["ns"]
    lines = ["### Tuning ladder (main case): each step adds one idea", ""]
    lines.append("| step | what changed | " + " | ".join(f"N={n}" for n in ns) + " |")
    lines.append("|---|---|" + "---:|" * len(ns))
    steps = list(dict.fromkeys(s["step"] for s in ladder["steps"]))
    for step in steps:
        cells, what = [], ""
        for n in ns:
            s = next((s for s in ladder["steps"] if s["step"] == step and s["n"] == n), None)
            what = s["what"] if s else what
            if s and s.get("detail") and step == "05 tuned launch":
                what = f"same kernel, {s['detail']}"
            cells.append(f"{s['tflops']:.0f}" if s and s["tflops"] else (s["status"][:20] if s else "-"))
        lines.append(f"| {step} | {what} | " + " | ".join(cells) + " |")
    for name in ("sdpa_flash", "sdpa_cudnn"):
        cells = []
        for n in ns:
            s = next((s for s in ladder["sdpa"] if s["provider"] == name and s["n"] == n), None)
            cells.append(f"{s['tflops']:.0f}" if s and s["tflops"] else "-")
        lines.append(f"| {LABELS[name]} | for scale | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in CSV_FIELDS})


def read_csv(path: Path) -> list[dict]:
    """Rows of a results CSV, with numbers as numbers and empty cells as ``None``."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = dict(r)
            for k in ("batch", "n_q_heads", "n_kv_heads", "n", "head_dim"):
                row[k] = int(row[k])
            for k in ("ms", "tflops", "peak_mib", "rel_err"):
                row[k] = float(row[k]) if row[k] not in ("", "None") else None
            row["causal"] = row["causal"] == "True"
            out.append(row)
    return out


def write_results(rows, out_dir, info=None, cases=None, ceilings=None, ladder=None, stem=STEM, plot=True) -> dict:
    """Write CSV, JSON, markdown (and the PNG plot) for ``rows``; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [dataclasses.asdict(c) if isinstance(c, Case) else c for c in (cases or [])]
    for c in cases:
        c["ns"] = list(c["ns"])
    paths = {k: out_dir / f"{stem}.{k}" for k in ("csv", "json", "md", "png")}
    write_csv(rows, paths["csv"])
    doc = {"info": info or {}, "cases": cases, "ceilings": ceilings, "rows": rows, "ladder": ladder}
    paths["json"].write_text(json.dumps(doc, indent=1))
    md = markdown_tables(rows, cases, info)
    if ceilings:
        md += (f"\nMachine ceilings: {ceilings['matmul_dtype']} {ceilings['matmul_size']}³ matmul "
               f"{ceilings['matmul_tflops']:.0f} TFLOP/s, device copy {ceilings['copy_gbps']:.0f} GB/s.\n")
    if ladder:
        md += "\n" + ladder_markdown(ladder)
    paths["md"].write_text(md)
    if plot and rows:
        try:
            from .plots import plot_results

            plot_results(rows, paths["png"], cases)
        except ImportError:
            paths.pop("png")
    else:
        paths.pop("png")
    return paths


def recorded_results_path() -> Path | None:
    """Where the shipped results are: ``results/`` in a checkout, else ``course_utils/data/`` (:func:`course_utils.results.path`)."""
    from .. import results

    try:
        return results.path(STEM)
    except FileNotFoundError:
        return None


def load_results(path: Path | str | None = None) -> dict:
    """The recorded results (``info``, ``cases``, ``ceilings``, ``rows``, ``ladder``)."""
    path = path or recorded_results_path()
    if path is None:
        raise FileNotFoundError(
            f"no recorded results: {RESULTS_DIR / (STEM + '.json')} is missing (run `python -m course_utils.bench` on a GPU)"
        )
    return json.loads(Path(path).read_text())
