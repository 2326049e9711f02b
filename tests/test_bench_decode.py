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
