"""course_utils.bench decode without a GPU: the message, the byte count, the tables, the ceiling kernel."""

import course_utils  # noqa: F401  (before triton)

import torch

from course_utils.bench import decode as bd


def test_main_without_gpu_says_so_and_exits_zero(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bd, "gpu_available", lambda: False)
    assert bd.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == bd.NO_GPU_MESSAGE and "\n" not in out
    assert list(tmp_path.iterdir()) == []


def test_bytes_and_grid():
    assert bd.cache_bytes(1, 1024) == 2 * 8 * 1024 * 128 * 2  # K and V, bf16
    assert bd.gb_per_s(4 * 10**9, 1.0) == 4000.0
    points = bd.grid(16.0)
    assert (1, 1024) in points and (64, 65536) in points and (64, 131072) not in points  # 32 GiB left out
    assert all(bd.cache_bytes(b, n) <= 16 * 2**30 for b, n in points)


def _row(b, n, provider, ms, status="ok"):
    return dict(batch=b, context=n, provider=provider, ms=ms, status=status, rel_err=1e-3, note="",
                gbps=None if ms is None else bd.gb_per_s(bd.cache_bytes(b, n), ms))


def test_summary_picks_the_best_sdpa_backend_and_states_the_targets(tmp_path):
    rows = [_row(1, 4096, "course", 0.010), _row(1, 4096, "sdpa_flash", 0.020), _row(1, 4096, "sdpa_cudnn", 0.015),
            _row(1, 4096, "sdpa_efficient", None, "skip"), _row(1, 4096, "flex", 0.030),
            _row(1, 4096, "ceiling", 0.009),
            _row(16, 4096, "course", 0.100), _row(16, 4096, "sdpa_cudnn", 0.090), _row(16, 4096, "ceiling", 0.080)]
    (small, big) = bd.summarise(rows)
    assert small["sdpa_best_backend"] == "sdpa_cudnn"
    assert abs(small["course_vs_sdpa"] - 1.5) < 1e-9 and abs(small["course_vs_ceiling"] - 0.9) < 1e-9
    assert big["course_vs_sdpa"] < 1.0
    checks = bd.target_checks([small, big])
    assert any("NOT met at every point" in c for c in checks)  # 0.90x at B = 16
    assert any("met: target 1.3" in c for c in checks)
    assert any("80%" in c and "NOT met" in c for c in checks)
    paths = bd.write_results(rows, tmp_path, {"gpu": "test"})
    text = paths["md"].read_text()
    assert "| 1 | 4096 |" in text and "SDPA cuDNN" in text and "Not timed" in text


def test_read_ceiling_reads_every_element():
    k = torch.randn(2, 3, 200, 16, device=course_utils.DEVICE)
    v = torch.randn(2, 3, 200, 16, device=course_utils.DEVICE)
    sums = bd.read_ceiling(k, v, chunk=96, block_n=32)  # 3 chunks, the last one partial
    assert sums.shape == (6, 3)
    torch.testing.assert_close(sums.sum(1).cpu(), (k + v).sum((2, 3)).reshape(6).cpu(), rtol=1e-4, atol=1e-3)


def test_paged_copy_is_the_same_cache():
    from course_utils import references as ref

    k = torch.randn(2, 3, 64, 16)
    v = torch.randn(2, 3, 64, 16)
    k_pages, v_pages, table = bd.paged_copy(k, v, 16)
    assert k_pages.shape == (8, 3, 16, 16) and table.shape == (2, 4) and table.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == list(range(8))
    for paged, whole in ((k_pages, k), (v_pages, v)):
        back = ref.gather_pages(paged.numpy(), table.numpy(), 64)
        assert (back == whole.numpy()).all()


def test_one_point_end_to_end_in_the_interpreter(monkeypatch, tmp_path):
    """The whole pipeline on a tiny point (fp32, the timer faked): check, time, summarise, write."""
    import triton.testing

    if course_utils.DEVICE != "cpu":
        return  # on a GPU the real command runs (python -m course_utils.bench decode)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.5)[1])
    log = []
    rows = bd.measure_point(1, 64, ("course", "course_paged", "sdpa_flash", "sdpa_cudnn", "ceiling"), log=log.append,
                            device="cpu", dtype=torch.float32)
    by = {r["provider"]: r for r in rows}
    assert by["course"]["status"] == "ok" and by["course"]["rel_err"] < 1e-5
    assert by["course_paged"]["status"] == "ok" and by["course_paged"]["rel_err"] < 1e-5
    assert by["sdpa_flash"]["status"] == "ok" and by["sdpa_flash"]["rel_err"] < 1e-5  # torch's CPU flash
    assert by["sdpa_cudnn"]["status"] == "skip" and by["sdpa_cudnn"]["ms"] is None  # none on a CPU: reported
    assert by["ceiling"]["gbps"] == bd.gb_per_s(bd.cache_bytes(1, 64, element_size=4), 0.5)
    assert len(log) == 5
    text = bd.write_results(rows, tmp_path, {"gpu": "none"})["md"].read_text()
    assert "| 1 | 64 |" in text


# -- GB/s against num_splits (python -m course_utils.bench decode --splits) --------------------------
def test_splits_without_gpu_says_so_and_exits_zero(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bd, "gpu_available", lambda: False)
    assert bd.main(["--splits", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == bd.NO_GPU_SPLITS_MESSAGE and "\n" not in out and "--splits" in out
    assert list(tmp_path.iterdir()) == []


def test_split_counts_follow_the_launchers_limits():
    assert bd.split_counts(16384, 32) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]  # 256 blocks: up to 64
    assert bd.split_counts(4096, 2) == [1, 2, 3, 4, 6, 8, 12, 16]  # 64 blocks: at least 4 each
    assert bd.split_counts(65536, 17) == [1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 48, 64, 96, 128]  # the pick added
    assert bd.split_counts(256, 1) == [1]
    from course_utils.kernels import decode

    # B = 16, 4k: 2 splits make 256 programs, 2 on the busiest SM, 32 + 1 block reads each and the combine's 2.
    assert bd.model_of(16, 4096, 2, 132) == decode.split_busy_fraction(16, 8, 1, 64, 2, 132, 3) == \
        (128 * 64 / 132) / (2 * 33 + 2)
    # B = 64, 4k, one split: the 2-stage launch holds all 512 programs (5 per SM), 4 on the busiest SM.
    assert bd.model_of(64, 4096, 1, 132) == decode.split_busy_fraction(64, 8, 1, 64, 1, 132, 5) == \
        (512 * 64 / 132) / (4 * 65)


def test_programs_per_sm_is_lesson_06s_rule():
    assert bd.programs_per_sm(255, 4, 36 * 1024) == 2  # registers: 256 x 128 = 32,768 of 65,536
    assert bd.programs_per_sm(168, 4, 36 * 1024) == 3
    assert bd.programs_per_sm(64, 4, 113 * 1024) == 2  # shared memory: 2 x (113 + 1) KiB = 228 KiB
    assert bd.programs_per_sm(32, 1, 1024) == 32  # the 32-program limit


def test_splits_end_to_end_in_the_interpreter(monkeypatch, tmp_path):
    """The sweep on a tiny point (fp32, the timer faked): check each count, model beside it, write, render."""
    import json

    import triton.testing

    from course_utils import results

    if course_utils.DEVICE != "cpu":
        return  # on a GPU the real command runs (python -m course_utils.bench decode --splits)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 0.5)[1])
    log = []
    # 256 keys in the interpreter's blocks of 32: 8 blocks, so 1 or 2 splits (each at least 4 blocks).
    rows, point = bd.measure_splits(1, 256, (1, 2, 4), log=log.append, device="cpu", dtype=torch.float32,
                                    graphs=False, sm_count=132)
    assert point["block_n"] == 32 and [r["num_splits"] for r in rows] == [1, 2] and len(log) == 2
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-5 for r in rows)
    assert point["model_pick"] == 2 and [r["model_pick"] for r in rows] == [False, True]
    assert rows[1]["predicted_busy"] == bd.model_of(1, 256, 2, 132, 32)
    assert point["n_regs"] is None  # nothing compiled in the interpreter
    assert point["best_gbps"] == point["ceiling_gbps"] == bd.gb_per_s(bd.cache_bytes(1, 256, element_size=4), 0.5)
    paths = bd.write_splits(rows, [point], tmp_path, {"gpu": "none"})
    text = paths["md"].read_text()
    assert "## B = 1, context 256" in text and "| 2 |" in text and "model's pick" in text
    # the timer is faked: every count ties, so the first is the best and the pick reads 100% of it
    assert "the pick (2 splits) reads 100% of the best count's GB/s (num_splits = 1; met: 97%)" in text
    doc = json.loads(paths["json"].read_text())
    monkeypatch.setattr(results, "load", lambda name: doc)
    table = results.markdown("decode_splits")
    assert "| 1 | 256 | 2 | " in table and "yes" in table and "100%" in table
