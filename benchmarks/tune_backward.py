"""Time the fast backward's launch configurations against lesson 07's kernels and SDPA's backwards.

Every configuration of ``course_utils.kernels.fast_backward`` (``CONFIGS`` and
the extra candidates below) is run on the benchmark's heads (bf16, GQA 32/8,
D = 128, 16k tokens per batch), its gradients compared with SDPA cuDNN's,
and then timed, backward alone, side by side in one run with:

- lesson 07's two kernels (``BackwardConfig``, the default before the fast path);
- SDPA flash's and cuDNN's backwards (``torch.autograd.grad`` of their forward's output);
- each provider's forward, so that forward + backward can be compared too.

It also prints registers per thread, spills and shared memory of each
configuration (how many programs fit on one SM), and whether two runs of the
same launch give the same bits (the atomic mode does not).

    python benchmarks/tune_backward.py [--ns 4096 16384] [--new | --pair | --flat] [--out results/tune_backward.json]

Registers and spills of a launch can be read before any GPU time is spent:
``course_utils.kernels.targets.compile_launch`` on a captured launch gives the
H200's own figures when run with the H200's Triton (3.6).

Needs a CUDA GPU (Hopper: ``fast_backward`` is tuned for it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import course_utils  # noqa: F401  (first, as in every notebook)
from course_utils import bench

ROOT = Path(__file__).resolve().parent.parent

# (mode, block_m1, block_n1, block_m2, block_n2, num_warps, num_stages[, use_tma]), beyond fast_backward.CONFIGS
EXTRA = [
    # measured slower on the H200 (results/tune_backward.json): kept so that a change is checked against them
    # (atomic 128 x 128 x 8 warps x 2 stages was tried too: it needs 257 KiB of shared memory, and the compiler refused it)
    ("fused", 64, 128, 128, 64, 8, 2),
    ("fused", 64, 128, 128, 32, 8, 2),
    ("fused", 64, 128, 128, 32, 8, 3),
    ("fused", 32, 128, 128, 32, 4, 2),
    ("fused", 32, 128, 128, 32, 4, 3),
    ("fused", 32, 128, 128, 32, 8, 2),
    ("fused", 32, 64, 64, 32, 4, 3),
    ("fused", 16, 128, 128, 16, 4, 3),
    ("fused", 64, 128, 128, 64, 8, 2, True),
    ("atomic", 32, 128, 128, 32, 4, 2),
    ("atomic", 32, 128, 128, 32, 8, 2),
    ("atomic", 64, 64, 64, 64, 4, 2),
    ("atomic", 64, 64, 64, 64, 4, 3),
    ("atomic", 32, 64, 64, 32, 4, 3),
    # TMA loads of q and dO and TMA's reduce-add of dQ
    ("atomic", 64, 128, 128, 64, 8, 2, True),
    ("atomic", 32, 128, 128, 32, 8, 2, True),
    ("atomic", 32, 128, 128, 32, 8, 3, True),
    ("atomic", 64, 64, 64, 64, 4, 2, True),
    ("atomic", 64, 64, 64, 64, 4, 3, True),
    ("atomic", 32, 64, 64, 32, 4, 3, True),
    ("atomic", 32, 64, 64, 32, 4, 2, True),
]

# The flat mode (twenty-sixth session, not yet timed; ``--flat`` times these alone): lesson 07's split of the
# work, with dK/dV over one loop of (query head, query block) through TMA, warp-specialised or not, and lesson
# 07's dQ kernel. Compiled for sm_90 with the H200's triton 3.6 (benchmarks/compile_sm90.py,
# results/sm90_compiles.json), none spills: 64 x 128 on 8 warps 255 registers (lesson 07's dK/dV kernel spills
# 40 at the same launch), 32 x 128 on 8 warps 209; warp-specialised on 4 warps, 12 warps of 168 registers.
FLAT = [
    ("flat", 64, 128, 128, 32, 8, 3, True),
    ("flat", 64, 128, 128, 32, 8, 2, True),
    ("flat", 32, 128, 128, 32, 8, 2, True),
    ("flat", 32, 128, 128, 32, 4, 2, True, True),
    ("flat", 32, 128, 128, 32, 4, 3, True, True),
    ("flat", 64, 128, 128, 32, 4, 2, True, True),
    ("flat", 64, 64, 128, 32, 4, 2, True, True),
    # dQ by the flat mode's own kernel too (flat_dq; twenty-seventh session, not yet timed): lse and delta through
    # TMA descriptors, which lets Triton 3.6 specialise the dQ loop as well. Compiled for sm_90, the dQ kernel is
    # 12 warps of 168 registers and no spills at 128 x 32 and 128 x 64 (results/sm90_compiles.json's flat_backward).
    # (the 4-warp specialised launches here deadlock on the H200, results/ws_smoke_h200.txt: refused there)
    ("flat", 32, 128, 128, 32, 4, 2, True, True, True),
    ("flat", 32, 128, 128, 64, 4, 2, True, True, True),
    ("flat", 64, 128, 128, 64, 8, 2, True, False, True),
]

# 64-key blocks on 8 warps: dK and dV of 64 keys are half the registers of 128 keys' (32 fp32 values per
# thread each, against 64), where every 128-key configuration above spilled. Measured (run 3 of
# results/tune_backward.json, causal): every one still compiled to 255 registers with 4-90 spilled, and ran
# 1.9-2.8x slower than lesson 07's pair (7.67 against 3.89 ms at N = 4k for the fastest, atomic 64x64 w8 s3)
NEW = [
    ("atomic", 64, 64, 64, 64, 8, 2),
    ("atomic", 64, 64, 64, 64, 8, 3),
    ("atomic", 32, 64, 64, 32, 8, 3),
    ("fused", 64, 64, 64, 64, 8, 2),
    ("fused", 64, 64, 64, 64, 8, 3),
    ("fused", 64, 64, 64, 32, 8, 3),
    ("fused", 32, 64, 64, 32, 8, 3),
]

# Lesson 07's pair itself at other launches (``--pair``): BackwardConfig(dkdv_block_m, dkdv_block_n, dq_block_m,
# dq_block_n, dkdv_warps, dkdv_stages, dq_warps, dq_stages). The first is default_config's on Hopper (one 8-warp
# program per SM). The next seven put 4-warp programs on 64-key (or 64-query) tiles: two programs per SM, lesson
# 06's winning layout of the forward. Measured (run 4 of results/tune_backward.json, causal): no gain, 3.84
# against 3.91 ms at N = 4k for the best, and the shipped launch the fastest at 16k; 32 x 128 on 4 warps
# 2.1-2.2x slower. They were chosen as "without spills" by a compile on the CPU that did not specialise the
# arguments as Triton's launcher does and read no spills; compiled as the H200 does (triton 3.6, targets.py since
# the twenty-sixth session) the dK/dV kernel spills at every one of those launches: 40 values per thread at the
# shipped one, 96 at 64 x 64 on 4 warps, 210 at 32 x 128 on 4 warps (the dQ kernel spills at none).
# The last seven (twenty-sixth session, not yet timed) are dK/dV launches that compile without spills for the
# H200 (registers per thread: 16 x 64 on 4 warps 253-254, two programs per SM; 32 x 128 on 8 warps 245-247;
# 16 x 128 on 8 warps 218; 32 x 64 on 8 warps 238), with the shipped dQ launch (125 registers) or 4-warp dQ
# tiles (64 x 32: 141 registers, three programs per SM).
PAIR = [
    (64, 128, 128, 32, 8, 3, 8, 3),
    (64, 64, 64, 64, 4, 2, 4, 2),
    (64, 64, 64, 32, 4, 3, 4, 3),
    (32, 64, 64, 32, 4, 3, 4, 3),
    (64, 64, 128, 32, 4, 2, 8, 3),
    (64, 128, 64, 64, 8, 3, 4, 2),
    (32, 128, 128, 32, 4, 2, 8, 3),
    (64, 64, 64, 32, 4, 2, 4, 2),
    (16, 64, 128, 32, 4, 2, 8, 3),
    (16, 64, 128, 32, 4, 3, 8, 3),
    (16, 64, 64, 32, 4, 2, 4, 2),
    (32, 128, 128, 32, 8, 3, 8, 3),
    (32, 128, 128, 32, 8, 2, 8, 3),
    (16, 128, 128, 32, 8, 3, 8, 3),
    (32, 64, 128, 32, 8, 3, 8, 3),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--causal", choices=["causal", "both"], default="both",
                        help="both: every configuration causal, and the three fastest also non-causal")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--new", action="store_true", help="only the NEW configurations (and lesson 07's pair)")
    parser.add_argument("--pair", action="store_true", help="lesson 07's pair at the PAIR launches, causal only")
    parser.add_argument("--flat", action="store_true", help="only the FLAT configurations (and lesson 07's pair)")
    args = parser.parse_args(argv)
    if not bench.gpu_available():
        print(bench.NO_GPU_MESSAGE)
        return 0

    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_utils.kernels import fast_backward as fb
    from course_utils.kernels import flash_attention_with_lse
    from course_utils.kernels.backward import BackwardConfig, attention_backward, default_config

    candidates = list(dict.fromkeys(list(fb.CONFIGS) + [fb.FastBackwardConfig(*c) for c in EXTRA + NEW + FLAT]))
    if args.new:
        candidates = [fb.FastBackwardConfig(*c) for c in NEW]
    if args.flat:
        candidates = [fb.FastBackwardConfig(*c) for c in FLAT]
    hq, hkv, d, tokens = 32, 8, 128, 16384
    rows = []

    def run_case(n, causal, configs):
        b = max(1, tokens // n)
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
        do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
        o, lse = flash_attention_with_lse(q, k, v, causal=causal)
        sdpa = {}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            if name == "sdpa_flash":  # its kernel takes no GQA: K/V repeated outside the timing
                kk, vv = (t.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_() for t in (k, v))

            def fwd(qq=qq, kk=kk, vv=vv, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=kk.shape[1] != hq)

            out = fwd()
            grads = torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
            if name == "sdpa_flash":
                grads = (grads[0],) + tuple(t.unflatten(1, (hkv, hq // hkv)).sum(2) for t in grads[1:])
            sdpa[name] = [t.float() for t in grads]
            fwd_ms = triton.testing.do_bench(fwd, warmup=10, rep=100, return_mode="median")
            bwd_ms = triton.testing.do_bench(lambda out=out, qq=qq, kk=kk, vv=vv: torch.autograd.grad(
                out, (qq, kk, vv), do, retain_graph=True), warmup=10, rep=100, return_mode="median")
            rows.append(dict(n=n, batch=b, causal=causal, name=name, fwd_ms=fwd_ms, bwd_ms=bwd_ms))
        ref = sdpa["sdpa_cudnn"]
        course_fwd = triton.testing.do_bench(lambda: flash_attention_with_lse(q, k, v, causal=causal), warmup=10,
                                             rep=100, return_mode="median")

        def timed(name, fn, info=None):
            try:
                got = fn()
                err = max((torch.linalg.vector_norm(a.float() - r) / torch.linalg.vector_norm(r)).item()
                          for a, r in zip(got, ref))
                if not err <= bench.TOLERANCE:
                    raise RuntimeError(f"wrong: relative error {err:.2e} against cuDNN")
                again = fn()
                same = all(torch.equal(a, c) for a, c in zip(got, again))
                ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                rows.append(dict(n=n, batch=b, causal=causal, name=name, fwd_ms=course_fwd, bwd_ms=ms, err=err,
                                 same_bits=same, **(info or {})))
            except Exception as exc:  # one configuration failing must not stop the sweep
                msg = str(exc).strip().splitlines()[0][:150] if str(exc).strip() else ""
                rows.append(dict(n=n, batch=b, causal=causal, name=name, bwd_ms=None, note=f"{type(exc).__name__}: {msg}"))

        lesson = default_config(d, "cuda", torch.cuda.get_device_capability(), q.dtype)
        timed("lesson 07 " + repr(lesson), lambda: attention_backward(q, k, v, o, lse, do, causal, config=lesson))
        if args.pair:
            for c in PAIR[1:]:
                cfg = BackwardConfig(*c)
                timed("pair " + repr(cfg), lambda cfg=cfg: attention_backward(q, k, v, o, lse, do, causal, config=cfg))
        for cfg in configs:
            stats = {}
            try:
                fb.attention_backward_fast(q, k, v, o, lse, do, causal, config=cfg, stats=stats)
            except Exception:
                pass
            timed(cfg.short(), lambda cfg=cfg: fb.attention_backward_fast(q, k, v, o, lse, do, causal, config=cfg),
                  stats)
        mine = [r for r in rows if r["n"] == n and r["causal"] == causal]
        cudnn = next(r for r in mine if r["name"] == "sdpa_cudnn")
        print(f"\n== N={n} B={b} causal={causal}: cuDNN fwd {cudnn['fwd_ms']:.2f} bwd {cudnn['bwd_ms']:.2f} ms; "
              f"course fwd {course_fwd:.2f} ms")
        for r in sorted(mine, key=lambda r: r.get("bwd_ms") or 1e9):
            if r.get("bwd_ms") is None:
                print(f"  {r['name']:<44} {r.get('note')}")
                continue
            total = r["fwd_ms"] + r["bwd_ms"]
            ratio_b = cudnn["bwd_ms"] / r["bwd_ms"]
            ratio_t = (cudnn["fwd_ms"] + cudnn["bwd_ms"]) / total
            extra = ""
            if "registers" in r:
                extra = f" regs {r['registers']} spills {r['spills']} smem {(r['shared'] or 0) // 1024} KiB"
            if "same_bits" in r:
                extra += " same bits" if r["same_bits"] else " bits differ between runs"
            print(f"  {r['name']:<44} bwd {r['bwd_ms']:7.2f} ms ({ratio_b:.2f}x cuDNN)  fwd+bwd {total:7.2f} ms "
                  f"({ratio_t:.2f}x cuDNN){extra}")
        del q, k, v, do, o, lse, sdpa, ref
        torch.cuda.empty_cache()
        return sorted((r for r in mine if r.get("bwd_ms") and "registers" in r), key=lambda r: r["bwd_ms"])

    if args.pair:
        candidates = []
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    best = []
    for n in args.ns:
        ranked = run_case(n, True, candidates)
        best += [r["name"] for r in ranked[:3]]
        if args.out:  # after each length too: a run cut short keeps what it measured
            args.out.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    if args.causal == "both" and not args.pair:
        top = [c for c in candidates if c.short() in set(best)]
        for n in args.ns:
            run_case(n, False, top)
    if args.out:
        args.out.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
