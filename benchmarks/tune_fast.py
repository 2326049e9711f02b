"""Time the fast kernel at fixed launch configurations, side by side with SDPA.

The autotuner picks one configuration per problem and hides the others; this
script shows them all, so that a change to the kernel or to its search space
(``course_utils.kernels.fast.CONFIG_SPACE``) is decided on measured numbers.
Every configuration is checked against a float32 reference before it is
timed, and SDPA's flash and cuDNN backends are timed on the same inputs in
the same run (ratios between runs are not comparable: clocks and the card's
temperature move).

    python benchmarks/tune_fast.py [--ns 4096 16384] [--case main] [--variants-only] [--out tune.json]

Needs a CUDA GPU (Hopper for TMA and warp specialisation). For each
configuration it also prints registers per thread, spills and shared memory,
which decide how many programs fit on one SM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)
from course_utils import bench

ROOT = Path(__file__).resolve().parent.parent

LF = 1  # fast.ORDER_LONGEST_FIRST
MM = 0  # fast.ORDER_M_MAJOR
KV = 2  # fast.ORDER_KV_GROUPED

# (BLOCK_M, BLOCK_N, num_warps, num_stages, order, warp_specialize, pipeline_qk)
CANDIDATES = [
    # one program per SM: two warpgroups (8 warps) on 128 x 128 tiles
    (128, 128, 8, 2, KV, False, False),
    (128, 128, 8, 3, KV, False, False),
    (128, 128, 8, 3, LF, False, False),
    (128, 128, 8, 3, MM, False, False),
    (128, 128, 8, 3, KV, True, False),
    (128, 64, 8, 2, KV, False, False),
    (256, 64, 8, 2, KV, False, False),
    # one warpgroup (4 warps): two programs per SM when shared memory allows
    (128, 64, 4, 2, KV, False, False),
    (128, 64, 4, 2, LF, False, False),
    (128, 64, 4, 2, MM, False, False),
    (128, 64, 4, 3, KV, False, False),
    (128, 32, 4, 3, KV, False, False),
    (64, 32, 4, 2, KV, False, False),  # 48 KiB, 139 registers: three programs per SM
    (64, 64, 4, 2, KV, False, False),
    (64, 64, 4, 3, KV, False, False),
    (64, 64, 4, 3, MM, False, False),
    # Q K^T pipelined by hand: a second score tile in registers
    (128, 128, 8, 2, KV, False, True),
    (128, 64, 8, 3, KV, False, True),
    (128, 64, 4, 2, KV, False, True),
    (64, 64, 4, 2, KV, False, True),
]


# Other launch options, each on top of one configuration above.
VARIANTS = [
    ((128, 64, 4, 2, KV, False, False), dict(lazy_rescale=True)),
    ((128, 64, 4, 2, KV, False, False), dict(use_tma=False)),
    # registers capped so that more programs fit on an SM (shared memory allows it):
    ((128, 64, 8, 2, KV, False, False), dict(maxnreg=128)),  # two 8-warp programs
    ((128, 32, 4, 2, KV, False, False), dict(maxnreg=168)),  # three 4-warp programs
    # half of each tile's exponentials on the FMA units (fast._exp_scores, FlashAttention-4's cubic):
    ((128, 64, 4, 2, KV, False, False), dict(exp_poly=True)),
    ((128, 128, 8, 3, KV, False, False), dict(exp_poly=True)),
    # warp specialisation of one warpgroup (twenty-sixth session, not yet timed): Triton 3.6 compiles it for
    # sm_90 into FlashAttention-3's shape, a producer partition and two consumer warpgroups of 64 rows (12 warps,
    # 168 registers, no spills; 112 / 144 / 176 KiB for 128 x 64 on 2 or 3 stages and 128 x 128 on 2), once the
    # output goes by pointers; causal needs the one-loop form (every block masked), timed without warp
    # specialisation too so that the two effects can be told apart.
    ((128, 64, 4, 2, KV, False, False), dict(two_phase=False)),
    ((128, 64, 4, 2, KV, True, False), dict(two_phase=False)),
    ((128, 64, 4, 3, KV, True, False), dict(two_phase=False)),
    ((128, 128, 4, 2, KV, True, False), dict(two_phase=False)),
    # persistent and specialised, FlashAttention-3's layout (twenty-seventh session, not yet timed): one program
    # per SM walks the tiles, the tile loop specialised, so the producer loads the next tile while the consumers
    # finish the last one; compiled for sm_90 with triton 3.6, 12 warps of 168 registers, no spills, 144 / 208 KiB
    # (results/sm90_compiles.json's ws_persistent_forward)
    # (On the H200 every one-warpgroup specialised kernel deadlocks, results/ws_smoke_h200.txt: these four and
    # the two below are refused there, fast.refuse_specialised_on_gpu, and recorded as errors.)
    ((128, 64, 4, 2, KV, True, False), dict(two_phase=False, persistent=True)),
    ((128, 128, 4, 2, KV, True, False), dict(two_phase=False, persistent=True)),
]


def launch_options(c, extra=None) -> dict:
    """:func:`fast.launch` keywords for one candidate."""
    bm, bn, w, s, order, ws, pipe = c
    return dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, order=order, warp_specialize=ws,
                pipeline_qk=pipe, **(extra or {}))


def label(c, extra=None) -> str:
    bm, bn, w, s, order, ws, pipe = c
    tags = ("+ws" if ws else "") + ("+pipe" if pipe else "") + {LF: "", MM: " in-order", KV: " kv-grouped"}[order]
    tags += "".join(f" {k}={v}" for k, v in (extra or {}).items())
    return f"{bm}x{bn} w{w} s{s}{tags}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--case", default=bench.STANDARD_SUITE[0].name,
                        choices=[c.name for c in bench.STANDARD_SUITE])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--variants-only", action="store_true",
                        help="only the VARIANTS and the configurations they start from")
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0

    import torch
    import triton

    from course_utils.kernels import fast

    case = next(c for c in bench.STANDARD_SUITE if c.name == args.case)
    rows, broken = [], {}
    for n in args.ns:
        q, k, v = bench.make_inputs(case, n, seed=2)
        ref = bench.reference_slice(q, k, v, case.causal)
        flops = bench.attention_flops(case.batch(n), case.n_q_heads, n, case.head_dim, case.causal)
        found = {}

        def timed(name, fn, info=""):
            try:
                rel, _ = bench.check_output(fn(), ref)
                if not rel <= bench.TOLERANCE:
                    raise RuntimeError(f"wrong: relative error {rel:.2e}")
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                t = bench.tflops(flops, ms)
                found[name] = t
                info = f"{info}, err {rel:.1e}" if info else f"err {rel:.1e}"
                rows.append(dict(n=n, name=name, tflops=t, info=info))
            except Exception as exc:  # one configuration failing must not stop the sweep
                msg = str(exc).strip().splitlines()[0][:150] if str(exc).strip() else ""
                broken.setdefault(name, f"{type(exc).__name__}: {msg}")
                rows.append(dict(n=n, name=name, tflops=None, info=broken[name]))

        for name in ("sdpa_flash", "sdpa_cudnn"):
            fn, _ = bench.make_provider(name, q, k, v, case.causal)
            timed(name, fn)
        if not args.variants_only:
            timed("autotuned (current space)", lambda: fast.attention_forward_fast(q, k, v, causal=case.causal),
                  fast.best_config(case.causal) or "")
        todo = [(c, None) for c in CANDIDATES] + VARIANTS
        if args.variants_only:
            todo = list(dict.fromkeys((c, None) for c, _ in VARIANTS)) + VARIANTS
        for c, extra in todo:
            name = label(c, extra)
            if name in broken:
                continue

            def run(opts=launch_options(c, extra)):
                return fast.launch(q, k, v, case.causal, **opts)

            info = ""
            try:
                run()
                ck = fast.LAST_LAUNCH["compiled"]
                info = f"regs {ck.n_regs}, spills {ck.n_spills}, smem {ck.metadata.shared // 1024} KiB"
            except Exception:
                pass
            timed(name, run, info)
        flash, cudnn = found.get("sdpa_flash"), found.get("sdpa_cudnn")
        print(f"\n== {case.name}  N={n}  flash {flash and round(flash)}  cuDNN {cudnn and round(cudnn)} TFLOP/s")
        for r in sorted((r for r in rows if r["n"] == n), key=lambda r: -(r["tflops"] or 0)):
            if r["tflops"] is None:
                print(f"  {r['name']:<28} failed  {r['info']}")
                continue
            ratios = "".join(f"  {r['tflops'] / base:5.2f}x {tag}" for base, tag in ((flash, "flash"), (cudnn, "cuDNN")) if base)
            print(f"  {r['name']:<28} {r['tflops']:6.1f}{ratios}   {r['info']}")
        sys.stdout.flush()
        del q, k, v
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(case=case.name, env=bench.environment_info(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
