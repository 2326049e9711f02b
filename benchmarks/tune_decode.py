"""Time lesson 09's decode kernels at other launch configurations and split counts, beside SDPA's cuDNN.

``decode_config`` launches the split kernel with 64-key blocks, 4 warps and 3
stages on an H200, and ``pick_num_splits`` chooses the split count. This
script times every (``BLOCK_N``, ``num_warps``, ``num_stages``) of
:data:`CANDIDATES` at every split count the launcher allows, at the points
where ``results/decode_bench.md`` falls short of SDPA's best backend (small
contexts; B = 64), against SDPA's cuDNN and flash backends and the read
ceiling in the same run. Each launch's output is checked against a float32
reference first; every provider is replayed from a CUDA graph, as the decode
benchmark does. It also records what each configuration compiled to and how
many of its programs fit on one SM, and marks the launch the course ships
(``decode.launch_config`` at ``pick_num_splits``'s count).

``--paged`` copies the caches into shuffled pages of ``PAGE_SIZE`` tokens, as
the decode benchmark's paged column does, and times the paged launches
(``pick_num_splits(..., paged=True)`` picks the shipped count); ``--points
B:L ...`` replaces :data:`POINTS`, ``--candidates`` :data:`CANDIDATES` and ``--counts`` :data:`COUNTS`.

``--lean`` times the equal-shares schedule instead (``course_utils.kernels.fast_decode``) at
:data:`PER_SM` programs per SM, beside lesson 09's splits (``decode.launch_decode``), the same kernels with
the combine launched by PDL at lesson 09's count and at twice it (``fast_decode.launch_pdl_splits``), and
SDPA's cuDNN, at every point of the decode benchmark's grid (or ``--points``), two rounds; each row marks what
the package's ``decode_attention`` runs there (``fast_decode.launch_choice``). ``results/tune_decode_lean.json``
and ``results/pdl_splits.json`` hold the scratch runs this replaces (same launches, rows in another shape).

    python benchmarks/tune_decode.py [--out results/tune_decode.json] [--paged] [--points 4:65536 16:16384]
                                     [--candidates 64:4:3 128:4:2] [--counts 1 2 4 33]
    python benchmarks/tune_decode.py --lean [--points 1:131072] [--out DIR]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)
from course_utils import bench
from course_utils.bench import decode as db

POINTS = ((1, 1024), (4, 1024), (16, 1024), (16, 4096), (64, 1024), (64, 4096))  # (batch, context)
# (BLOCK_N, num_warps, num_stages); the first is decode_config's choice on an H200
CANDIDATES = [
    (64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 2, 3), (64, 8, 3),
    (32, 4, 3), (32, 4, 4), (32, 2, 4), (128, 4, 2), (128, 8, 2),
]
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def launch(q, k, v, seqlens, num_splits, block_n, num_warps, num_stages, kernel=None, block_table=None):
    """One decode call at a fixed configuration: the split kernel, then the combine (more than one split).
    With ``block_table``, ``k`` and ``v`` are pages."""
    import torch

    from course_utils.kernels import decode

    out = torch.empty_like(q)
    opts = dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, kernel=kernel)
    if num_splits == 1:
        return decode.decode_split(q, k, v, seqlens, 1, block_table, out=out, **opts)[0]
    o_parts, lse_parts = decode.decode_split(q, k, v, seqlens, num_splits, block_table, **opts)
    return decode.decode_combine(o_parts, lse_parts, out)


def shipped_launch(q, k, num_splits, block_table=None) -> tuple:
    """``(BLOCK_N, num_warps, num_stages)`` that the course launches at ``num_splits`` for these inputs."""
    from course_utils.kernels import decode

    cfg = decode.launch_config(q, k, num_splits, block_table)
    return cfg["BLOCK_N"], cfg.get("num_warps"), cfg.get("num_stages")  # the interpreter sets BLOCK_N only


def parse_point(text: str) -> tuple[int, int]:
    """``"4:65536"`` -> ``(4, 65536)``: a batch size and a context."""
    batch, _, context = text.partition(":")
    return int(batch), int(context)


def parse_candidate(text: str) -> tuple[int, int, int]:
    """``"64:4:3"`` -> ``(64, 4, 3)``: ``BLOCK_N``, ``num_warps`` and ``num_stages``."""
    block_n, warps, stages = (int(x) for x in text.split(":"))
    return block_n, warps, stages


def allowed_counts(context: int, block_n: int, counts=COUNTS) -> list[int]:
    """The split counts of ``counts`` the launcher allows at ``context`` with ``block_n``-key blocks (at least 4
    blocks each)."""
    from course_utils.kernels import decode

    most = decode._max_splits(-(-context // block_n))
    return [s for s in counts if s <= most]


def compiled(q, k, v, seqlens, block_n, num_warps, num_stages, block_table=None) -> dict:
    """Registers, shared memory and programs per SM of the split kernel at one configuration."""
    from course_utils.kernels import decode

    rec = db._Recorder(decode._decode_split_kernel)
    launch(q, k, v, seqlens, 2, block_n, num_warps, num_stages, kernel=rec, block_table=block_table)
    c = rec.compiled
    n_regs, shared = int(c.n_regs), int(c.metadata.shared)
    return dict(n_regs=n_regs, shared_bytes=shared, programs_per_sm=db.programs_per_sm(n_regs, num_warps, shared))


def measure(batch: int, context: int, rep_ms: int = 30, paged: bool = False, candidates=CANDIDATES,
            counts=COUNTS) -> list[dict]:
    import torch
    import triton

    from course_utils.kernels import decode

    q, k, v, seqlens, refs, nbytes = db.point_inputs(batch, context)
    key = dict(batch=batch, context=context, paged=paged)
    rows = []

    def timed(name, fn, **extra):
        row = dict(key, name=name, gbps=None, **extra)
        try:
            ms, gbps = db.checked_gbps(fn, refs, nbytes, rep_ms)
            row.update(ms=ms, gbps=gbps)
        except Exception as exc:  # one configuration failing must not stop the sweep
            row["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
        rows.append(row)
        return row

    ceiling_fn, _ = db.make_provider("ceiling", q, k, v, seqlens)
    ceiling = db.gb_per_s(nbytes, triton.testing.do_bench(ceiling_fn, warmup=10, rep=rep_ms, return_mode="median"))
    for name in ("sdpa_cudnn", "sdpa_flash"):
        fn, _ = db.make_provider(name, q, k, v, seqlens)
        timed(name, fn)
    table = None
    if paged:  # the SDPA rows above read the contiguous caches, as in the decode benchmark
        k, v, table = db.paged_copy(k, v, db.PAGE_SIZE)
    pick = decode.launch_splits(q, k, table)  # the count the course launches (paged: pick_num_splits(paged=True))
    ships = shipped_launch(q, k, pick, table)
    for block_n, warps, stages in candidates:
        info = compiled(q, k, v, seqlens, block_n, warps, stages, table)
        for s in allowed_counts(context, block_n, counts):
            timed(f"course {block_n} w{warps} s{stages} splits {s}" + (" paged" if paged else ""),
                  lambda s=s, c=(block_n, warps, stages): launch(q, k, v, seqlens, s, *c, block_table=table),
                  block_n=block_n, num_warps=warps, num_stages=stages, num_splits=s,
                  shipped=(block_n, warps, stages) == ships and s == pick, **info)
    best_sdpa = max((r["gbps"] or 0) for r in rows if r["name"].startswith("sdpa"))
    print(f"\n== B={batch} context={context}: ceiling {ceiling:.0f} GB/s, SDPA best {best_sdpa:.0f} GB/s")
    for r in sorted(rows, key=lambda r: -(r["gbps"] or 0))[:12] + [r for r in rows if r.get("shipped")]:
        what = f"{r['gbps']:6.0f} GB/s {r['gbps'] / best_sdpa:.2f}x SDPA best {r['gbps'] / ceiling:.0%} ceiling" \
            if r["gbps"] else r.get("note", "")
        regs = f" ({r['n_regs']} regs, {r['shared_bytes'] // 1024} KiB, {r['programs_per_sm']}/SM)" if "n_regs" in r else ""
        print(f"  {r['name']:<34} {what}{regs}{'  <- shipped' if r.get('shipped') else ''}")
    for r in rows:
        r.update(ceiling_gbps=ceiling, sdpa_best_gbps=best_sdpa)
    del q, k, v
    torch.cuda.empty_cache()
    return rows


PER_SM = (1, 2, 3, 4)  # programs per SM the equal shares are cut for (--lean)


def lean_launches(q, k, v, seqlens, n_sms: int, per_sm=PER_SM) -> dict:
    """``{name: (fn, extra)}``: lesson 09's splits, the same kernels with the PDL combine at lesson 09's count
    (``pdl splits``) and, where lesson 09 splits and its blocks allow, at twice it (``pdl x2``, splits of at least
    2 blocks), the equal shares at each ``per_sm``, and the package's choice (``fast_decode.launch_choice``)."""
    import triton

    from course_utils.kernels import decode, fast_decode

    splits = decode.launch_splits(q, k)
    out = {"splits (lesson 09)": ((lambda: decode.launch_decode(q, k, v, seqlens)), dict(num_splits=splits)),
           "pdl splits": ((lambda: fast_decode.launch_pdl_splits(q, k, v, seqlens, splits)), dict(num_splits=splits))}
    block_n = decode.decode_config(q.shape[3], q.dtype, q.device)["BLOCK_N"]
    doubled = min(2 * splits, triton.cdiv(k.shape[2], block_n) // 2, decode.MAX_SPLITS)
    if splits > 1 and doubled > splits:
        out["pdl x2"] = ((lambda: fast_decode.launch_pdl_splits(q, k, v, seqlens, doubled)), dict(num_splits=doubled))
    for n in per_sm:
        plan, _ = fast_decode.plan_of(q, k, n_sms=n_sms, programs_per_sm=n)
        out[f"lean p{n}"] = ((lambda n=n: fast_decode.launch(q, k, v, seqlens, n_sms=n_sms, programs_per_sm=n)),
                             dict(programs_per_sm=n, share=plan.share, programs=plan.programs))
    out["package"] = ((lambda: fast_decode.launch_decode(q, k, v, seqlens)),
                      dict(runs=fast_decode.launch_choice(q, k)))
    return out


def measure_lean(batch: int, context: int, rep_ms: int = 40, rounds: int = 2, per_sm=PER_SM) -> list[dict]:
    """GB/s of every :func:`lean_launches` entry and SDPA's cuDNN at one point, ``rounds`` times, each checked."""
    import torch

    from course_utils.kernels import decode

    q, k, v, seqlens, refs, nbytes = db.point_inputs(batch, context)
    fns = {"sdpa_cudnn": (db.make_provider("sdpa_cudnn", q, k, v, seqlens)[0], {})}
    fns.update(lean_launches(q, k, v, seqlens, decode._sm_count(q.device), per_sm))
    rows = []
    for rnd in range(rounds):
        for name, (fn, extra) in fns.items():
            row = dict(batch=batch, context=context, round=rnd, name=name, gbps=None, **extra)
            try:
                row["ms"], row["gbps"] = db.checked_gbps(fn, refs, nbytes, rep_ms)
            except Exception as exc:  # one launch failing must not stop the sweep
                row["note"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ''}"
            rows.append(row)
    cudnn = max((r["gbps"] or 0) for r in rows if r["name"] == "sdpa_cudnn")
    print(f"\n== B={batch} context={context}: cuDNN {cudnn:.0f} GB/s")
    for name in fns:
        got = [r["gbps"] for r in rows if r["name"] == name and r["gbps"]]
        print(f"  {name:<20} " + " ".join(f"{g / cudnn:.3f}x" for g in got))
    for r in rows:
        r["over_cudnn"] = r["gbps"] / cudnn if r["gbps"] and cudnn else None
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--paged", action="store_true", help="time paged caches (shuffled pages)")
    parser.add_argument("--points", type=parse_point, nargs="+", default=None, metavar="B:L",
                        help="batch:context points instead of POINTS")
    parser.add_argument("--candidates", type=parse_candidate, nargs="+", default=CANDIDATES, metavar="BN:W:S",
                        help="BLOCK_N:num_warps:num_stages launches instead of CANDIDATES")
    parser.add_argument("--counts", type=int, nargs="+", default=COUNTS, help="split counts instead of COUNTS")
    parser.add_argument("--lean", action="store_true", help="time the equal-shares schedule (fast_decode) instead")
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0
    if args.lean:
        rows = [r for b, n in (args.points or db.grid(16.0)) for r in measure_lean(b, n)]
        if args.out:
            bench.write_sweep(args.out, rows)
        return 0
    rows = [r for b, n in (args.points or POINTS)
            for r in measure(b, n, paged=args.paged, candidates=args.candidates, counts=args.counts)]
    if args.out:
        bench.write_sweep(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
