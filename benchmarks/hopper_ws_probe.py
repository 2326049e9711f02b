"""Lesson 11's hand-specialised Gluon forward (course_utils.kernels.hopper_ws) on a Hopper GPU: does it run, is it
right, how fast is it beside cuDNN and the course's own forward, in one run.

    python benchmarks/hopper_ws_probe.py [--dtype bf16|fp8] [--out results/hopper_ws_probe.json] [--limit 60]

Each case runs in its own process under a wall-clock limit, as ``ws_smoke.py`` does: Triton's automatic
warp specialisation deadlocked on the H200, and a kernel that deadlocks cannot be interrupted from Python.
Correctness first (max |o - o_ref| against float32 SDPA on the repeated heads, max |lse - lse_ref|); a
variant is timed only if its checks passed. Speed: TFLOP/s by ``triton.testing.do_bench`` (causal halved),
bf16, GQA 32/8, D = 128, beside SDPA's cuDNN backend and ``kernels.flash_attention`` in the same process.

``--dtype fp8`` (written to ``results/hopper_ws_fp8_probe.json``): the FP8 variants (``hopper_ws.attention_fp8``,
``dtype: "fp8"`` in a row), the inputs quantised once by
``kernels.quantize_fp8`` and V transposed outside the timing; checked by the relative RMS error of ``o`` against
float32 attention over the dequantised inputs (``rel_rms``, as ``bench fp8`` checks) and ``lse`` against the
same; timed beside cuDNN's bf16 and the course's Triton FP8 kernel (``fp8.launch_fp8_hopper``) on the same
e4m3 inputs (``course`` in those rows).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECKS = [(1, 4, 2, 256, True), (2, 8, 2, 1024, False), (1, 32, 8, 2048, True)]  # B, H, H_kv, N, causal
SPEED = [(1, 32, 8, 16384, True), (1, 32, 8, 16384, False), (4, 32, 8, 4096, True)]
VARIANTS = [dict(num_buffers=2, loop="serial", fma=False), dict(num_buffers=2, loop="pingpong", fma=False),
            dict(num_buffers=2, loop="serial", fma=True), dict(num_buffers=2, loop="pingpong", fma=True),
            dict(num_buffers=2, loop="overlap", fma=False), dict(num_buffers=2, loop="overlap", fma=True),
            dict(num_buffers=2, loop="pipelined", fma=False),
            dict(num_buffers=2, loop="serial", fma=True, dtype="fp8"), dict(num_buffers=3, loop="serial", fma=True,
                                                                             dtype="fp8"),
            dict(num_buffers=2, loop="pingpong", fma=True, dtype="fp8"),
            dict(num_buffers=2, loop="overlap", fma=True, dtype="fp8")]
FP8_REL_RMS = 0.05  # bench fp8's tolerance for the course's FP8 kernel (FP8_TOLERANCE)


def run_case(mode: str, b: int, h: int, h_kv: int, n: int, causal: bool, num_buffers: int, loop: str,
             fma: bool, dtype: str = "bf16") -> dict:
    """One case in this process: the errors, and for ``speed`` the TFLOP/s of the three forwards."""
    import math

    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course_utils import kernels
    from course_utils.kernels import fp8, hopper_ws

    torch.manual_seed(0)
    q = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, h_kv, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if dtype == "fp8":
        (q8, qs), (k8, ks), (v8, vs) = (kernels.quantize_fp8(t) for t in (q, k, v))
        vt8 = v8.transpose(2, 3).contiguous()
        run = lambda: hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, num_buffers=num_buffers,  # noqa: E731
                                              loop=loop)
        course = lambda: fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16)  # noqa: E731
        qf, kf, vf = (fp8.dequantize_fp8(x, s) for x, s in ((q8, qs), (k8, ks), (v8, vs)))
    else:
        run = lambda: hopper_ws.attention(q, k, v, causal, num_buffers=num_buffers, loop=loop, fma=fma)  # noqa: E731
        course = lambda: kernels.flash_attention(q, k, v, causal)  # noqa: E731
        qf, kf, vf = q.float(), k.float(), v.float()
    o, lse = run()
    torch.cuda.synchronize()
    kr, vr = (t.repeat_interleave(h // h_kv, 1) for t in (kf, vf))
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kr, vr, is_causal=causal)
    s = (qf @ kr.transpose(-1, -2)) / math.sqrt(128)
    if causal:
        s = s.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), -float("inf"))
    out = dict(err=(o.float() - ref).abs().max().item(), lse_err=(lse - torch.logsumexp(s, -1)).abs().max().item())
    if dtype == "fp8":
        out["rel_rms"] = (((o.double() - ref.double()) ** 2).mean().sqrt() / (ref.double() ** 2).mean().sqrt()).item()
        out["err_vs_course"] = (o.float() - course().float()).abs().max().item()
    if mode == "speed":
        flops = 4 * b * h * n * n * 128 / (2 if causal else 1)
        tflops = lambda fn: flops / triton.testing.do_bench(fn, warmup=50, rep=300) * 1e-9  # noqa: E731
        out["hopper_ws"] = tflops(run)
        kk, vv = k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out["cudnn"] = tflops(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=causal))
        out["course"] = tflops(course)
        out["hopper_ws"] = max(out["hopper_ws"], tflops(run))  # the best of two, as the GPU warms
    return out


def passed(row: dict) -> bool:
    """A check row's verdict: bf16 within 2e-2 of float32 attention (max), FP8 within bench fp8's relative RMS."""
    if "error" in row:
        return False
    if row.get("dtype") == "fp8":
        return row["rel_rms"] < FP8_REL_RMS and row["lse_err"] < 2e-2
    return row["err"] < 2e-2 and row["lse_err"] < 1e-2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="which variants (default bf16)")
    parser.add_argument("--out", help="default results/hopper_ws_probe.json, with --dtype fp8 "
                                      "results/hopper_ws_fp8_probe.json")
    parser.add_argument("--limit", type=int, default=60, help="seconds per case before it counts as hung")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, as JSON, in this process
    args = parser.parse_args(argv)
    if args.case:
        print("RESULT", json.dumps(run_case(*json.loads(args.case))))
        return 0
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        print("hopper_ws_probe: needs a Hopper GPU (H100/H200); nothing measured")
        return 0
    out = Path(args.out or ROOT / "results" / ("hopper_ws_fp8_probe.json" if args.dtype == "fp8" else
                                                 "hopper_ws_probe.json"))
    rows = []
    for variant in (v for v in VARIANTS if v.get("dtype", "bf16") == args.dtype):
        ok = True
        for mode, cases in (("check", CHECKS), ("speed", SPEED)):
            for case in cases:
                if mode == "speed" and not ok:
                    break
                spec = [mode, *case, variant["num_buffers"], variant["loop"], variant["fma"],
                        variant.get("dtype", "bf16")]
                try:
                    p = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], capture_output=True,
                                       text=True, timeout=args.limit, cwd=ROOT)
                    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                    row = json.loads(line[0][7:]) if line else {"error": (p.stderr or p.stdout)[-600:]}
                except subprocess.TimeoutExpired:
                    row = {"error": f"hung: killed after {args.limit} s"}
                row.update(mode=mode, b=case[0], h=case[1], h_kv=case[2], n=case[3], causal=case[4], **variant)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if mode == "check":
                    ok = ok and passed(row)
    info = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__,
                command=f"python benchmarks/hopper_ws_probe.py --dtype {args.dtype}")
    out.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
