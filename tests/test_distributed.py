"""course_utils.distributed: layouts, the merge, and ring attention on 2 and 4 gloo processes.

The process tests start real processes (spawn, gloo, Triton's interpreter on
the CPU) and compare the ring's o, dq, dk, dv with float64 single-process
attention. Starting processes and importing torch in each is most of their
cost, so each test runs several cases in one process group.
"""

import course_utils  # noqa: F401  (before triton: switches the interpreter on)

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from course_utils import distributed as ring
from course_utils import references as ref


# -----------------------------------------------------------------------------
# Layouts
# -----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    n = ring.n_chunks(world, layout) * 3
    x = torch.arange(2 * 3 * n * 4, dtype=torch.float32).reshape(2, 3, n, 4)
    shards = [ring.shard_sequence(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, n // world, 4) for s in shards)
    torch.testing.assert_close(ring.unshard_sequence(shards, world, layout), x, rtol=0, atol=0)
    # NumPy, sequence on axis -2, and a [..., N] array on axis -1
    a = x.numpy()
    shards = [ring.shard_sequence(a, r, world, layout, dim=-2) for r in range(world)]
    np.testing.assert_array_equal(ring.unshard_sequence(shards, layout=layout, dim=-2), a)
    lse = a[..., 0]
    shards = [ring.shard_sequence(lse, r, world, layout, dim=-1) for r in range(world)]
    np.testing.assert_array_equal(ring.unshard_sequence(shards, layout=layout, dim=-1), lse)


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    positions = np.arange(16)  # 2 ranks -> 4 chunks of 4
    assert ring.shard_sequence(positions, 0, 2, "zigzag", dim=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert ring.shard_sequence(positions, 1, 2, "zigzag", dim=0).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert ring.shard_sequence(positions, 1, 2, "contiguous", dim=0).tolist() == list(range(8, 16))
    assert ring.chunk_ids(1, 4, "zigzag") == [1, 6]


def test_bad_lengths_and_layouts_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        ring.shard_sequence(torch.zeros(1, 1, 10, 4), 0, 2, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        ring.shard_sequence(torch.zeros(1, 1, 8, 4), 0, 2, "striped")
    with pytest.raises(ValueError, match="shards"):
        ring.unshard_sequence([torch.zeros(1, 1, 4, 4)] * 2, world_size=3)


def test_step_plan_and_causal_relations():
    assert ring.block_relation(2, 1, True) == "full"
    assert ring.block_relation(1, 1, True) == "diagonal"
    assert ring.block_relation(1, 2, True) == "skip"
    assert ring.block_relation(1, 2, False) == "full"
    # zigzag, 2 ranks: rank 0 holds chunks 0, 3; rank 1 holds 1, 2
    assert ring.step_plan(0, 1, 2, "zigzag", True) == [(1, 0, "full"), (1, 1, "full")]
    assert ring.step_plan(1, 0, 2, "zigzag", True) == [(0, 0, "full"), (1, 0, "full")]
    assert ring.step_plan(1, 1, 2, "zigzag", True) == [(None, None, "diagonal")]
    assert ring.step_plan(0, 1, 2, "contiguous", True) == []
    assert ring.step_plan(0, 1, 2, "contiguous", False) == [(None, None, "full")]
    # the backward joins pairs that share a chunk (its kernels take different query and key lengths)
    assert ring._coalesce(ring.step_plan(0, 1, 2, "zigzag", True)) == [(1, None, "full")]
    assert ring._coalesce(ring.step_plan(1, 0, 2, "zigzag", True)) == [(None, 0, "full")]


def test_tile_work_is_balanced_by_zigzag_only():
    contiguous = ring.tile_work(64, 4, "contiguous", block=4)
    zigzag = ring.tile_work(64, 4, "zigzag", block=4)
    # 16 tiles a side, 4 per chunk: rank r sees r full chunks (16 tiles each) and its diagonal one (10)
    np.testing.assert_allclose(contiguous, [10, 26, 42, 58])
    np.testing.assert_allclose(zigzag, [34, 34, 34, 34])
    assert contiguous.sum() == zigzag.sum() == 16 * 17 / 2


def test_merge_of_two_key_blocks_equals_attention_over_both():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 8)) * 4 for _ in range(3))
    o_a, lse_a = ref.attention_lse(q, k[:, :4], v[:, :4])
    o_b, lse_b = ref.attention_lse(q, k[:, 4:], v[:, 4:])
    acc = torch.zeros(2, 6, 8)
    lse = torch.full((2, 6), -float("inf"))
    for o_x, lse_x in ((o_a, lse_a), (o_b, lse_b)):
        ring.merge_partials_(acc, lse, torch.from_numpy(o_x).float(), torch.from_numpy(lse_x).float())
    o_right, lse_right = ref.attention_lse(q, k, v)
    np.testing.assert_allclose(acc.numpy(), o_right, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), lse_right, atol=1e-5)


def test_the_one_kernel_merge_is_the_torch_merge_on_views_of_rows():
    # The fused merge of the block benchmark (course_utils.kernels.merge) against merge_partials_: rows of a
    # strided view, lse far from 0, a block that saw no key (lse_b = -inf), and rows that saw none on either side.
    from course_utils.kernels import merge

    device = course_utils.DEVICE
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 3, 40, 24, generator=g).to(device)
    rows = slice(5, 38)
    o_b = (torch.randn(2, 3, 33, 24, generator=g) * 3).to(device)
    lse_all = (torch.randn(2, 3, 40, generator=g) * 50 + 900).to(device)
    lse_b = (torch.randn(2, 3, 33, generator=g) * 50 + 900).to(device)
    lse_b[:, :, :4] = -float("inf")  # a block whose keys are all masked for these rows
    exact_acc, exact_lse = full.double(), lse_all.double()  # the same merge in float64: the truth
    ring.merge_partials_(exact_acc[:, :, rows], exact_lse[:, :, rows], o_b.double(), lse_b.double())
    torch_acc, torch_lse = full.clone(), lse_all.clone()
    ring.merge_partials_(torch_acc[:, :, rows], torch_lse[:, :, rows], o_b, lse_b)
    acc, lse = full.clone(), lse_all.clone()
    merge.merge_partials(acc[:, :, rows], lse[:, :, rows], o_b, lse_b)
    # At lse ~ 900 float32 resolves 6e-5: both merges round there; the kernel's must be no worse than torch's.
    for got, alt, exact in ((acc, torch_acc, exact_acc), (lse, torch_lse, exact_lse)):
        err, torch_err = ((x.double() - exact).abs().max().item() for x in (got, alt))
        assert err <= 1.01 * torch_err + 1e-6 and err < 2e-4 * exact.abs().max().item(), (err, torch_err)
    empty_acc, empty_lse = torch.zeros(1, 1, 5, 24, device=device), torch.full((1, 1, 5), -float("inf"), device=device)
    merge.merge_partials(empty_acc, empty_lse, torch.ones(1, 1, 5, 24, device=device),
                         torch.full((1, 1, 5), -float("inf"), device=device))
    assert torch.equal(empty_acc, torch.zeros_like(empty_acc)) and bool(torch.isneginf(empty_lse).all())
    with pytest.raises(ValueError, match="float32"):
        merge.merge_partials(acc.double(), lse.double(), full, lse_all)


def test_every_process_gets_the_no_multicast_environment():
    import os

    for name, value in ring.SAFE_ENV.items():
        assert os.environ[name] == value


# -----------------------------------------------------------------------------
# Real processes
# -----------------------------------------------------------------------------
def _run_and_compare(world, cases):
    results = ring.run_distributed(ring.demo_cases, world, args=(cases,), device="cpu", timeout_s=300)
    for index, case in enumerate(cases):
        errors = ring.demo_errors([r[index] for r in results], world, **case)
        assert max(errors.values()) < 2e-5, (case, errors)


@pytest.mark.cpu_processes("gloo processes on the CPU run the kernels in Triton's interpreter")
def test_two_processes_forward_and_backward():
    _run_and_compare(2, [
        dict(n=64, d=32, n_q_heads=4, n_kv_heads=2, causal=True, layout="zigzag", seed=1),
        dict(n=32, d=16, n_q_heads=2, n_kv_heads=2, causal=False, layout="contiguous", seed=2),
        dict(n=32, d=16, n_q_heads=2, n_kv_heads=1, causal=True, layout="contiguous", seed=3),
    ])


FOUR_RANKS = dict(n=64, d=16, n_q_heads=2, n_kv_heads=1, causal=True, layout="zigzag", seed=4)
TWO_RINGS = dict(n=32, d=16, n_q_heads=2, n_kv_heads=2, causal=True, layout="zigzag", seed=5)


def four_ranks_then_two_rings(rank, world):
    """One ring of 4, then two rings of 2 (process groups {0, 1} and {2, 3}) at once."""
    import torch.distributed as dist

    whole = ring.demo_case(rank, world, **FOUR_RANKS)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    half = ring.demo_case(rank % 2, 2, **TWO_RINGS, group=groups[rank // 2])
    # The per-step timeline the benchmark records, here on the whole ring of 4
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(3))
    forward, backward = [], []
    o, lse = ring.ring_attention_forward(q, k, v, True, timeline=forward)
    ring.ring_attention_backward(torch.ones_like(q), q, k, v, o, lse, True, timeline=backward)
    return whole, half, (ring.timeline_ms(forward), ring.timeline_ms(backward))


@pytest.mark.cpu_processes("gloo processes on the CPU run the kernels in Triton's interpreter")
def test_four_processes_forward_and_backward_and_subgroups():
    results = ring.run_distributed(four_ranks_then_two_rings, 4, device="cpu", timeout_s=300)
    errors = ring.demo_errors([r[0] for r in results], 4, **FOUR_RANKS)
    assert max(errors.values()) < 2e-5, errors
    for members in ((0, 1), (2, 3)):
        errors = ring.demo_errors([results[m][1] for m in members], 2, **TWO_RINGS)
        assert max(errors.values()) < 2e-5, (members, errors)
    for forward, backward in (r[2] for r in results):
        assert [s["step"] for s in forward] == [0, 1, 2, 3] and [s["step"] for s in backward] == [0, 1, 2, 3, 4]
        for s in forward + backward:
            assert s["exposed_wait_ms"] >= 0 and s["start_ms"] >= 0
        assert all(s["compute_ms"] > 0 for s in forward + backward[:4]) and backward[4]["compute_ms"] == 0
        assert [s["start_ms"] for s in forward] == sorted(s["start_ms"] for s in forward)


def test_bench_tables_say_what_was_measured_and_what_was_left_out(tmp_path):
    from course_utils.distributed import bench

    rows = [
        dict(n=32768, reps=3, ring_fwd_ms=50.0, ring_fwd_bwd_ms=180.0, one_gpu_fwd_ms=95.0, one_gpu_fwd_bwd_ms=350.0,
             torch_cp_fwd_ms=None, torch_cp_fwd_bwd_ms=None, torch_cp_note="context_parallel failed: X",
             o_rel_err_vs_1gpu=1e-3),
        dict(n=262144, reps=1, skipped="not run: predicted to end after the benchmark's 190 s budget"),
    ]
    text = bench.write_results(rows, 2, str(tmp_path), dict(gpu="H200", torch="2.11", triton="3.6", date="d"))
    assert "| 32768 | fwd | 344,926 | 655,360 | 1.90× | — | — |" in text
    assert "| 32768 | fwd+bwd | 93,623 | 182,044 | 1.94× |" in text
    assert "context_parallel failed: X" in text and "262144 | — | not run" in text
    assert (tmp_path / "ring_bench.json").exists() and (tmp_path / "ring_bench.md").read_text().strip() == text.strip()
    for name, value in ring.SAFE_ENV.items():
        assert f"{name}={value}" in text


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_the_block_bench_times_exactly_the_pairs_each_rank_computes(layout, world, causal):
    from course_utils.distributed import blocks

    n = 8 * ring.n_chunks(world, layout)
    for rank in range(world):
        calls = blocks.rank_blocks(n, world, rank, layout, causal)
        assert sum(blocks.visible_pairs(c) for c in calls) == ring.tile_work(n, world, layout, 1, causal)[rank]
        assert [c["merged"] for c in calls].count(False) == 1 and not calls[0]["merged"]  # the first block is copied
        for c in calls:
            assert 0 <= c["q_start"] and c["q_start"] + c["q_len"] <= n // world
            assert 0 <= c["k_start"] and c["k_start"] + c["k_len"] <= n // world


def test_block_bench_table_reads_its_rows(tmp_path):
    from course_utils.distributed import blocks

    rows = [dict(n=65536, provider="course", calls=3, merges=2, tflop_fwd=1.0, kernels_ms=4.0, forward_ms=5.0,
                 backward_ms=12.0),
            dict(n=65536, provider="cudnn", calls=3, merges=2, tflop_fwd=1.0, kernels_ms=3.0, forward_ms=4.0,
                 backward_ms=8.0, rel_err_vs_course=2e-3),
            dict(n=65536, provider="flash", error="RuntimeError: no kernel")]
    text = blocks.write_results(rows, str(tmp_path), dict(gpu="H200", torch="2.11", triton="3.6", date="d", world_size=2))
    # merges 1 ms of 5 (20%), 1 TFLOP in 5 ms (200 TFLOP/s); cuDNN's times over the course's: 0.80, 0.67
    assert "| 65536 | course | 3 | 4.00 | 5.00 | 20% | 200 | 12.00 | 1.00× | 1.00× |" in text
    assert "| 65536 | cudnn | 3 | 3.00 | 4.00 | 25% | 250 | 8.00 | 0.80× | 0.67× |" in text
    assert "flash: not timed (RuntimeError: no kernel)" in text and "2.0e-03" in text
    assert (tmp_path / "ring_blocks.md").read_text() == text


def test_bench_tables_give_both_rotate_methods_and_the_ring_s_steps(tmp_path):
    from course_utils.distributed import bench

    row = dict(n=65536, reps=3, ring_fwd_ms=50.0, ring_fwd_bwd_ms=200.0, one_gpu_fwd_ms=95.0, one_gpu_fwd_bwd_ms=380.0,
               torch_cp_allgather_fwd_ms=64.0, torch_cp_allgather_fwd_bwd_ms=160.0,
               torch_cp_alltoall_fwd_ms=40.0, torch_cp_alltoall_fwd_bwd_ms=250.0,
               torch_cp_allgather_note="rotate method _RotateMethod.ALL_GATHER",
               torch_cp_alltoall_note="rotate method _RotateMethod.ALL_TO_ALL")
    row["torch_cp_fwd_ms"], row["torch_cp_fwd_bwd_ms"] = 40.0, 160.0  # as the worker sets them: the faster
    step = lambda i, c, w: dict(step=i, start_ms=3.0 * i, compute_ms=c, exposed_wait_ms=w)
    timelines = [dict(n=65536, forward=[step(0, 20.0, 0.0), step(1, 21.5, 0.25)],
                      backward=[step(0, 60.0, 0.0), step(1, 61.0, 0.0), step(2, 0.0, 1.5)])] * 2
    text = bench.write_results([row], 2, str(tmp_path), dict(gpu="H200", torch="2.11", triton="3.6", date="d"),
                               timelines=timelines)
    # 65536 tokens in 64 ms (all-gather) and 40 ms (all-to-all); the ring (50 ms) against the faster, 40 ms
    assert "| 65536 | fwd | 689,853 | 1,310,720 | 1.90× | 1,024,000 | 1,638,400 | 0.80× |" in text
    assert "| 65536 | fwd+bwd | 172,463 | 327,680 | 1.90× | 409,600 | 262,144 | 0.80× |" in text
    assert "torch CP alltoall: rotate method _RotateMethod.ALL_TO_ALL" in text
    assert "| forward | 1 | 1 | 21.50 | 0.25 |" in text and "| backward | 0 | 2 | 0.00 | 1.50 |" in text
    assert json.loads((tmp_path / "ring_bench.json").read_text())["timelines"] == timelines


@pytest.mark.cpu_processes("gloo processes: the K/V exchange's CPU path")
def test_the_kv_exchange_alone_is_measured_on_two_processes_and_recorded(tmp_path):
    import json

    from course_utils.distributed import bench

    records = ring.run_distributed(bench.p2p_bandwidth, 2, args=(64, 2, 2, "cpu"), device="cpu", timeout_s=120)
    assert records[0] == records[1]  # every rank reports the slowest rank's time
    p2p = records[0]
    assert p2p["bytes"] == 2 * bench.N_KV_HEADS * 64 * bench.HEAD_DIM * 4 and p2p["dtype"] == "float32"
    assert p2p["ms"] > 0 and p2p["gbps"] == pytest.approx(p2p["bytes"] / (p2p["ms"] / 1e3) / 1e9)
    rows = [dict(n=32768, reps=3, ring_fwd_ms=50.0, ring_fwd_bwd_ms=180.0)]
    text = bench.write_results(rows, 2, str(tmp_path), dict(gpu="H200", torch="2.11", triton="3.6", date="d"), p2p)
    assert f"- K/V exchange alone (64 tokens, 0.5 MB of float32 K/V per rank): {p2p['ms']:.3f} ms" in text
    assert json.loads((tmp_path / "ring_bench.json").read_text())["p2p"] == p2p


def test_ring_pictures_draw_every_chunk_pair_once():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_utils import plots, widgets

    for layout, n in (("zigzag", 8), ("contiguous", 4)):
        left, right = plots.plot_ring_step(4, step=2, layout=layout, causal=True)
        colours = [p.get_facecolor() for p in right.patches]
        assert len(colours) == n * n  # one patch per (query chunk, key chunk)
        grey = sum(1 for c in colours if matplotlib.colors.to_hex(c) == "#e0e0e0")
        assert grey == n * (n - 1) // 2  # the causal mask skips every pair above the diagonal
        plt.close(left.figure)
    ax = plots.plot_tile_work(256, 4, 16)
    heights = [p.get_height() for p in ax.patches]
    assert heights == list(ring.tile_work(256, 4, "contiguous", 16)) + list(ring.tile_work(256, 4, "zigzag", 16))
    plt.close(ax.figure)
    assert widgets.ring_stepper(3).children[0].max == 2  # steps 0..world-1


def write_beside(rank, world_size, path):
    """A rank's function that writes a file where it was told (imported by the spawned rank)."""
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except PermissionError as exc:
        return f"refused: {exc}"


@pytest.mark.cpu_processes("gloo processes on the CPU")
def test_ranks_started_under_the_batch_graders_guard_keep_it(tmp_path, monkeypatch):
    import json
    import tempfile

    from course_utils import guard

    inside, outside = tmp_path / "work", tmp_path / "outside.txt"
    inside.mkdir()
    monkeypatch.setenv("TMPDIR", str(inside))  # as in a graded notebook: temporary files in its own folder
    monkeypatch.setattr(tempfile, "tempdir", str(inside))
    monkeypatch.setenv(guard.GUARD_VAR, json.dumps({"write_roots": [str(inside), str(Path.home() / ".triton"),
                                                                    str(Path.home() / ".cache")],
                                                    "hidden_dirs": [], "allowed_programs": [],
                                                    "data_limit_bytes": None}))
    (answer,) = ring.run_distributed(write_beside, 1, args=(str(outside),), device="cpu", timeout_s=120)
    assert answer.startswith("refused") and not outside.exists(), answer
    (answer,) = ring.run_distributed(write_beside, 1, args=(str(inside / "mine.txt"),), device="cpu", timeout_s=120)
    assert answer == "written"
