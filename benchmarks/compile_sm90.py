"""Compile the course's Hopper launches for sm_90 here, without a GPU, and record what the compiler made.

``course_utils.kernels.targets`` specialises each captured launch as Triton's
launcher does on the GPU, so with the GPU's Triton version (3.6 on the course's
H200: its wheel installed with ``pip install --target DIR`` and ``DIR`` first on
``PYTHONPATH``) the registers, spills and shared memory are the H200's own
(``tests/test_targets.py`` checks three launches against what the H200 reported).
This script records, for bf16 and D = 128:

- ``lesson05_forward``: lesson 05's GQA kernel at its Hopper launch and on
  4 warps with 3 and 2 stages (lesson 06, section 8);
- ``ws_forward``: lesson 06's fast kernel on one warpgroup with
  ``warp_specialize=True`` (the output stored by pointers, causal in one loop),
  with and without it: warps per program, registers, spills, shared memory, and
  the ``setmaxnreg`` values Triton wrote into the PTX;
- ``ws_persistent_forward``: that kernel persistent (132 programs walk the
  tiles) with its tile loop warp-specialised, ``tune_fast.py``'s persistent
  VARIANTS, causal and not;
- ``ws_window_forward``: lesson 08's window on that machinery
  (:mod:`course_utils.kernels.fast_window`), warp-specialised, without and
  with 4 sinks;
- ``backward_pair``: lesson 07's dK/dV and dQ kernels at every launch that
  ``benchmarks/tune_backward.py --pair`` times;
- ``flat_backward``: :mod:`course_utils.kernels.fast_backward`'s flat dK/dV
  kernel (and flat dQ kernel, ``flat_dq``) at every launch
  ``tune_backward.py --flat`` times, causal and not, and at
  ``tune_window.py --backward``'s flat launches with W = 1024;
- ``t4_lessons``: every lesson kernel for a T4 (sm_75, fp16), as
  ``course_utils.kernels.targets --sm 75`` compiles them;
- ``window_backward``: lesson 08's window dK/dV and dQ kernels at every launch
  ``benchmarks/tune_window.py --backward`` times (W = 1024 and 4096, no sinks);
- ``fp8_ws``: lesson 11's FP8 Hopper kernel (e4m3 inputs, D = 128 and 64) at
  ``benchmarks/tune_fp8.py --hopper --ws``'s launches: hopper_config's, then
  the warp-specialised ones;
- ``gluon_forward``: lesson 11's Gluon forward (``kernels.hopper_ws``), every
  consumer loop in bf16 and FP8, causal and not: registers, spills, ptxas's
  performance warnings (``targets.ptxas_warnings``: "wgmma serialized", C7511 /
  C7513) and, from the machine code (``nvdisasm``), the warpgroup products and
  the ``WARPGROUP`` fences around them (a serialised kernel fences every product).

    TRITON_INTERPRET=0 PYTHONPATH=/path/to/triton-3.6:$PWD python benchmarks/compile_sm90.py --out results/sm90_compiles.json
    ... --sections gluon_forward --out results/sm90_gluon.json    # some sections only

A failed compile is recorded with the compiler's first error line, not raised.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before anything imports Triton: compile, do not interpret

ROOT = Path(__file__).resolve().parent.parent
SM = 90
N, D = 4096, 128


def _tuning_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiled(kernel, args, kwargs) -> dict:
    """What the compiler made of one captured launch (``targets.compile_launch``), or why it refused."""
    from course_utils.kernels import targets

    try:
        c = targets.compile_launch(kernel, args, kwargs, SM, "", warnings=True)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result here
        lines = [line for line in str(exc).splitlines() if "error:" in line] or str(exc).splitlines() or [""]
        return dict(kernel=kernel.__name__, error=f"{type(exc).__name__}: {lines[0].strip()[:200]}")
    return dict(kernel=c.kernel, warps=c.num_warps, registers=c.registers, spills=c.spill_bytes // 4,
                shared=c.shared_bytes, setmaxnreg=[list(pair) for pair in c.setmaxnreg],
                partitions=[list(p) for p in c.partitions], ptxas_warnings=list(c.ptxas_warnings))


def _inputs(hq, hkv, n=N, d=D):
    import torch

    return (torch.zeros(1, hq, n, d, dtype=torch.bfloat16), torch.zeros(1, hkv, n, d, dtype=torch.bfloat16),
            torch.zeros(1, hq, n))


def ws_forward() -> list[dict]:
    """Lesson 06's kernel on one warpgroup, with and without warp specialisation."""
    from course_utils.kernels import fast, targets

    q, k, _ = _inputs(32, 8)
    rows = []
    for block_m, block_n, stages in ((128, 64, 2), (128, 64, 3), (128, 128, 2)):
        for causal in (True, False):
            for ws in (False, True):
                opts = dict(block_m=block_m, block_n=block_n, num_warps=4, num_stages=stages, warp_specialize=ws,
                            two_phase=not (causal and ws))
                with targets._captured_launches() as launches:
                    fast.launch(q, k, k, causal, **opts)
                rows.append(dict(opts, causal=causal, **_compiled(*launches[0])))
    return rows


def ws_persistent_forward() -> list[dict]:
    """Lesson 06's kernel persistent (one program per SM of the H200's 132 walks the tiles), its tile loop
    warp-specialised: tune_fast.py's persistent VARIANTS, causal (one masked key loop) and not."""
    from course_utils.kernels import fast, targets

    q, k, _ = _inputs(32, 8)
    rows = []
    for c, extra in _tuning_script("tune_fast").VARIANTS:
        if not extra.get("persistent"):
            continue
        for causal in (True, False):
            opts = dict(_tuning_script("tune_fast").launch_options(c, extra), n_programs=132)
            with targets._captured_launches() as launches:
                fast.launch(q, k, k, causal, **opts)
            rows.append(dict(block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3], warp_specialize=c[5],
                             persistent=True, causal=causal, **_compiled(*launches[0])))
    return rows


def lesson05_forward() -> list[dict]:
    """Lesson 05's GQA kernel at its Hopper launch and on 4 warps (lesson 06's section 8 compares them)."""
    from course_utils.kernels import forward, targets

    q, k, _ = _inputs(32, 8)
    with targets._as_if_on_a_gpu(SM), targets._captured_launches() as launches:
        forward.flash_attention_gqa_forward(q, k, k, True)
    kernel, args, kwargs = launches[0]
    rows = []
    for name, opts in (("lesson 05's launch", {}), ("4 warps, 3 stages", dict(num_warps=4, num_stages=3)),
                       ("4 warps, 2 stages", dict(num_warps=4, num_stages=2))):
        kw = dict(kwargs, **opts)
        rows.append(dict(name=name, block_m=kw["BLOCK_M"], block_n=kw["BLOCK_N"], num_warps=kw["num_warps"],
                         num_stages=kw["num_stages"], causal=True, **_compiled(kernel, args, kw)))
    return rows


def ws_window_forward() -> list[dict]:
    """fast_window's warp-specialised launches (tune_window.py's ``FAST_WS_CANDIDATES``), W = 1024 and 4096, without
    and with 4 sinks."""
    from course_utils.kernels import fast_window, targets

    q, k, _ = _inputs(32, 8)
    rows = []
    for bm, bn, w, s in _tuning_script("tune_window").FAST_WS_CANDIDATES:
        for window_size in (1024, 4096):
            for sink_size in (0, 4):
                with targets._captured_launches() as launches:
                    fast_window.launch(q, k, k, window_size=window_size, sink_size=sink_size, block_m=bm, block_n=bn,
                                       num_warps=w, num_stages=s, warp_specialize=True)
                rows.append(dict(block_m=bm, block_n=bn, num_stages=s, window_size=window_size, sink_size=sink_size,
                                 warp_specialize=True, **_compiled(*launches[0])))
    return rows


def _backward_launches(configs, **window):
    from course_utils.kernels import backward, targets
    from course_utils.kernels.backward import BackwardConfig

    q, k, lse = _inputs(4, 1)
    for c in configs:
        with targets._as_if_on_a_gpu(SM), targets._captured_launches() as launches:
            backward.attention_backward(q, k, k, q, lse, q, True, config=BackwardConfig(*c), **window)
        for kernel, args, kwargs in launches:
            if "dkdv" in kernel.__name__ or "dq" in kernel.__name__:
                yield c, kernel, args, kwargs


def backward_pair() -> list[dict]:
    """Lesson 07's pair at tune_backward.py's ``PAIR`` launches (causal)."""
    pair = _tuning_script("tune_backward").PAIR
    return [dict(config=list(c), **_compiled(kernel, args, kwargs)) for c, kernel, args, kwargs in _backward_launches(pair)]


def flat_backward() -> list[dict]:
    """The flat mode's dK/dV kernel (fast_backward), and its dQ kernel where ``flat_dq``, at tune_backward.py's
    ``FLAT`` launches, causal and not, and at tune_window.py's ``FLAT_BACKWARD_CANDIDATES`` with a 1024-key window."""
    from course_utils.kernels import fast_backward as fb
    from course_utils.kernels import targets

    q, k, lse = _inputs(4, 1)
    cases = [(c, causal, None) for c in _tuning_script("tune_backward").FLAT for causal in (True, False)]
    cases += [(c, True, w) for c in _tuning_script("tune_window").FLAT_BACKWARD_CANDIDATES for w in (1024,)]
    rows = []
    for c, causal, window_size in cases:
        cfg = fb.FastBackwardConfig(*c)
        with targets._captured_launches() as launches:
            fb.attention_backward_fast(q, k, k, q, lse, q, causal, config=cfg, window_size=window_size)
        for kernel, args, kwargs in launches:  # the dK/dV kernel, and the dQ kernel where it is the flat mode's
            if kernel.__name__ in ("_attn_bwd_dkdv_flat", "_attn_bwd_dq_flat"):
                rows.append(dict(config=cfg.short(), causal=causal, window_size=window_size,
                                 **_compiled(kernel, args, kwargs)))
    return rows


def window_backward() -> list[dict]:
    """Lesson 08's window kernels at tune_window.py's ``BACKWARD_CANDIDATES`` (W = 1024, 4096; no sinks)."""
    from course_utils.kernels.backward import default_config

    rows = []
    for w in (1024, 4096):
        shipped = default_config(D, "cuda", (9, 0), __import__("torch").bfloat16, window_size=w)
        shipped = (shipped.dkdv_block_m, shipped.dkdv_block_n, shipped.dq_block_m, shipped.dq_block_n,
                   shipped.dkdv_warps, shipped.dkdv_stages, shipped.dq_warps, shipped.dq_stages)
        configs = [shipped if c is None else c for c in _tuning_script("tune_window").BACKWARD_CANDIDATES]
        for c, kernel, args, kwargs in _backward_launches(dict.fromkeys(configs), window_size=w, sink_size=0):
            rows.append(dict(window_size=w, config=list(c), shipped=c == shipped, **_compiled(kernel, args, kwargs)))
    return rows


def fp8_ws() -> list[dict]:
    """The FP8 Hopper kernel at ``tune_fp8.py --hopper --ws``'s launches (D = 128 and 64, causal and not)."""
    import argparse as _argparse

    import torch

    from course_utils.kernels import fp8, targets

    options = _argparse.Namespace(maxnreg=False, exp_poly=False, exp_f16=False, ws=True)
    rows = []
    for d in (128, 64):
        q8 = torch.zeros(1, 32, N, d, dtype=torch.float8_e4m3fn)
        k8 = torch.zeros(1, 8, N, d, dtype=torch.float8_e4m3fn)
        vt8 = torch.zeros(1, 8, d, N, dtype=torch.float8_e4m3fn)
        qs, ks = torch.ones(1, 32, N // 128), torch.ones(1, 8, N // 128)
        for causal in (True, False):
            for cfg in _tuning_script("tune_fp8").hopper_candidates(options, d, causal):
                with targets._captured_launches() as launches:  # persistent: the H200's 132 programs
                    fp8.launch_fp8_hopper(q8, k8, vt8, qs, ks, ks, causal, 128, torch.bfloat16,
                                          config=dict(cfg, N_PROGRAMS=132) if cfg.get("PERSISTENT") else cfg)
                kernel, args, kwargs = launches[0]
                kwargs = dict(kwargs, INTERPRETED=False)  # captured from CPU tensors: compile the GPU's branch
                rows.append(dict(head_dim=d, causal=causal, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                                 num_stages=cfg["num_stages"], maxnreg=cfg.get("maxnreg"),
                                 warp_specialize=bool(cfg.get("WARP_SPECIALIZE")),
                                 persistent=bool(cfg.get("PERSISTENT")), **_compiled(kernel, args, kwargs)))
    return rows


def sass_counts(cubin: bytes) -> dict:
    """How many warpgroup products (``HGMMA``: 16-bit, ``QGMMA``: FP8) and ``WARPGROUP`` fences (``ARRIVE`` before
    products, ``DEPBAR`` waits for them) the machine code holds, its instructions in all, and its byte permutes
    (``PRMT``) and warp shuffles (``SHFL``), read with the ``nvdisasm`` that ships with Triton."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, f.name], capture_output=True, text=True, check=True).stdout
    opcodes = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text, flags=re.MULTILINE)
    return dict(products=text.count("HGMMA.") + text.count("QGMMA."), arrive=text.count("WARPGROUP.ARRIVE"),
                depbar=text.count("WARPGROUP.DEPBAR"), instructions=len(opcodes),
                byte_permutes=opcodes.count("PRMT"), shuffles=opcodes.count("SHFL"))


def gluon_forward() -> list[dict]:
    """Lesson 11's Gluon forward, every loop, bf16 and FP8 (D = 128, two K/V slots): what ptxas made of it."""
    import torch

    from course_utils.kernels import hopper_ws, targets

    rows = []
    for fp8 in (False, True):
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        q, k = torch.zeros(1, 32, N, D, dtype=dtype), torch.zeros(1, 8, N, D, dtype=dtype)
        v = torch.zeros(1, 8, D, N, dtype=dtype) if fp8 else k
        scales = (torch.ones(1, 32, N // 128), torch.ones(1, 8, N // 128), torch.ones(1, 8, N // 128))
        for loop in hopper_ws.LOOPS:
            if fp8 and loop == "pipelined":
                continue  # attention_fp8 refuses it
            for causal in (False, True):
                row = dict(kernel="attn_fwd_ws", loop=loop, fp8=fp8, causal=causal)
                with targets._captured_launches() as launches:
                    hopper_ws._launch(q, k, v, causal, 0.088, 2, loop, fp8, scales if fp8 else None)
                (kernel, args, kwargs), = launches
                try:
                    compiled = targets.compile_binary(kernel, args, kwargs, SM)
                except Exception as exc:  # noqa: BLE001 - a refusal is a result here
                    rows.append(dict(row, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
                    continue
                regs, _, spills = targets._resource_usage(compiled.asm["cubin"])
                rows.append(dict(row, warps=compiled.metadata.num_warps, registers=regs, spills=spills // 4,
                                 shared=int(compiled.metadata.shared),
                                 ptxas_warnings=list(targets.ptxas_warnings(compiled.asm["ptx"], SM)),
                                 **sass_counts(compiled.asm["cubin"])))
    return rows


def t4_lessons() -> list[dict]:
    """Every lesson kernel at the launch its launcher picks on a T4 (sm_75, fp16, D = 64 and 128): what Colab runs."""
    from course_utils.kernels import targets

    return [dict(kernel=c.kernel, case=c.case, warps=c.num_warps, num_stages=c.num_stages, registers=c.registers,
                 spills=c.spill_bytes // 4, shared=c.shared_bytes)
            for c in targets.check_targets(sms=(75,), head_dims=(64, 128))]


SECTIONS = {"lesson05_forward": lesson05_forward, "ws_forward": ws_forward, "ws_persistent_forward": ws_persistent_forward,
            "ws_window_forward": ws_window_forward, "backward_pair": backward_pair, "flat_backward": flat_backward,
            "window_backward": window_backward, "fp8_ws": fp8_ws, "t4_lessons": t4_lessons}
EXTRA_SECTIONS = {"gluon_forward": gluon_forward}  # --sections only (not part of results/sm90_compiles.json)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    parser.add_argument("--sections", nargs="+", choices=[*SECTIONS, *EXTRA_SECTIONS], default=list(SECTIONS),
                        help="compile only these (default: every section of results/sm90_compiles.json)")
    args = parser.parse_args(argv)
    import triton

    record = dict(info=dict(triton=triton.__version__, target=f"sm_{SM}", dtype="bf16", head_dim=D,
                            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            command="python benchmarks/compile_sm90.py"
                                    + ("" if args.sections == list(SECTIONS) else " --sections " + " ".join(args.sections))))
    for section in args.sections:
        record[section] = {**SECTIONS, **EXTRA_SECTIONS}[section]()
    for section in args.sections:
        print(f"== {section}")
        for r in record[section]:
            what = r.get("error") or (f"{r['warps']} warps, {r['registers']} registers, {r['spills']} spilled, "
                                      f"{r['shared'] // 1024} KiB")
            if "ptxas_warnings" in r:
                what += (f", {r['products']} products, {r['arrive']} + {r['depbar']} fences"
                         + "".join(f"; {w[:60]}" for w in r["ptxas_warnings"]))
            key = {k: v for k, v in r.items() if k in ("name", "case", "config", "window_size", "sink_size", "head_dim",
                                                        "block_m", "block_n", "num_stages", "causal", "maxnreg",
                                                        "warp_specialize", "persistent", "loop", "fp8") and v is not None}
            print(f"  {r['kernel']:<22} {key}: {what}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
