"""Lesson 11's hand-specialised Gluon kernels (course_utils.kernels.hopper_ws, hopper_ws_bwd) on a Hopper GPU:
do they run, are they right, how fast are they beside cuDNN and the course's own kernels, in one run.

    python benchmarks/hopper_ws_probe.py [--kind fwd|fp8|bwd|window] [--out FILE] [--limit 60]

Each case runs in its own process under a wall-clock limit, as ``ws_smoke.py`` does: Triton's automatic
warp specialisation deadlocked on the H200, and a kernel that deadlocks cannot be interrupted from Python.
Correctness first; a variant is timed only if its checks passed. bf16, GQA 32/8, D = 128; speed by
``triton.testing.do_bench``, beside SDPA's cuDNN backend and the course's kernel for the same job, in the same
process. By ``--kind`` (each written to its own file in results/):

* ``fwd`` (``hopper_ws_probe.json``): ``hopper_ws.attention``'s loops; max |o - o_ref| against float32 SDPA on
  the repeated heads and max |lse - lse_ref|; TFLOP/s (causal halved) beside ``kernels.flash_attention``.
* ``fp8`` (``hopper_ws_fp8_probe.json``): ``hopper_ws.attention_fp8``, the inputs quantised once by
  ``kernels.quantize_fp8`` and V transposed outside the timing; the relative RMS error of ``o`` against float32
  attention over the dequantised inputs (``rel_rms``, as ``bench fp8`` checks) and ``lse`` against the same;
  timed beside cuDNN's bf16 and the course's Triton FP8 kernel (``fp8.launch_fp8_hopper``) on the same e4m3
  inputs (``course`` in those rows).
* ``window`` (``hopper_ws_window_probe.json``): ``hopper_ws.attention`` with lesson 08's window and sinks, its
  serial and ping-pong loops, one program per tile or the persistent grid
  (bench window's inputs, float32 reference rows and tolerance), TFLOP/s of the visible pairs beside the
  course's window forward (``kernels.flash_attention_with_lse``) and FlexAttention, ``over_flex`` the ratio; and
  forward + backward (``hopper_ws_bwd.attention``, the Gluon forward and backward behind autograd, its gradients
  checked against Flex's: ``train_err``) beside Flex's and the course's, ``train_over_flex`` (not for the
  persistent grid: that step's forward is the other).
* ``bwd`` (``hopper_ws_bwd_probe.json``): ``hopper_ws_bwd.attention_backward`` (its dQ in Gluon or lesson
  07's); the relative error of dq, dk,
  dv against float32 autograd through SDPA's math; the backward's time beside lesson 07's pair
  (``backward.attention_backward``, ``course``) and cuDNN's (its forward + backward less its forward), as
  TFLOP/s of the backward's five products (2.5 times the forward's); and ``train_over_cudnn``: cuDNN's forward
  + backward time over the course's forward with this backward, the training step issue 24 measures.
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
VARIANTS = [dict(num_buffers=2, loop="serial", fma=False), dict(num_buffers=2, loop="overlap_pingpong", fma=True),
            dict(num_buffers=2, loop="overlap", fma=False), dict(num_buffers=2, loop="overlap_pingpong", fma=False),
            dict(num_buffers=2, loop="overlap", fma=True), dict(num_buffers=2, loop="pingpong", fma=False),
            dict(num_buffers=2, loop="pingpong", fma=True), dict(num_buffers=2, loop="serial", fma=True),
            dict(num_buffers=2, loop="serial", fma=False, persistent=True),
            dict(num_buffers=2, loop="serial", fma=True, persistent=True),
            dict(num_buffers=2, loop="pingpong", fma=True, persistent=True),
            dict(num_buffers=2, loop="pipelined", fma=False),  # the most promising first: a run may be cut short
            dict(kind="fp8", num_buffers=2, loop="serial"), dict(kind="fp8", num_buffers=2, loop="overlap_pingpong"),
            dict(kind="fp8", num_buffers=2, loop="overlap"),
            dict(kind="fp8", num_buffers=3, loop="serial"), dict(kind="fp8", num_buffers=2, loop="pingpong"),
            dict(kind="bwd", num_buffers=2, block_m=64, dq_kernel="gluon", dq_block_n=64),
            dict(kind="bwd", num_buffers=2, block_m=64, dq_kernel="lesson07", dq_block_n=64),  # dK/dV's share alone
            dict(kind="bwd", num_buffers=2, block_m=32, dq_kernel="gluon", dq_block_n=128),
            dict(kind="bwd", num_buffers=3, block_m=32, dq_kernel="gluon", dq_block_n=64)]
VARIANTS += [dict(kind="window", num_buffers=2, loop="serial"), dict(kind="window", num_buffers=2, loop="pingpong"),
             dict(kind="window", num_buffers=2, loop="serial", persistent=True),
             dict(kind="window", num_buffers=2, loop="pingpong", persistent=True)]
OUT = {"fwd": "hopper_ws_probe.json", "fp8": "hopper_ws_fp8_probe.json", "bwd": "hopper_ws_bwd_probe.json",
       "window": "hopper_ws_window_probe.json"}
# lesson 08's window (bench window's shapes: B = 1, GQA 32/8, D = 128): window_size, sink_size, N
WINDOW_CHECKS = [(256, 0, 2048), (200, 4, 2048), (1024, 4, 4096)]
WINDOW_SPEED = [(1024, 0, 16384), (1024, 4, 16384), (256, 0, 16384), (4096, 4, 16384), (1024, 0, 65536)]


def selected(kind: str, loops=None, persistent=None) -> list[dict]:
    """The variants of ``kind`` in the order they run, those with a consumer loop in ``loops`` if given, and
    only the persistent grids (``persistent=True``) or only the others (``False``) if given."""
    return [v for v in VARIANTS if v.get("kind", "fwd") == kind and (not loops or v.get("loop") in loops)
            and (persistent is None or bool(v.get("persistent")) == persistent)]


def case_fields(kind: str, case) -> dict:
    """A row's description of its case."""
    if kind == "window":
        return dict(window_size=case[0], sink_size=case[1], n=case[2])
    return dict(b=case[0], h=case[1], h_kv=case[2], n=case[3], causal=case[4])
FP8_REL_RMS = 0.05  # bench fp8's tolerance for the course's FP8 kernel (FP8_TOLERANCE)


def _inputs(b, h, h_kv, n):
    import torch

    torch.manual_seed(0)
    q = torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, h_kv, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


REFERENCE_CHUNK_BYTES = 1 << 30  # the reference's float32 scores held at once, at most (at least one head's)


def _reference(q, k, v, causal):
    """float32 ``(o, lse)`` of SDPA's math on the repeated kv heads; the scores for ``lse`` a few heads at a time
    (all 32 heads' at N = 16k are 32 GiB, which an 80-GiB H100 cannot hold twice)."""
    import math

    import torch

    h, h_kv, n = q.shape[1], k.shape[1], q.shape[2]
    kr, vr = (t.float().repeat_interleave(h // h_kv, 1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kr, vr, is_causal=causal)
    hidden = torch.ones(n, n, device=q.device, dtype=torch.bool).triu(1) if causal else None
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    step = max(1, REFERENCE_CHUNK_BYTES // (n * n * 4))  # heads per chunk
    for b in range(q.shape[0]):
        for h0 in range(0, h, step):
            s = (q[b, h0:h0 + step].float() @ kr[b, h0:h0 + step].transpose(-1, -2)) / math.sqrt(q.shape[-1])
            if causal:
                s.masked_fill_(hidden, -float("inf"))
            lse[b, h0:h0 + step] = torch.logsumexp(s, -1)
    return ref, lse


def _timer(flops):
    import triton

    return lambda fn: flops / triton.testing.do_bench(fn, warmup=50, rep=300) * 1e-9  # TFLOP/s


def _cudnn(q, k, v, causal):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    h, h_kv = q.shape[1], k.shape[1]
    kk, vv = (k, v) if h == h_kv else (k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=causal)
    return run


def _forward_case(mode, b, h, h_kv, n, causal, variant) -> dict:
    import torch

    from course_utils import kernels
    from course_utils.kernels import fp8, hopper_ws

    q, k, v = _inputs(b, h, h_kv, n)
    if variant.get("kind") == "fp8":
        (q8, qs), (k8, ks), (v8, vs) = (kernels.quantize_fp8(t) for t in (q, k, v))
        vt8 = v8.transpose(2, 3).contiguous()
        run = lambda: hopper_ws.attention_fp8(q8, k8, vt8, qs, ks, vs, causal, num_buffers=variant["num_buffers"],  # noqa: E731
                                              loop=variant["loop"])
        course = lambda: fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, vs, causal, 128, torch.bfloat16)  # noqa: E731
        ref, lse_ref = _reference(*(fp8.dequantize_fp8(x, s) for x, s in ((q8, qs), (k8, ks), (v8, vs))), causal)
    else:
        run = lambda: hopper_ws.attention(q, k, v, causal, num_buffers=variant["num_buffers"],  # noqa: E731
                                          loop=variant["loop"], fma=variant["fma"],
                                          persistent=variant.get("persistent", False))
        course = lambda: kernels.flash_attention(q, k, v, causal)  # noqa: E731
        ref, lse_ref = _reference(q, k, v, causal)
    o, lse = run()
    torch.cuda.synchronize()
    out = dict(err=(o.float() - ref).abs().max().item(), lse_err=(lse - lse_ref).abs().max().item())
    if variant.get("kind") == "fp8":
        out["rel_rms"] = (((o.double() - ref.double()) ** 2).mean().sqrt() / (ref.double() ** 2).mean().sqrt()).item()
        out["err_vs_course"] = (o.float() - course().float()).abs().max().item()
    if mode == "speed":
        tflops = _timer(4 * b * h * n * n * 128 / (2 if causal else 1))
        out["hopper_ws"] = tflops(run)
        out["cudnn"] = tflops(_cudnn(q, k, v, causal))
        out["course"] = tflops(course)
        out["hopper_ws"] = max(out["hopper_ws"], tflops(run))  # the best of two, as the GPU warms
    return out


def _backward_case(mode, b, h, h_kv, n, causal, variant) -> dict:
    import torch
    import triton

    from course_utils import kernels
    from course_utils.kernels import backward, hopper_ws_bwd

    q, k, v = _inputs(b, h, h_kv, n)
    do = torch.randn_like(q)
    o, lse = kernels.flash_attention_with_lse(q, k, v, causal)
    options = {key: variant[key] for key in ("num_buffers", "block_m", "dq_kernel", "dq_block_n")}
    run = lambda: hopper_ws_bwd.attention_backward(q, k, v, o, lse, do, causal, **options)  # noqa: E731
    grads = run()
    torch.cuda.synchronize()
    out = {}
    if mode == "check":  # float32 autograd through SDPA's math on the repeated heads
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        rep = h // h_kv
        of = torch.nn.functional.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1),
                                                              vf.repeat_interleave(rep, 1), is_causal=causal)
        want = torch.autograd.grad(of, (qf, kf, vf), do.float())
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
            out[f"{name}_rel"] = (torch.linalg.vector_norm(got.float() - ref) / torch.linalg.vector_norm(ref)).item()
    else:
        fwd_flops = 4 * b * h * n * n * 128 / (2 if causal else 1)
        bwd = _timer(2.5 * fwd_flops)
        out["hopper_ws"] = bwd(run)
        out["course"] = bwd(lambda: backward.attention_backward(q, k, v, o, lse, do, causal))
        # cuDNN on the kv heads repeated once, outside the timing, as leaves of their own (as _cudnn does)
        qc, kc, vc = (t.detach().requires_grad_() for t in (q, k.repeat_interleave(h // h_kv, 1),
                                                            v.repeat_interleave(h // h_kv, 1)))
        cudnn = _cudnn(qc, kc, vc, causal)
        ms = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=300)  # noqa: E731
        t_fwd = ms(cudnn)
        t_fb = ms(lambda: torch.autograd.grad(cudnn(), (qc, kc, vc), do))
        out["cudnn"] = 2.5 * fwd_flops / (t_fb - t_fwd) * 1e-9
        t_course_fwd = ms(lambda: kernels.flash_attention_with_lse(q, k, v, causal))
        out["hopper_ws"] = max(out["hopper_ws"], bwd(run))
        t_ws = 2.5 * fwd_flops / out["hopper_ws"] * 1e-9
        out.update(cudnn_fwd_bwd_ms=t_fb, course_fwd_ms=t_course_fwd, hopper_ws_bwd_ms=t_ws,
                   train_over_cudnn=t_fb / (t_course_fwd + t_ws))
    return out


def _window_case(mode, window_size, sink_size, n, variant) -> dict:
    """Lesson 08's window: ``hopper_ws.attention(..., window_size, sink_size)`` against bench window's float32
    reference rows; TFLOP/s of the visible pairs beside the course's window forward and FlexAttention."""
    import torch

    from course_utils.bench import window
    from course_utils.kernels import hopper_ws

    q, k, v = window.make_inputs(n)
    case = window.WindowCase(window_size, sink_size, n)
    run = lambda: hopper_ws.attention(q, k, v, True, window_size=window_size, sink_size=sink_size,  # noqa: E731
                                      num_buffers=variant["num_buffers"], loop=variant["loop"],
                                      persistent=variant.get("persistent", False))
    got = run()
    torch.cuda.synchronize()
    err, lse_err = window.forward_error(got, window.reference_forward(q, k, v, window_size, sink_size))
    out = dict(err=err, lse_err=lse_err)
    if mode == "speed":
        tflops = _timer(window.window_flops(n, window_size, sink_size))
        out["hopper_ws"] = tflops(run)
        out["course"] = tflops(window.make_forward("course", q, k, v, case))
        out["flex"] = tflops(window.make_forward("flex", q, k, v, case))
        out["hopper_ws"] = max(out["hopper_ws"], tflops(run))
        out["over_flex"] = out["hopper_ws"] / out["flex"]
        if variant.get("persistent"):  # the training step below runs the forward of one program per tile
            return out
        # forward + backward: the Gluon forward and backward behind autograd (hopper_ws_bwd.attention), checked
        # against FlexAttention's gradients, beside Flex's and the course's training steps
        from course_utils.kernels import hopper_ws_bwd

        qg, kg, vg = window.make_inputs(n, requires_grad=True)
        do = torch.randn_like(qg)

        def gluon_step():
            qg.grad = kg.grad = vg.grad = None
            o = hopper_ws_bwd.attention(qg, kg, vg, True, forward="gluon", window_size=window_size,
                                        sink_size=sink_size)
            o.backward(do)
            return o, qg.grad, kg.grad, vg.grad

        flex_step = window.make_training_step("flex", qg, kg, vg, do, case)
        mine, theirs = ([t.detach().float() for t in step()] for step in (gluon_step, flex_step))
        out["train_err"] = max((torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()
                               for a, b in zip(mine, theirs))
        del mine, theirs
        train = _timer(window.window_flops(n, window_size, sink_size, training=True))
        out["train_hopper_ws"] = train(gluon_step)
        out["train_flex"] = train(flex_step)
        out["train_course"] = train(window.make_training_step("course", qg, kg, vg, do, case))
        out["train_over_flex"] = out["train_hopper_ws"] / out["train_flex"]
    return out


def run_case(mode: str, *args) -> dict:
    """One case in this process (``args``: the case's fields, then the variant): the errors, and for ``speed``
    the speed beside the alternatives."""
    *case, variant = args
    kind = variant.get("kind", "fwd")
    if kind == "window":
        return _window_case(mode, *case, variant)
    return (_backward_case if kind == "bwd" else _forward_case)(mode, *case, variant)


def passed(row: dict) -> bool:
    """A check row's verdict: bf16 within 2e-2 of float32 attention (max), FP8 within bench fp8's relative RMS,
    the backward's gradients within 2e-2 (relative norm)."""
    if "error" in row:
        return False
    if row.get("kind") == "fp8":
        return row["rel_rms"] < FP8_REL_RMS and row["lse_err"] < 2e-2
    if row.get("kind") == "bwd":
        return all(row[f"{g}_rel"] < 2e-2 for g in ("dq", "dk", "dv"))
    if row.get("kind") == "window":  # bench window's tolerance
        return row["err"] < 2e-2 and row["lse_err"] < 1e-2
    return row["err"] < 2e-2 and row["lse_err"] < 1e-2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=tuple(OUT), default="fwd", help="which variants (default fwd)")
    parser.add_argument("--out", help="default results/" + ", ".join(f"{f} (--kind {k})" for k, f in OUT.items()))
    parser.add_argument("--limit", type=int, default=60, help="seconds per case before it counts as hung")
    parser.add_argument("--loops", nargs="+", help="only the variants with these consumer loops (default: all)")
    parser.add_argument("--persistent", choices=("only", "none"),
                        help="only the persistent grids' variants, or none of them (default: all)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, as JSON, in this process
    args = parser.parse_args(argv)
    if args.case:
        print("RESULT", json.dumps(run_case(*json.loads(args.case))))
        return 0
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        print("hopper_ws_probe: needs a Hopper GPU (H100/H200); nothing measured")
        return 0
    out = Path(args.out or ROOT / "results" / OUT[args.kind])
    info = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=__import__("triton").__version__,
                command=f"python benchmarks/hopper_ws_probe.py --kind {args.kind}"
                        + (f" --loops {' '.join(args.loops)}" if args.loops else "")
                        + (f" --persistent {args.persistent}" if args.persistent else ""), complete=False)
    rows = []
    persistent = {"only": True, "none": False}.get(args.persistent)
    for variant in selected(args.kind, args.loops, persistent):
        ok = True
        checks, speed = (WINDOW_CHECKS, WINDOW_SPEED) if args.kind == "window" else (CHECKS, SPEED)
        for mode, cases in (("check", checks), ("speed", speed)):
            for case in cases:
                if mode == "speed" and not ok:
                    break
                spec = [mode, *case, variant]
                try:
                    p = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], capture_output=True,
                                       text=True, timeout=args.limit, cwd=ROOT)
                    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                    row = json.loads(line[0][7:]) if line else {"error": (p.stderr or p.stdout)[-600:]}
                except subprocess.TimeoutExpired:
                    row = {"error": f"hung: killed after {args.limit} s"}
                row.update(mode=mode, **case_fields(args.kind, case), **variant)
                print(json.dumps(row), flush=True)
                rows.append(row)
                # written after every case: a run stopped by its time budget keeps what it measured
                out.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
                if mode == "check":
                    ok = ok and passed(row)
                if "hung" in row.get("error", ""):  # its other cases would hang too: each costs the whole limit
                    break
            if not ok:
                break
    info["complete"] = True
    out.write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
