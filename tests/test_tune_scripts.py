"""benchmarks/tune_fast.py, tune_backward.py, tune_window.py, tune_decode.py, tune_decode_variants.py, tune_fp8.py, host_overhead.py,
ncu_backward.py, route_check.py, host_step.py, step_state.py, ncu_source.py, gluon_ab.py and membar_probe.py
on the CPU.

Every configuration they time is a valid launch that computes the right
thing (checked here in Triton's interpreter, on a GPU compiled), so that a
GPU run is never spent on a configuration that cannot work; without a GPU
each script explains itself and exits cleanly.
"""

import importlib.util
import json
import os
from pathlib import Path

import course_utils  # noqa: F401  (before triton: switches the interpreter on)
import pytest
import torch

from course_utils import bench, references
from course_utils.kernels import fast_backward as fb
from course_utils.kernels import flash_attention_with_lse
from course_utils.kernels.backward import BackwardConfig, attention_backward
from course_utils.kernels.forward import flash_attention_window_forward

from conftest import DEVICE, ON_GPU, REPO, markdown_text, skip_if_specialised_on_gpu

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tune_fast = _load("tune_fast")
tune_backward = _load("tune_backward")
tune_window = _load("tune_window")
tune_decode = _load("tune_decode")
tune_fp8 = _load("tune_fp8")
host_overhead = _load("host_overhead")
ncu_backward = _load("ncu_backward")
route_check = _load("route_check")
host_step = _load("host_step")
step_state = _load("step_state")
FAST = list(dict.fromkeys(list(fb.CONFIGS) + [fb.FastBackwardConfig(*c)
                                                for c in tune_backward.EXTRA + tune_backward.FLAT]))


def _inputs(hq, hkv, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(q.shape, generator=g).to(DEVICE, dtype)


def _skip_unless_specialisable(warp_specialize, num_warps=4):
    """A warp-specialised one-warpgroup launch compiles with triton 3.6 only (3.8 refuses it); the interpreter runs it."""
    import triton

    skip_if_specialised_on_gpu(warp_specialize, num_warps)


def _rel(a, b):
    return (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()


def test_the_backward_sweep_times_each_configuration_once_and_every_shipped_one():
    labels = [c.short() for c in FAST]
    assert len(labels) == len(set(labels))
    assert set(fb.CONFIGS) <= set(FAST)


@pytest.mark.parametrize("config", FAST, ids=lambda c: c.short().replace(" ", "_"))
def test_every_backward_candidate_is_a_correct_launch(config):
    _skip_unless_specialisable(config.warp_specialize, config.num_warps)
    if config.mode == "atomic" and config.use_tma and not ON_GPU:
        pytest.skip("TMA's reduce-add is not in the interpreter: test_gpu_fast_backward.py checks such launches")
    q, k, v, do = _inputs(2, 1, 128, 64, torch.float16, seed=1)
    arrays = [t.double().cpu().numpy() for t in (q, k, v, do)]
    o, lse = (torch.from_numpy(a).to(DEVICE) for a in references.attention_lse(*arrays[:3], causal=True))
    want = [torch.from_numpy(g) for g in references.attention_backward(*arrays, causal=True)]
    got = fb.attention_backward_fast(q, k, v, o.to(q.dtype), lse.float(), do, True, config=config)
    assert max(_rel(a.cpu(), b) for a, b in zip(got, want)) < 1e-2


@pytest.mark.parametrize("candidate", tune_backward.PAIR, ids=str)
def test_every_pair_launch_of_lesson_07s_backward_is_correct(candidate):
    """tune_backward.py --pair times lesson 07's kernels at these launches: causal, GQA, N not a multiple of the
    tiles; the gradients must be float64 math's."""
    q, k, v, do = _inputs(2, 1, 200, 64, torch.float32, seed=4)
    arrays = [t.double().cpu().numpy() for t in (q, k, v, do)]
    o, lse = (torch.from_numpy(a).to(DEVICE) for a in references.attention_lse(*arrays[:3], causal=True))
    want = [torch.from_numpy(g) for g in references.attention_backward(*arrays, causal=True)]
    got = attention_backward(q, k, v, o.float(), lse.float(), do, True, config=BackwardConfig(*candidate))
    assert max(_rel(a.cpu(), b) for a, b in zip(got, want)) < (1e-2 if ON_GPU else 1e-5)


FAST_FORWARD = [(c, None) for c in tune_fast.CANDIDATES] + tune_fast.VARIANTS


@pytest.mark.parametrize("candidate, extra", FAST_FORWARD, ids=[tune_fast.label(c, e) for c, e in FAST_FORWARD])
def test_every_fast_forward_candidate_and_variant_is_a_correct_launch(candidate, extra):
    """tune_fast.py times fast.launch at these launches: causal (the benchmark's main case) and not."""
    from course_utils.kernels import fast

    split = candidate[5] and candidate[2] == 4  # a one-warpgroup specialised launch takes 16-bit inputs only
    dtype = torch.bfloat16 if ON_GPU else (torch.float16 if split else torch.float32)
    q, k, v, _ = _inputs(4, 2, 256, 64, dtype, seed=5)
    _skip_unless_specialisable(candidate[5], candidate[2])
    for causal in (True, False):
        opts = tune_fast.launch_options(candidate, extra)
        if not ON_GPU:
            opts.pop("maxnreg", None)  # a compiler option: the interpreter has no registers to cap
        if causal and opts["warp_specialize"] and opts["num_warps"] == 4 and opts.get("two_phase", True):
            with pytest.raises(ValueError, match="two_phase=False"):  # timed only in the one-loop form
                fast.launch(q, k, v, causal, **opts)
            continue
        o, lse = fast.launch(q, k, v, causal, **opts)
        ro, rl = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=causal)
        tol = 2e-2 if ON_GPU else (3e-4 if opts.get("exp_poly") else 1e-5)  # the cubic exp2: 7.5e-5 relative
        if dtype == torch.float16:
            tol = max(tol, 2e-3)
        assert abs(o.double().cpu().numpy() - ro).max() < tol
        assert abs(lse.double().cpu().numpy() - rl).max() < max(tol, 1e-4)


@pytest.mark.parametrize("candidate", tune_window.CANDIDATES, ids=str)
def test_every_window_forward_candidate_is_a_correct_launch(candidate):
    q, k, v, _ = _inputs(2, 1, 256, 32, torch.float32, seed=2)
    opts = {} if candidate is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), candidate))
    o, lse = flash_attention_window_forward(q, k, v, window_size=48, sink_size=4, **opts)
    ro, rl = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=True, window_size=48,
                                      sink_size=4)
    tol = 1e-2 if ON_GPU else 1e-5  # fp32 dots are tf32 on a GPU
    assert abs(o.double().cpu().numpy() - ro).max() < tol
    assert abs(lse.double().cpu().numpy() - rl).max() < max(tol, 1e-4)


@pytest.mark.parametrize("candidate", tune_window.FAST_CANDIDATES, ids=str)
def test_every_fast_window_candidate_is_a_correct_launch(candidate):
    """tune_window.py --fast times fast_window.launch at these launches: GQA, sinks in a partial tile."""
    from course_utils.kernels import fast_window

    q, k, v, _ = _inputs(2, 1, 256, 32, torch.float16, seed=2)
    opts = (fast_window.hopper_config(48, 32, 256) if candidate is None
            else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), candidate)))
    o, lse = fast_window.launch(q, k, v, window_size=48, sink_size=4, **opts)
    ro, rl = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=True, window_size=48,
                                      sink_size=4)
    assert abs(o.double().cpu().numpy() - ro).max() < (1e-2 if ON_GPU else 2e-3)
    assert abs(lse.double().cpu().numpy() - rl).max() < 1e-2


@pytest.mark.parametrize("candidate", tune_window.FAST_WS_CANDIDATES, ids=str)
def test_every_warp_specialised_window_candidate_is_a_correct_launch(candidate):
    """tune_window.py --fast times these without and with sinks: the sink tiles and the band in one masked loop,
    the output by pointers."""
    from course_utils.kernels import fast_window

    _skip_unless_specialisable(True, candidate[2])

    q, k, v, _ = _inputs(2, 1, 256, 32, torch.float16, seed=7)
    opts = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), candidate))
    for sink_size in (0, 4):
        o, lse = fast_window.launch(q, k, v, window_size=48, sink_size=sink_size, warp_specialize=True, **opts)
        ro, rl = references.attention_lse(*(t.double().cpu().numpy() for t in (q, k, v)), causal=True, window_size=48,
                                          sink_size=sink_size)
        assert abs(o.double().cpu().numpy() - ro).max() < (1e-2 if ON_GPU else 2e-3)
        assert abs(lse.double().cpu().numpy() - rl).max() < 1e-2


@pytest.mark.parametrize("candidate", tune_window.BACKWARD_CANDIDATES, ids=str)
def test_every_window_backward_candidate_is_a_correct_launch(candidate):
    q, k, v, do = _inputs(2, 1, 256, 32, torch.float32, seed=3)
    cfg = None if candidate is None else BackwardConfig(*candidate)
    o, lse = flash_attention_with_lse(q, k, v, True, window_size=48, sink_size=4)
    got = attention_backward(q, k, v, o, lse, do, True, config=cfg, window_size=48, sink_size=4)
    want = attention_backward(q, k, v, o, lse, do, True, config=BackwardConfig(16, 32, 32, 16), window_size=48,
                              sink_size=4)
    assert max(_rel(a, b) for a, b in zip(got, want)) < (1e-2 if ON_GPU else 1e-5)


@pytest.mark.parametrize("candidate", tune_window.FLAT_BACKWARD_CANDIDATES, ids=str)
def test_every_flat_window_backward_candidate_is_a_correct_launch(candidate):
    """tune_window.py --backward times fast_backward's flat mode with a window (no sinks) at these launches."""
    config = fb.FastBackwardConfig(*candidate)
    _skip_unless_specialisable(config.warp_specialize, config.num_warps)
    q, k, v, do = _inputs(2, 1, 256, 64, torch.float16, seed=6)
    o, lse = flash_attention_with_lse(q, k, v, True, window_size=48)
    got = fb.attention_backward_fast(q, k, v, o, lse, do, True, config=fb.FastBackwardConfig(*candidate),
                                     window_size=48)
    want = attention_backward(q, k, v, o, lse, do, True, config=BackwardConfig(16, 32, 32, 16), window_size=48)
    assert max(_rel(a, b) for a, b in zip(got, want)) < (2e-2 if ON_GPU else 2e-3)


@pytest.mark.parametrize("candidate", tune_decode.CANDIDATES, ids=str)
def test_every_decode_candidate_is_a_correct_launch_at_every_split_count_it_times(candidate):
    from course_utils.bench import decode as db

    block_n = candidate[0]
    context = 10 * block_n + 3  # a ragged last block; the sweep's counts stop at 2 splits here
    g = torch.Generator().manual_seed(block_n)
    q = torch.randn(2, 4, 1, 64, generator=g).to(DEVICE, torch.float16)
    k, v = (torch.randn(2, 1, context, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    seqlens = torch.tensor([context, context - 5], dtype=torch.int32, device=DEVICE)
    counts = tune_decode.allowed_counts(context, block_n)
    assert counts == [1, 2]
    for splits in counts:
        o = tune_decode.launch(q, k, v, seqlens, splits, *candidate)
        for b in range(2):
            want = db.reference(q[b:b + 1], k[b:b + 1, :, :seqlens[b]], v[b:b + 1, :, :seqlens[b]], 0)
            assert _rel(o[b].float().cpu(), want.cpu()) < 1e-2, (splits, b)


def test_the_decode_sweep_s_paged_launches_are_correct():
    from course_utils.bench import decode as db

    context = 14 * 16  # whole pages (paged_copy's rule); the lengths are ragged
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 1, 64, generator=g).to(DEVICE, torch.float16)
    k, v = (torch.randn(2, 1, context, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    seqlens = torch.tensor([context, context - 41], dtype=torch.int32, device=DEVICE)
    k_pages, v_pages, table = db.paged_copy(k, v, 16)
    for splits in (1, 2):
        for candidate in ((32, 4, 3), (64, 4, 2)):
            o = tune_decode.launch(q, k_pages, v_pages, seqlens, splits, *candidate, block_table=table)
            for b in range(2):
                want = db.reference(q[b:b + 1], k[b:b + 1, :, :seqlens[b]], v[b:b + 1, :, :seqlens[b]], 0)
                assert _rel(o[b].float().cpu(), want.cpu()) < 1e-2, (splits, candidate, b)
    from course_utils.kernels import decode

    cfg = decode.launch_config(q, k_pages, 2, table)
    assert tune_decode.shipped_launch(q, k_pages, 2, table) == (cfg["BLOCK_N"], cfg.get("num_warps"),
                                                               cfg.get("num_stages"))
    assert tune_decode.parse_point("4:65536") == (4, 65536)


def test_the_lean_sweep_s_launches_are_correct_and_name_what_the_package_runs():
    from course_utils.bench import decode as db
    from course_utils.kernels import decode, fast_decode

    context = 9 * 32 + 5  # ragged: the last block part full
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 1, 64, generator=g).to(DEVICE, torch.float16)
    k, v = (torch.randn(2, 2, context, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    seqlens = torch.tensor([context, context - 70], dtype=torch.int32, device=DEVICE)
    launches = tune_decode.lean_launches(q, k, v, seqlens, n_sms=3)
    doubled = ["pdl x2"] if "pdl x2" in launches else []
    assert list(launches) == ["splits (lesson 09)", "pdl splits", *doubled, "lean p1", "lean p2", "lean p3", "lean p4",
                              "package"]
    assert [launches[f"lean p{n}"][1]["programs_per_sm"] for n in tune_decode.PER_SM] == list(tune_decode.PER_SM)
    if DEVICE == "cpu":  # the interpreter's 10 blocks of 32 keys: 2 splits, doubled to 4 (each of 2 blocks or more)
        assert decode.launch_splits(q, k) == 2 and launches["pdl x2"][1] == dict(num_splits=4)
        assert launches["package"][1] == dict(runs="num_splits=2")  # no GPU: lesson 09's plain launch
    else:  # a GPU's 5 blocks of 64: one split (4 blocks at least each), nothing to double
        assert not doubled and launches["package"][1] == dict(runs=fast_decode.launch_choice(q, k))
    for name, (fn, _) in launches.items():
        o = fn()
        for b in range(2):
            want = db.reference(q[b:b + 1], k[b:b + 1, :, :seqlens[b]], v[b:b + 1, :, :seqlens[b]], 0)
            assert _rel(o[b].float().cpu(), want.cpu()) < 1e-2, (name, b)


def test_the_decode_sweep_times_the_shipped_configuration_first():
    from course_utils.kernels import decode

    cfg = decode._gpu_config(128, 2, (9, 0))
    assert tune_decode.CANDIDATES[0] == (dict(cfg)["BLOCK_N"], dict(cfg)["num_warps"], dict(cfg)["num_stages"])
    assert len(set(tune_decode.CANDIDATES)) == len(tune_decode.CANDIDATES)


@pytest.mark.interpreter("checks what the scripts do on a machine without a GPU")
@pytest.mark.parametrize("script, argv", [(tune_backward, ["--ns", "256"]), (tune_window, ["--backward"]),
                                          (tune_decode, []), (tune_decode, ["--lean"])])
def test_without_a_gpu_each_script_explains_and_exits_cleanly(script, argv, capsys):
    assert not bench.gpu_available()
    assert script.main(argv) == 0
    assert "No CUDA GPU" in capsys.readouterr().out


def test_a_sweep_is_written_with_the_machine_beside_its_rows(tmp_path, capsys):
    import json

    rows = [dict(name="course 64 w4 s3 splits 1", gbps=3258.0), dict(name="sdpa_cudnn", gbps=None)]
    bench.write_sweep(tmp_path / "sweep.json", rows)
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["rows"] == rows
    assert doc["info"]["torch"] == torch.__version__ and doc["info"]["date"].endswith("UTC")
    assert f"wrote {tmp_path / 'sweep.json'}" in capsys.readouterr().out


def test_the_fp8_sweep_s_cases_are_quantised_copies_of_their_inputs():
    """tune_fp8.case_inputs (both sweeps' inputs): e4m3 copies that dequantise to the bf16 inputs, V K-major,
    batch = tokens // N, the reference is attention of batch element 0."""
    from course_utils.kernels import fp8

    c = tune_fp8.case_inputs(128, 32, True, hq=4, hkv=2, tokens=256, device="cpu")
    assert c["b"] == 2 and c["q8"].dtype == torch.float8_e4m3fn and c["vt8"].shape == (2, 2, 32, 128)
    v = fp8.dequantize_fp8(c["vt8"].transpose(2, 3), c["vs"])
    torch.testing.assert_close(v, c["v"].float(), atol=0.07, rtol=0.07)  # e4m3 keeps 3 mantissa bits
    k_rep = c["k"][:1].float().repeat_interleave(2, 1)
    s = (c["q"][:1].float() @ k_rep.mT) / 32 ** 0.5
    s = s.masked_fill(torch.ones(128, 128, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(s, -1) @ c["v"][:1].float().repeat_interleave(2, 1)
    torch.testing.assert_close(c["ref"], want, atol=1e-5, rtol=1e-5)
    assert c["flops"] > 0


def test_the_fp8_sweep_times_only_candidates_that_ran_and_were_right(capsys):
    """tune_fp8.check_candidate: a launch that raises is named by its exception, a wrong one is "wrong", and
    both say so on the console; only a right one comes back without a note."""
    ref = torch.randn(1, 2, 64, 32)

    def rejected():
        raise RuntimeError("out of resource: shared memory")

    assert tune_fp8.check_candidate(lambda: ref.clone(), ref, "right") == (0.0, None)
    assert tune_fp8.check_candidate(rejected, ref, "big") == (None, "RuntimeError")
    err, note = tune_fp8.check_candidate(lambda: -ref, ref, "sign")
    assert note == "wrong" and err == pytest.approx(2.0)
    out = capsys.readouterr().out
    assert "big: failed (RuntimeError: out of resource" in out and "sign: wrong" in out and "right" not in out


@pytest.mark.interpreter("without a GPU the script has nothing to time")
def test_host_overhead_explains_itself_without_a_gpu(capsys):
    assert host_overhead.main([]) == 0
    assert capsys.readouterr().out.strip() == bench.NO_GPU_MESSAGE


@pytest.mark.interpreter("without a GPU the script has nothing to time")
def test_host_step_explains_itself_without_a_gpu(capsys):
    assert host_step.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("course_utils from ") and out[-1] == bench.NO_GPU_MESSAGE


@pytest.mark.interpreter("without a GPU the script has nothing to time")
def test_step_state_explains_itself_without_a_gpu(tmp_path, capsys):
    assert step_state.main(["--out", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.strip() == bench.NO_GPU_MESSAGE
    assert not (tmp_path / "s.json").exists()


def test_step_state_reads_the_numa_nodes_and_where_it_runs(monkeypatch, capsys):
    """step_state.node_cpus parses a node's cpulist; placement names this process's CPU among those it may use;
    --node of a node this machine lacks says so and pins nothing."""
    import os

    lists = {"/sys/devices/system/node/node1/cpulist": "0-2,8,10-11"}
    monkeypatch.setattr(step_state, "_read", lambda path: lists.get(str(path)))
    assert step_state.node_cpus(1) == {0, 1, 2, 8, 10, 11} and step_state.node_cpus(7) == set()
    monkeypatch.undo()
    where = step_state.placement()
    assert where["cpu"] in os.sched_getaffinity(0) and where["allowed_cpus"] == len(os.sched_getaffinity(0))
    assert where["cpu_node"] in where["nodes"] or not where["nodes"]
    before = os.sched_getaffinity(0)
    assert step_state.main(["--node", "4096", "--fresh-only"]) == 0
    assert capsys.readouterr().out.strip() == "no NUMA node 4096 here" and os.sched_getaffinity(0) == before


def test_step_state_s_clock_counts_the_collector_s_runs_while_installed():
    """step_state.GcClock: each collection by generation and the time it took, only inside its ``with`` block."""
    import gc

    with step_state.GcClock() as clock:
        gc.collect(0)
        gc.collect()
    assert clock.runs[0] >= 1 and clock.runs[2] >= 1 and clock.seconds > 0
    assert clock not in gc.callbacks
    runs = list(clock.runs)
    gc.collect()
    assert clock.runs == runs


@pytest.mark.interpreter("without a GPU the script has nothing to time")
def test_route_check_explains_itself_without_a_gpu(capsys):
    assert route_check.main(["--quick"]) == 0
    assert "No Hopper GPU here" in capsys.readouterr().out


def test_route_check_turns_off_one_pass_s_route_at_a_time_and_restores_the_shipped_switches():
    """benchmarks/route_check.py: ``forward`` turns off the two forward thresholds and leaves autograd's backward as
    shipped; ``training`` turns off autograd's backward with the forward as shipped; ``sinks`` turns the Gluon
    backward's sinks switch the other way; ``on`` puts back what shipped."""
    from course_utils.kernels import dispatch

    shipped = (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG)
    sinks, window_min_n = fb.GLUON_SINKS, dispatch.GLUON_WINDOW_MIN_N
    assert shipped == (4096, 1024, fb.GLUON_DEFAULT) and window_min_n == 8192  # what the script times against none
    try:
        route_check.set_route("forward", False)
        assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG) == (None, None, fb.GLUON_DEFAULT)
        assert dispatch.GLUON_WINDOW_MIN_N is None
        route_check.set_route("training", False)
        assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG) == (4096, 1024, None)
        assert dispatch.GLUON_WINDOW_MIN_N == window_min_n
        route_check.set_route("training", True)
        assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG) == shipped
        route_check.set_route("forward", False)
        route_check.set_route("forward", True)
        assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG) == shipped
        for on in (False, True):  # the Gluon backward for sinks never, then always; everything else as shipped
            route_check.set_route("sinks", on)
            assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG) == shipped
            assert fb.GLUON_SINKS is on
        route_check.set_route("training", False)
        assert fb.GLUON_SINKS is sinks is None  # shipped: the model decides
        route_check.set_route("sinks", True)
        route_check.restore()
        assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS) == (*shipped, None)
        assert dispatch.GLUON_WINDOW_MIN_N == window_min_n
    finally:
        dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG = shipped
        fb.GLUON_SINKS, dispatch.GLUON_WINDOW_MIN_N = sinks, window_min_n


def test_route_check_s_fma_mode_turns_the_fma_softmax_and_nothing_else():
    """``fma``: ``dispatch.GLUON_FMA`` on or off, every threshold and the backward as shipped; ``restore`` puts back
    the shipped value. Its points are where the Gluon forward runs (N from GLUON_MIN_N), and time the forward alone."""
    from course_utils.kernels import dispatch

    shipped = (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS)
    fma = dispatch.GLUON_FMA
    try:
        for on in (True, False):
            route_check.set_route("fma", on)
            assert dispatch.GLUON_FMA is on
            assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS) == shipped
        route_check.set_route("fma", not fma)
        route_check.set_route("forward", False)  # another mode leaves the switch as shipped
        assert dispatch.GLUON_FMA is fma
        route_check.set_route("fma", not fma)
        route_check.restore()
        assert dispatch.GLUON_FMA is fma
    finally:
        dispatch.GLUON_FMA = fma
        route_check.restore()
    assert route_check.FMA_POINTS and all(n >= dispatch.GLUON_MIN_N for _, _, n in route_check.FMA_POINTS)
    assert set(route_check.FMA_POINTS) < set(route_check.FORWARD_POINTS)


def test_route_check_s_persistent_mode_turns_the_noncausal_persistent_grid_and_nothing_else():
    """``persistent``: ``dispatch.GLUON_NONCAUSAL_PERSISTENT`` on or off, everything else as shipped; its points are
    plain attention from GLUON_MIN_N, the one mode timed without the causal mask."""
    from course_utils.kernels import dispatch

    shipped = (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS, dispatch.GLUON_FMA)
    persistent = dispatch.GLUON_NONCAUSAL_PERSISTENT
    try:
        for on in (False, True):
            route_check.set_route("persistent", on)
            assert dispatch.GLUON_NONCAUSAL_PERSISTENT is on
            assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS,
                    dispatch.GLUON_FMA) == shipped
        route_check.set_route("persistent", not persistent)
        route_check.set_route("fma", True)  # another mode leaves it as shipped
        assert dispatch.GLUON_NONCAUSAL_PERSISTENT is persistent
        route_check.set_route("persistent", not persistent)
        route_check.restore()
        assert dispatch.GLUON_NONCAUSAL_PERSISTENT is persistent and dispatch.GLUON_FMA is shipped[-1]
    finally:
        dispatch.GLUON_NONCAUSAL_PERSISTENT = persistent
        route_check.restore()
    points = route_check.PERSISTENT_POINTS
    assert points and all(w is None and n >= dispatch.GLUON_MIN_N for w, _, n in points)


def test_route_check_s_walk_modes_turn_the_walks_and_nothing_else():
    """``walk``: ``dispatch.GLUON_WALK_KV_HEADS`` on or off; ``walkbwd`` / ``walkbwd_noncausal``:
    ``fast_backward.GLUON_WALK_ROWS`` at ``WALK_ROWS`` or ``None``; everything else as shipped, and ``restore`` puts
    both back. ``walk`` and ``walkbwd_noncausal`` are timed without the causal mask, the backward modes as steps."""
    from course_utils.kernels import dispatch

    shipped = (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS, dispatch.GLUON_FMA,
               dispatch.GLUON_NONCAUSAL_PERSISTENT)
    walks = (dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS)
    assert walks == (True, route_check.WALK_ROWS)  # both on as shipped, the backward's at the rows timed
    try:
        for on in (False, True):
            route_check.set_route("walk", on)
            assert (dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS) == (on, walks[1])
            for mode in ("walkbwd", "walkbwd_noncausal"):
                route_check.set_route(mode, on)
                assert (dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS) == (walks[0], route_check.WALK_ROWS if on
                                                                                  else None)
                assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS,
                        dispatch.GLUON_FMA, dispatch.GLUON_NONCAUSAL_PERSISTENT) == shipped
        route_check.set_route("walkbwd", False)
        route_check.restore()
        assert (dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS) == walks
    finally:
        dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS = walks
        route_check.restore()
    assert {"walk", "walkbwd_noncausal"} <= set(route_check.NONCAUSAL_MODES)
    assert "walkbwd" not in route_check.NONCAUSAL_MODES
    assert all(w is None and n >= dispatch.GLUON_MIN_N for w, _, n in route_check.WALK_POINTS)


def test_route_check_s_window_modes_turn_their_switch_and_nothing_else():
    """``walkwindow``: ``dispatch.GLUON_WALK_WINDOWS`` on or off, at windows the Gluon route's persistent grid takes;
    ``walkcausal``: ``dispatch.GLUON_WALK_CAUSAL`` on or off, at plain causal attention's walk points;
    ``fullwindow``: ``kernels.window_in_effect`` as shipped (``on``) or passing every window through (``off``), at
    windows of N keys, timed as steps; the other walks as shipped, and ``restore`` puts both back."""
    import torch

    from course_utils import kernels
    from course_utils.kernels import dispatch

    shipped = (dispatch.GLUON_MIN_N, dispatch.GLUON_WINDOW_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG,
               dispatch.GLUON_FMA, dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS)
    q = torch.zeros(1, 4, 4096, 8)
    assert dispatch.GLUON_WALK_WINDOWS is False and kernels.window_in_effect is dispatch.window_in_effect
    assert dispatch.GLUON_WALK_CAUSAL is False
    try:
        for on in (False, True):
            route_check.set_route("walkwindow", on)
            assert dispatch.GLUON_WALK_WINDOWS is on and kernels.window_in_effect is dispatch.window_in_effect
            assert dispatch.GLUON_WALK_CAUSAL is False
            route_check.set_route("walkcausal", on)
            assert dispatch.GLUON_WALK_CAUSAL is on and dispatch.GLUON_WALK_WINDOWS is False
            route_check.set_route("fullwindow", on)
            assert dispatch.GLUON_WALK_WINDOWS is False and dispatch.GLUON_WALK_CAUSAL is False
            assert kernels.window_in_effect(q, 4096, 4) == ((None, 0) if on else (4096, 4))
            assert (dispatch.GLUON_MIN_N, dispatch.GLUON_WINDOW_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG,
                    dispatch.GLUON_FMA, dispatch.GLUON_WALK_KV_HEADS, fb.GLUON_WALK_ROWS) == shipped
        route_check.set_route("walkwindow", True)
        route_check.set_route("fullwindow", False)
        route_check.restore()
        assert dispatch.GLUON_WALK_WINDOWS is False and kernels.window_in_effect is dispatch.window_in_effect
        route_check.set_route("walkcausal", True)
        route_check.restore()
        assert dispatch.GLUON_WALK_CAUSAL is False
    finally:
        dispatch.GLUON_WALK_WINDOWS, kernels.window_in_effect = False, dispatch.window_in_effect
        dispatch.GLUON_WALK_CAUSAL = False
        route_check.restore()
    assert all(w >= dispatch.GLUON_MIN_WINDOW and n >= dispatch.GLUON_WINDOW_MIN_N and w < n
               for w, _, n in route_check.WALK_WINDOW_POINTS)
    assert all(w >= n for w, _, n in route_check.FULL_WINDOW_POINTS)
    assert not {"walkwindow", "fullwindow", "walkcausal"} & set(route_check.NONCAUSAL_MODES)
    assert route_check.MODES["walkcausal"] == route_check.WALK_POINTS



def test_route_check_s_min4k_modes_lower_the_gluon_threshold_and_nothing_else():
    """``min4k`` / ``min4k_noncausal``: ``dispatch.GLUON_MIN_N`` at the candidate, as shipped (on), or at the
    threshold before it (off); ``min4k_window``: ``dispatch.GLUON_WINDOW_MIN_N`` at the candidate (on) or as shipped,
    the threshold before (off); the other switches as shipped. The first two's one point is at the candidate, below
    the threshold before (so ``off`` runs lesson 06's kernel there), the second without the causal mask; the third's
    points are lesson 08's windows wide enough for the route, at the candidate."""
    from course_utils.kernels import dispatch

    others = (dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS, dispatch.GLUON_FMA,
              dispatch.GLUON_NONCAUSAL_PERSISTENT)
    shipped = (dispatch.GLUON_MIN_N, dispatch.GLUON_WINDOW_MIN_N)
    candidate, before = route_check.MIN_N_CANDIDATE, route_check.MIN_N_BEFORE
    try:
        for mode, moved in (("min4k", 0), ("min4k_noncausal", 0), ("min4k_window", 1)):
            for on, want in ((True, candidate), (False, before)):
                route_check.set_route(mode, on)
                thresholds = (dispatch.GLUON_MIN_N, dispatch.GLUON_WINDOW_MIN_N)
                assert thresholds[moved] == want and thresholds[1 - moved] == shipped[1 - moved], mode
                assert (dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS, dispatch.GLUON_FMA,
                        dispatch.GLUON_NONCAUSAL_PERSISTENT) == others
        route_check.set_route("min4k", False)
        route_check.set_route("fma", True)  # another mode puts the thresholds back
        assert (dispatch.GLUON_MIN_N, dispatch.GLUON_WINDOW_MIN_N) == shipped
        route_check.set_route("min4k_window", True)
    finally:
        route_check.restore()
    assert (dispatch.GLUON_MIN_N, dispatch.GLUON_WINDOW_MIN_N) == shipped == (candidate, before)
    assert route_check.MIN_N_POINTS == [(None, 0, candidate)]
    windows = route_check.MIN_N_WINDOW_POINTS  # windows wide enough for the route, at the candidate
    assert windows and all(w >= dispatch.GLUON_MIN_WINDOW and n == candidate for w, _, n in windows)
    assert {s for _, s, _ in windows} == {0, 4} and "min4k_window" not in route_check.NONCAUSAL_MODES
    assert "min4k_noncausal" in route_check.NONCAUSAL_MODES and "min4k" not in route_check.NONCAUSAL_MODES


def test_route_check_s_fp8_modes_turn_one_fp8_switch_and_nothing_else():
    """``fp8persistent`` / ``fp8persistent_noncausal``: ``fp8.GLUON_PERSISTENT`` on or off; ``fp8transpose``:
    ``fp8.FAST_TRANSPOSE`` on or off; ``fp8wide`` / ``fp8wide_noncausal``: ``fp8.GLUON_WIDE`` on or off; ``fp8walk``
    / ``fp8walk_noncausal``: ``fp8.GLUON_WALK`` on or off; every other
    switch as shipped; their points are where flash_attention_fp8's Gluon route runs (N from fp8.GLUON_MIN_N), the
    ``_noncausal`` ones without the causal mask."""
    from course_utils.kernels import dispatch, fp8

    others = (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS, dispatch.GLUON_FMA,
              dispatch.GLUON_NONCAUSAL_PERSISTENT)
    switches = lambda: (fp8.GLUON_PERSISTENT, fp8.FAST_TRANSPOSE, fp8.GLUON_WIDE, fp8.GLUON_WALK)  # noqa: E731
    shipped = switches()
    assert shipped[2] is False and shipped[3] is False  # the wide tiles and the walk wait for a GPU's timing
    which = {"fp8persistent": 0, "fp8persistent_noncausal": 0, "fp8transpose": 1, "fp8wide": 2, "fp8wide_noncausal": 2,
             "fp8walk": 3, "fp8walk_noncausal": 3}
    try:
        assert set(route_check.FP8_MODES) == set(which)
        for mode in route_check.FP8_MODES:
            for on in (True, False):
                route_check.set_route(mode, on)
                want = list(shipped)
                want[which[mode]] = on
                assert switches() == tuple(want), mode
                assert (dispatch.GLUON_MIN_N, dispatch.GLUON_MIN_WINDOW, fb.AUTOGRAD_CONFIG, fb.GLUON_SINKS,
                        dispatch.GLUON_FMA, dispatch.GLUON_NONCAUSAL_PERSISTENT) == others
        route_check.set_route("fp8persistent", not shipped[0])
        route_check.set_route("fma", True)  # another mode puts them back
        assert switches() == shipped
        route_check.set_route("fp8wide", not shipped[2])
        route_check.set_route("fp8walk", not shipped[3])
    finally:
        route_check.restore()
    assert switches() == shipped
    assert route_check.FP8_POINTS and all(w is None and n >= fp8.GLUON_MIN_N for w, _, n in route_check.FP8_POINTS)
    for mode in ("fp8persistent", "fp8wide"):
        assert f"{mode}_noncausal" in route_check.NONCAUSAL_MODES and mode not in route_check.NONCAUSAL_MODES


def test_route_check_s_sink_points_have_sinks_beyond_their_window():
    """The ``sinks`` points: 4 sinks and a window shorter than N (under a longer one the sinks select nothing and the
    call takes the Gluon backward either way)."""
    assert route_check.SINK_POINTS and all(s == 4 and w < n for w, s, n in route_check.SINK_POINTS)


@pytest.mark.interpreter("without a GPU the script has nothing to time")
def test_host_overhead_launches_explains_itself_without_a_gpu(capsys):
    assert host_overhead.main(["--launches", "W=256 S=0 N=4k"]) == 0
    assert capsys.readouterr().out.strip() == bench.NO_GPU_MESSAGE


def test_host_overhead_launches_takes_only_a_case_label():
    with pytest.raises(SystemExit):
        host_overhead.main(["--launches", "W=256 N=4k"])


def test_host_overhead_cases_name_their_window_sinks_and_batch():
    """Each case label says what the step runs, the batch included (training_bench's main case at that N, or
    window_bench's batch of 1); the recorded runs used the same labels (tests/test_results.py)."""
    for label, kind, n, w, s in host_overhead.CASES:
        assert f"N={n // 1024}k" in label
        assert (kind == "window") == (w is not None) and (kind != "window" or f"W={w} S={s}" in label)
        if kind != "window":
            batch = bench.STANDARD_SUITE[0].batch(n) if kind == "training" else bench.window.BATCH
            assert label.endswith(f"B={batch}")


@pytest.mark.interpreter("without a GPU the script has nothing to time")
def test_host_overhead_layers_explains_itself_without_a_gpu(tmp_path, capsys):
    out = tmp_path / "layers.json"
    assert host_overhead.main(["--layers", str(out)]) == 0
    assert capsys.readouterr().out.strip() == bench.NO_GPU_MESSAGE and not out.exists()


def test_host_overhead_layer_points_are_window_grid_points_and_the_recorded_file_has_them():
    """--layers times points of the window grid (batch 1), and results/window_host_layers.json holds each of
    them with every timed layer's host, do_bench and graph times."""
    from course_utils import results

    doc = results.load("window_host_layers")
    assert list(doc["points"]) == [f"W={w} S={s} N={n}" for w, s, n in host_overhead.LAYER_POINTS]
    for w, s, n in host_overhead.LAYER_POINTS:
        assert w in bench.window.WINDOWS and s in bench.window.SINKS and n in bench.window.NS
    for row in doc["points"].values():
        for name in host_overhead.TIMED_LAYERS:
            assert all(row[key] > 0 for key in (name, f"do_bench {name}", f"graph {name}"))
    assert doc["info"]["what"] == host_overhead.LAYERS_WHAT


def test_host_overhead_layers_markdown_renders_each_point_from_the_file():
    from course_utils import results

    doc = results.load("window_host_layers")
    text = host_overhead.layers_markdown(doc)
    for key, row in doc["points"].items():
        ratio = row["graph flex"] / row["graph public flash_attention_with_lse"]
        assert f"| {key} | {row['graph public flash_attention_with_lse']:.1f} us |" in text and f"{ratio:.2f}x" in text


def _ncu_raw_csv(kernels):
    """A small `ncu --csv --page raw` output: a log line, the header, the units row, one row per (name, ms, tensor %)."""
    header = ["ID", "Kernel Name", "gpu__time_duration.sum",
              "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"]
    units = ["", "", "msecond", "%", "ratio", "ratio"]
    rows = [[str(i), name, f"{ms}", f"{tensor}", "0.5", "9.0"] for i, (name, ms, tensor) in enumerate(kernels)]
    quote = lambda r: ",".join(f'"{c}"' for c in r)  # noqa: E731
    return "==PROF== Connected to process\n" + "\n".join(quote(r) for r in [header, units, *rows]) + "\n"


def test_the_backward_profile_keeps_every_kernel_of_a_provider_in_launch_order():
    """ncu_backward: each provider's kernels in the order ncu saw them, durations in microseconds, each kernel's
    share of the summed backward, and the stalls without `selected` (issuing is not waiting)."""
    text = _ncu_raw_csv([("attn_bwd_preprocess(int)", 0.25, 1.0), ("_attn_bwd_dkdv(int)", 2.0, 55.5),
                         ("_attn_bwd_dq(int)", 1.75, 48.0)])
    p = ncu_backward.provider_summary(ncu_backward.parse_raw_csv(text))
    assert [k["kernel_name"] for k in p["kernels"]] == ["attn_bwd_preprocess(int)", "_attn_bwd_dkdv(int)",
                                                         "_attn_bwd_dq(int)"]
    assert p["total_us"] == pytest.approx(4000.0)
    assert p["kernels"][1]["top_stalls"] == {"wait": 0.5}
    summary = dict(gpu="Fake GPU", torch="t", triton="tr", ncu="n", providers={"course": p, "sdpa_cudnn": dict(error="E")})
    md = ncu_backward.markdown(summary)
    dkdv = next(line for line in md.splitlines() if "_attn_bwd_dkdv" in line)
    assert "| 2000 | 50% | 55.5 |" in dkdv
    assert "| course | **all kernels** | **4000** |" in md and "| sdpa_cudnn | error: E |" in md


@pytest.mark.interpreter("without a GPU there is nothing to profile")
def test_the_backward_profile_explains_itself_without_a_gpu(tmp_path, capsys):
    assert ncu_backward.main(["--all", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "ncu_backward.json").exists()


tune_decode_variants = _load("tune_decode_variants")


@pytest.mark.parametrize("variant", list(tune_decode_variants.VARIANTS))
def test_each_decode_variant_is_right_at_every_split_count_and_leaves_its_counter_at_zero(variant):
    """The variants of benchmarks/tune_decode_variants.py against the float32 reference, with ragged lengths and a
    ragged last block; a second call gives the same result (the fused variant's counters are reset)."""
    from course_utils.bench import decode as db

    if variant == "tma" and ON_GPU and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("device-side TMA descriptors need a Hopper GPU")
    context = 6 * 64 + 7
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 1, 64, generator=g).to(DEVICE, torch.float16)  # GQA 8 / 2
    k, v = (torch.randn(2, 2, context, 64, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    seqlens = torch.tensor([context, context - 70], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2, 3):
        first = tune_decode_variants.launch(q, k, v, seqlens, splits, variant, 3)
        again = tune_decode_variants.launch(q, k, v, seqlens, splits, variant, 3)
        for b in range(2):
            want = db.reference(q[b:b + 1], k[b:b + 1, :, :seqlens[b]], v[b:b + 1, :, :seqlens[b]], 0)
            assert _rel(first[b].float().cpu(), want.cpu()) < 1e-2, (splits, b)
        assert torch.equal(first, again), splits
    assert all(not c.any() for c in tune_decode_variants._counters.values())
    with pytest.raises(ValueError, match="one new token"):
        tune_decode_variants.launch(q.expand(2, 8, 2, 64), k, v, seqlens, 2, variant, 3)


def test_the_decode_variants_table_shows_each_round_s_ratio_to_cudnn():
    """Each cell is the lowest and highest ratio over the rounds; a variant's ratio is its best launch's."""
    def row(rnd, name, gbps, **kw):
        return dict(batch=1, context=1024, round=rnd, name=name, gbps=gbps, **kw)

    rows = [row(1, "sdpa_cudnn", 400.0), row(1, "course", 380.0), row(1, "tma", 300.0), row(1, "tma", 360.0),
            row(1, "fused", None, note="RuntimeError: wrong"),
            row(2, "sdpa_cudnn", 400.0), row(2, "course", 390.0), row(2, "tma", 350.0)]
    doc = dict(info=dict(gpu="Fake GPU", torch="t", triton="tr", date="d"), rows=rows)
    (line,) = tune_decode_variants.summary(doc)
    assert line["course"] == pytest.approx((0.95, 0.975)) and line["tma"] == pytest.approx((0.875, 0.9))
    assert line["fused"] is None
    md = tune_decode_variants.markdown(doc)
    assert "| 1 | 1024 | 0.95–0.97× | 0.88–0.90× | — |" in md
    assert "`tma` 0 of 1, `fused` 0 of 1" in md


@pytest.mark.interpreter("checks what the script does on a machine without a GPU")
def test_the_decode_variants_explain_themselves_without_a_gpu(tmp_path, capsys):
    assert tune_decode_variants.main(["--out", str(tmp_path / "v.json")]) == 0
    assert "No CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "v.json").exists()


@pytest.mark.interpreter("on a GPU the plan's steps are the session itself (minutes each), not a test")
def test_the_gpu_plan_runs_its_steps_and_splits_the_suite_in_two(tmp_path):
    """benchmarks/gpu_plan.sh: `halves` names every tests/ file once; a step runs each command under the budget and
    logs how it ended (without a GPU the tune scripts say so and exit 0); an unknown step is refused."""
    import subprocess
    import sys

    env = dict(__import__("os").environ, OUT=str(tmp_path), PYTHON=sys.executable, STEP_BUDGET="300")
    run = subprocess.run(["bash", str(BENCHMARKS / "gpu_plan.sh"), "halves", "fwd", "hoststep"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    halves = dict(line.split(": ", 1) for line in run.stdout.splitlines() if line.startswith("half "))
    files = [f for half in ("half 1", "half 2") for f in halves[half].split()]
    assert sorted(files) == sorted(f"tests/{p.name}" for p in (BENCHMARKS.parent / "tests").glob("test_*.py"))
    assert halves["half 1"].split()[-1] == "tests/test_grading_part2.py"
    log = (tmp_path / "plan.log").read_text().splitlines()
    assert [line.split(":")[0] for line in log] == ["fwd_causal", "fwd_noncausal", "host_step"]
    assert all("rc=0" in x for x in log)
    assert "No CUDA GPU here" in (tmp_path / "fwd_causal.log").read_text()
    assert "No CUDA GPU here" in (tmp_path / "host_step.log").read_text()
    (tmp_path / "host_step.log").unlink()
    bad = subprocess.run(["bash", str(BENCHMARKS / "gpu_plan.sh"), "bogus"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown step: bogus" in bad.stdout
    # more than the 8 files a device call brings back: packed into one archive, plan.log beside it
    import tarfile

    for i in range(8):
        (tmp_path / "sub").mkdir(exist_ok=True)
        (tmp_path / "sub" / f"w{i}.json").write_text(str(i))
    (tmp_path / "plan.log").unlink()
    packed = subprocess.run(["bash", str(BENCHMARKS / "gpu_plan.sh"), "halves"], env=env, capture_output=True, text=True)
    assert packed.returncode == 0 and "packed 10 files into out.tar.gz" in packed.stdout
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["out.tar.gz", "plan.log"]
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(["./fwd_causal.log", "./fwd_noncausal.log"] +
                                                [f"./sub/w{i}.json" for i in range(8)])


@pytest.mark.interpreter("on a GPU the plan's steps are the session itself (minutes each), not a test")
def test_the_gpu_plan_runs_nothing_on_another_gpu_than_the_one_required(tmp_path):
    """REQUIRE_GPU: without that GPU (none here) the plan says what it found and runs no step; without the variable
    the same step runs."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, STEP_BUDGET="120", REQUIRE_GPU="H200")
    run = subprocess.run(["bash", str(BENCHMARKS / "gpu_plan.sh"), "fwd"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    log = (tmp_path / "plan.log").read_text().splitlines()
    assert log == ["REQUIRE_GPU=H200: this machine has no NVIDIA GPU; nothing run"]
    assert not (tmp_path / "fwd_causal.log").exists()
    del env["REQUIRE_GPU"]
    subprocess.run(["bash", str(BENCHMARKS / "gpu_plan.sh"), "fwd"], env=env, capture_output=True, text=True,
                   timeout=300, check=True)
    assert (tmp_path / "fwd_causal.log").exists()


@pytest.mark.parametrize("causal", [False, True])
def test_the_gluon_probe_s_reference_holds_a_few_heads_scores_at_a_time(causal, monkeypatch):
    """hopper_ws_probe's float32 reference (o by SDPA, lse by chunks of heads, the causal mask applied in place):
    the same numbers as the float64 reference whether it takes all heads at once or one at a time (the causal 16k
    case ran out of memory on an 80-GiB H100 when it held all 32 heads' scores twice)."""
    probe = _load("hopper_ws_probe")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 48, 16, generator=g) for h in (4, 2, 2))
    want_o, want_lse = references.attention_lse(q.double().numpy(), *(t.double().repeat_interleave(2, 1).numpy() for t in (k, v)),
                                                causal=causal)
    for chunk in (1 << 30, 48 * 48 * 4):  # every head at once; one head at a time
        monkeypatch.setattr(probe, "REFERENCE_CHUNK_BYTES", chunk)
        o, lse = probe._reference(q, k, v, causal)
        assert torch.allclose(o.double(), torch.from_numpy(want_o), atol=1e-5)
        assert torch.allclose(lse.double(), torch.from_numpy(want_lse), atol=1e-5)


def test_the_gluon_probe_can_time_some_loops_only():
    """hopper_ws_probe --loops: the variants of those loops, in the probe's order (the most promising first)."""
    probe = _load("hopper_ws_probe")
    picked = probe.selected("fwd", ["overlap", "serial"])
    assert picked and {v["loop"] for v in picked} == {"overlap", "serial"}
    assert picked == [v for v in probe.selected("fwd") if v["loop"] in ("overlap", "serial")]
    assert {v.get("persistent", False) for v in picked} == {False, True}  # serial persistent too
    assert probe.selected("fp8", ["pipelined"]) == [] and len(probe.selected("fp8")) == 5


def test_the_gluon_probe_can_time_the_persistent_grids_alone():
    """hopper_ws_probe --persistent only|none: the window kind's variants split by grid, nothing lost or repeated."""
    probe = _load("hopper_ws_probe")
    only, none = probe.selected("window", persistent=True), probe.selected("window", persistent=False)
    assert only and none and all(v.get("persistent") for v in only) and not any(v.get("persistent") for v in none)
    assert sorted(map(str, only + none)) == sorted(map(str, probe.selected("window")))
    # gpu_plan's gluonfwdp: the forward's persistent serial loop with and without the FMA softmax
    assert [v["fma"] for v in probe.selected("fwd", ["serial"], persistent=True)] == [False, True]


def test_the_class_grading_benchmark_appends_each_run_it_records(tmp_path):
    """benchmarks/grade_class.py --json: each run's summary appended to the file's runs (results/grade_class.json is
    what the README's grading times quote), the file created with the script's one-line description."""
    grade_class = _load("grade_class")
    path = tmp_path / "grade_class.json"
    grade_class.record(path, {"learners": 1, "wall_s": 50.0})
    grade_class.record(path, {"learners": 4, "wall_s": 180.0})
    import json

    data = json.loads(path.read_text())
    assert data["what"].startswith("How fast the batch grader grades a class")
    assert [r["learners"] for r in data["runs"]] == [1, 4] and data["runs"][1]["wall_s"] == 180.0


@pytest.mark.interpreter("on a GPU the plan's steps are the session itself (minutes each), not a test")
def test_the_gpu_plan_runs_its_else_steps_on_another_gpu(tmp_path):
    """ELSE_STEPS with REQUIRE_GPU: on another GPU (an nvidia-smi that names an H100, in a scratch copy of the plan
    with no wheels beside it) the plan runs those steps instead of the asked ones; on the required GPU the asked ones;
    with no GPU at all still nothing."""
    import os
    import shutil
    import subprocess
    import sys

    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(BENCHMARKS / "gpu_plan.sh", root / "benchmarks" / "gpu_plan.sh")
    (root / "tests").mkdir()
    (root / "tests" / "test_a.py").write_text("")
    fake = tmp_path / "bin"
    fake.mkdir()

    def plan(gpu, *steps, **env):
        out = tmp_path / f"out_{len(list(tmp_path.glob('out_*')))}"
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}'\n" if gpu else "#!/bin/sh\nexit 9\n")
        (fake / "nvidia-smi").chmod(0o755)
        run = subprocess.run(["bash", str(root / "benchmarks" / "gpu_plan.sh"), *steps], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, OUT=str(out), PYTHON=sys.executable, STEP_BUDGET="60",
                                              PATH=f"{fake}:{os.environ['PATH']}", **env))
        return run, (out / "plan.log").read_text().splitlines() if (out / "plan.log").exists() else []

    run, log = plan("NVIDIA H100 80GB HBM3", "grids", REQUIRE_GPU="H200", ELSE_STEPS="halves")
    assert run.returncode == 0, run.stderr
    assert log == ["REQUIRE_GPU=H200: this machine has NVIDIA H100 80GB HBM3; running ELSE_STEPS instead: halves"]
    assert "half 1: tests/test_a.py" in run.stdout and "window_256" not in run.stdout  # halves ran, the grids did not
    run, log = plan("NVIDIA H200", "halves", REQUIRE_GPU="H200", ELSE_STEPS="grids")
    assert run.returncode == 0 and log == [] and "half 1: tests/test_a.py" in run.stdout  # the asked step
    run, log = plan("", "grids", REQUIRE_GPU="H200", ELSE_STEPS="halves")
    assert run.returncode == 0 and log == ["REQUIRE_GPU=H200: this machine has no NVIDIA GPU; nothing run"]


def test_ncu_source_ranks_a_kernel_s_instructions_by_their_stall_samples(tmp_path):
    """benchmarks/ncu_source.py: ncu's source page (its messages first, then the header and one row per SASS
    instruction) read into rows, the instructions ranked by samples, the samples summed by opcode (predicates and
    modifiers dropped), and the summary rebuilt from a kept CSV without a GPU."""
    ncu_source = _load("ncu_source")
    page = "\n".join([
        "==PROF== Connected to process 1",
        '"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
        '"0x7f00","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR14+0x140e0], R22","1,200","1,150"',
        '"0x7f10","QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT","100","20"',
        '"0x7f20","MUFU.EX2 R25, R155","300","100"',
        '"0x7f30","@!P0 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80","1,800","1,790"',
        '"0x7f40","MUFU.EX2 R23, R23","600","200"'])
    rows = ncu_source.parse_source_csv(page)
    assert [r["samples"] for r in rows] == [1200, 100, 300, 1800, 600] and rows[3]["not_issued"] == 1790
    # the header as other tools' readers of this page find it: "Address" without "#", a "Kernel Name" row first,
    # per-reason columns after the totals
    other = page.replace('"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling '
                         '(Not-issued Samples)"', '"Kernel Name","attention"\n"Address","Source","Warp Stall Sampling '
                         '(All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier"')
    assert other != page and ncu_source.parse_source_csv(other) == rows
    assert [ncu_source.opcode(r["sass"]) for r in rows] == ["SYNCS", "QGMMA", "MUFU", "BAR", "MUFU"]
    summary = ncu_source.summarise(rows, top=2)
    assert [r["address"] for r in summary["top"]] == ["0x7f30", "0x7f00"] and summary["top"][0]["pct"] == 45.0
    assert [(o["opcode"], o["samples"]) for o in summary["by_opcode"]] == [("BAR", 1800), ("SYNCS", 1200),
                                                                           ("MUFU", 900), ("QGMMA", 100)]
    (tmp_path / "ncu").mkdir()
    (tmp_path / "ncu" / "ncu_source_gluon_fp8_serial.csv").write_text(page)
    (tmp_path / "ncu_source.json").write_text('{"kernels": {"gluon_fp8_serial": {}}}')
    assert ncu_source.main(["--from-csv", "--out", str(tmp_path), "--top", "3"]) == 0
    text = (tmp_path / "ncu_source.md").read_text()
    assert "5 instructions, 4000 samples. By opcode: BAR 45.0%, SYNCS 30.0%, MUFU 22.5%, QGMMA 2.5%." in text
    assert "| 0x7f30 | `@!P0 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80` | 45.0 | 1790 |" in text


@pytest.mark.skipif(ON_GPU, reason="the CPU's path: on a Hopper GPU the script times the kernels")
def test_gluon_ab_calls_each_version_s_fp8_entry_and_says_when_it_cannot_time(capsys):
    """benchmarks/gluon_ab.py: without a Hopper GPU it says so and exits 0; the call it times for a version of the
    kernels' module is that module's FP8 entry on V's K-major copy (here the model of lesson 11's machine runs it)."""
    gluon_ab = _load("gluon_ab")
    assert gluon_ab.main(["--variant", "before=course_utils/kernels/_base_hopper_ws.py"]) == 0
    assert "needs a Hopper GPU" in capsys.readouterr().out
    from course_utils.kernels import fp8, gluon_cpu, hopper_ws

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 256, 64, generator=gen) for h in (2, 1, 1))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    with gluon_cpu.running():
        got = gluon_ab._fp8_call(hopper_ws, q8, k8, v8, (qs, ks, vs), True)()
        want = hopper_ws.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, True)[0]
        wide = gluon_ab._fp8_call(hopper_ws, q8, k8, v8, (qs, ks, vs), True, **gluon_ab.WIDE["current_wide3"])()
        want_wide = hopper_ws.attention_fp8(q8, k8, v8.transpose(2, 3).contiguous(), qs, ks, vs, True, block_n=256,
                                            num_buffers=3)[0]  # --wide's call with 3 slots
    assert torch.equal(got, want) and torch.equal(wide, want_wide)
    assert gluon_ab.WIDE["current_wide"] == dict(block_n=256)  # the route's wide tiles (fp8.GLUON_WIDE)
    # --orders: the persistent grid walked a kv head's four query heads at a time (GQA 32/8), and as by default where
    # the route runs a program per tile (all but bf16 without the causal mask)
    persistent, grouped = dict(persistent=True), dict(persistent=True, heads_together=4)
    assert gluon_ab.orders("fp8", True) == gluon_ab.orders("fp8", False) == gluon_ab.orders("bf16", True) == {
        "current_persistent": persistent, "current_persistent_grouped": grouped}
    assert gluon_ab.orders("bf16", False) == {"current_grouped": grouped}
    q, k, v = (torch.randn(1, h, 256, 64, generator=gen) for h in (8, 2, 2))
    (q8, qs), (k8, ks), (v8, vs) = (fp8.quantize_fp8(t) for t in (q, k, v))
    with gluon_cpu.running():  # the calls --orders makes, as gluon_ab.measure makes them
        grouped = gluon_ab._fp8_call(hopper_ws, q8, k8, v8, (qs, ks, vs), True,
                                     **gluon_ab.orders("fp8", True)["current_persistent_grouped"])()
        want = gluon_ab._fp8_call(hopper_ws, q8, k8, v8, (qs, ks, vs), True, persistent=True)()
    assert torch.equal(grouped, want)  # the same tiles in another order: the route's output bit for bit
    # --kinds bwd: autograd's Gluon backward walked BWD_ROWS (batch, kv head) rows at a time, against its default
    from course_utils.kernels import hopper_ws_bwd

    q, k, v, do = (torch.randn(1, h, 256, 64, generator=gen).bfloat16() for h in (16, 4, 4, 16))
    o, lse = (torch.from_numpy(x) for x in references.attention_lse(*(t.double().numpy() for t in (q, k, v)),
                                                                    causal=True))
    o, lse = o.bfloat16(), lse.float()
    with gluon_cpu.running(host_modules=(hopper_ws_bwd, )):
        walked = hopper_ws_bwd.backward_validated(q, k, v, o, lse, do, True, None, heads_together=gluon_ab.BWD_ROWS)
        default = hopper_ws_bwd.backward_validated(q, k, v, o, lse, do, True, None)
    assert gluon_ab.BWD_ROWS == 4 and all(torch.equal(a, b) for a, b in zip(walked, default))


def test_the_membar_probe_counts_the_barriers_triton_puts_between_mbarrier_operations(tmp_path):
    """benchmarks/membar_probe.py: each pattern of the Gluon consumer's loop compiled for sm_90 with the installed
    Triton (in a process of its own, the compiler and no GPU) gives the counts recorded for that version in
    results/membar_probe.json (NOTES quotes them: a wait after a wait on another allocation costs no barrier, an
    arrive after a wait costs one; so does lesson 11); and its loop finder reads the body from the label to the branch
    back."""
    import subprocess
    import sys

    import triton

    probe = _load("membar_probe")
    ptx = "\n".join(["$L__BB0_1:", "\tbar.sync \t0;", "\t@%p1 bra \t$L__BB0_9;", "$L__BB0_2:  // loop",
                     "\tbar.sync \t0;", "\tmbarrier.try_wait", "\tbar.sync \t0;", "\t@%p2 bra \t$L__BB0_2;",
                     "\tbar.sync \t0;"])
    assert probe.loop_barriers(ptx) == 2
    recorded = json.loads((REPO / "results" / "membar_probe.json").read_text())
    notes, c = " ".join((REPO / "results" / "NOTES.md").read_text().split()), recorded["3.6.0"]  # the GPUs' Triton
    for words in (f"one `mbarrier.wait` a step costs {c['wait']}", f"one arrive a step {c['arrive']},",
                  f"a wait then a wait on another ring still {c['wait_then_wait']}",
                  f"a wait then an arrive on another ring {c['wait_then_arrive']}"):
        assert words in notes, words
    lesson = (f"a wait then a wait on another ring costs {c['wait_then_wait']} a step, a wait then an arrive on "
              f"another ring {c['wait_then_arrive']}")
    assert lesson in markdown_text("11_hopper_and_fp8"), lesson
    if triton.__version__ not in recorded:
        pytest.skip(f"results/membar_probe.json has no counts for triton {triton.__version__}")
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "membar_probe.py"), "--out",
                          str(tmp_path / "probe.json")], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "probe.json").read_text()) == {triton.__version__: recorded[triton.__version__]}
