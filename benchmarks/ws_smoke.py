"""One warp-specialised launch per process, with a wall-clock limit: which specialised kernels run, hang or fail.

    python benchmarks/ws_smoke.py CASE   # one case (exit 0: ran and matched the reference)
    python benchmarks/ws_smoke.py --all [--limit 60]   # every case, each in its own process under `timeout`

A kernel that deadlocks on the GPU blocks its process inside CUDA, where pytest-timeout's signal cannot reach it,
so each case runs in its own process, killed after --limit seconds. Needs a Hopper GPU. Each case sets
``COURSE_UNSAFE_WARP_SPECIALIZE=1``: the kernels refuse specialised launches on a GPU otherwise, since this
script found them hanging on the H200 with Triton 3.6 (``results/ws_smoke_h200.txt``, twenty-seventh session).
"""
from __future__ import annotations

import subprocess
import sys
import time

CASES = ("plain", "ws", "ws_causal", "persistent_ws", "fp8_ws", "fp8_persistent_ws", "window_ws", "flat_bwd_ws",
         "flat_dq_ws")


def run_case(name: str) -> None:
    import os

    os.environ["COURSE_UNSAFE_WARP_SPECIALIZE"] = "1"  # this process may be killed: let the specialised ones launch
    import torch

    import course_utils  # noqa: F401
    from course_utils import references
    from course_utils.kernels import fast, fast_backward as fb, fast_window, flash_attention_with_lse, fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    causal = name == "ws_causal" or name.startswith("flat")
    if name in ("plain", "ws", "ws_causal", "persistent_ws"):
        o, _ = fast.launch(q, k, v, causal, block_m=128, block_n=64, num_warps=4, num_stages=2,
                           warp_specialize=name != "plain", two_phase=name == "plain",
                           persistent=name == "persistent_ws")
        want = references.attention(*(t.double().cpu().numpy() for t in (q, k, v)), causal=causal)
    elif name.startswith("fp8"):
        (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
        vt8 = v8.transpose(2, 3).contiguous()
        o = fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, vs, False, 128, torch.bfloat16,
                                  config=dict(BLOCK_M=128, BLOCK_N=64, num_stages=2, maxnreg=None, WARP_SPECIALIZE=True,
                                              PERSISTENT=name == "fp8_persistent_ws"))
        want = references.attention(*(t.double().cpu().numpy() for t in (q, k, v)), causal=False)
    elif name == "window_ws":
        o, _ = fast_window.launch(q, k, v, window_size=256, sink_size=4, block_m=128, block_n=64,
                                  warp_specialize=True)
        want = references.attention(*(t.double().cpu().numpy() for t in (q, k, v)), causal=True, window_size=256,
                                    sink_size=4)
    else:
        o, lse = flash_attention_with_lse(q, k, v, True)
        do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
        cfg = fb.FastBackwardConfig("flat", 32, 128, 128, 32, 4, 2, True, True, name == "flat_dq_ws")
        grads = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=cfg)
        torch.cuda.synchronize()
        ref = references.attention_backward(*(t.double().cpu().numpy() for t in (q, k, v, do)), causal=True)
        err = max(float(abs(a.double().cpu().numpy() - r).max()) for a, r in zip(grads, ref))
        print(f"{name}: max abs error {err:.3g}")
        assert err < 5e-2
        return
    torch.cuda.synchronize()
    err = float(abs(o.double().cpu().numpy() - want).max())
    print(f"{name}: max abs error {err:.3g}")
    assert err < 5e-2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] != "--all":
        run_case(argv[0])
        return 0
    limit = int(argv[argv.index("--limit") + 1]) if "--limit" in argv else 60
    for name in CASES:
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=limit)
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
            verdict = "ran" if r.returncode == 0 else f"failed (rc {r.returncode})"
        except subprocess.TimeoutExpired:
            verdict, tail = f"HUNG (killed after {limit} s)", [""]
        print(f"{name:18s} {verdict:28s} {time.time() - t0:5.1f} s  {tail[0][:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
