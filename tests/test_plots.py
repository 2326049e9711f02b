"""The pictures' data: who owns which tile, which addresses a 2-D load reads; the drawings run."""

import course_utils  # noqa: F401

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_utils import plots  # noqa: E402


def test_backward_owners_give_every_computed_tile_one_owner_per_pass():
    dkdv, dq = plots.backward_owners(256, 64, 32, causal=True)
    states = plots.tile_states(256, 256, 64, 32, causal=True)
    computed = states != plots.SKIPPED
    assert (dkdv >= 0).tolist() == computed.tolist() and (dq >= 0).tolist() == computed.tolist()
    rows, cols = np.nonzero(computed)
    assert (dkdv[rows, cols] == cols).all() and (dq[rows, cols] == rows).all()
    # Causal: the dK/dV program of the last key block sees only the last query block.
    assert (dkdv[:, -1] >= 0).sum() == 1 and (dq[-1] >= 0).all()


def test_tile_addresses_are_row_times_stride_plus_column_with_a_mask_at_the_edges():
    offs, mask = plots.tile_addresses(2, 4, 4, 4, row_stride=10, n_rows=5, n_cols=7)
    assert offs[0].tolist() == [24, 25, 26, 27] and offs[:, 0].tolist() == [24, 34, 44, 54]
    assert mask.tolist() == [[r < 5 and c < 7 for c in range(4, 8)] for r in range(2, 6)]


def test_gqa_groups_refuse_a_head_count_that_does_not_divide():
    with pytest.raises(ValueError):
        plots.plot_gqa_groups(6, 4)


def test_pictures_draw():
    fig, axes = plt.subplots(2, 3)
    assert plots.plot_program_tiles(64, 16, 16, ax=axes[0, 0]) is axes[0, 0]
    assert plots.plot_gqa_groups(8, 2, ax=axes[0, 1]) is axes[0, 1]
    assert plots.plot_tile_addresses(0, 0, 2, 4, 6, 3, 5, ax=axes[0, 2]) is axes[0, 2]
    assert list(plots.plot_backward_passes(128, 32, 32, axes=axes[1, :2])) == list(axes[1, :2])
    plt.close(fig)


@pytest.mark.parametrize("n, block_m, block_n, window_size, sink_size", [
    (256, 16, 32, 64, 4), (256, 16, 32, 40, 48), (200, 32, 64, 20, 0), (100, 16, 16, 300, 0), (130, 16, 64, 1, 70)])
def test_dkdv_column_states_match_the_mask_and_the_course_s_walk(n, block_m, block_n, window_size, sink_size):
    from course_utils import references
    from course_utils.grading.part5_window import _dkdv_bounds_variant

    mask = references.window_mask(n, n, window_size, sink_size)
    for start_n in range(0, n, block_n):
        states = plots.dkdv_column_states(n, block_m, block_n, window_size, sink_size, start_n)
        assert len(states) == -(-n // block_m) and set(states) <= set(plots.COLUMN_STATES)
        diag_end, full_end, q_end = _dkdv_bounds_variant(start_n, block_m, block_n, n, window_size, sink_size)
        walked = set(range(start_n, diag_end, block_m)) | set(range(diag_end, q_end, block_m))
        for b, state in enumerate(states):
            tile = mask[b * block_m:(b + 1) * block_m, start_n:start_n + block_n]
            assert (state == "skipped") == (not tile.any())
            assert (state == "full") == (tile.all() and b * block_m >= start_n + block_n)
            assert (state == "diagonal") == (tile.any() and b * block_m < start_n + block_n)
            if state == "sinks only":  # seen, but by no row inside the window
                rows = np.arange(b * block_m, min((b + 1) * block_m, n))[:, None]
                keys = np.arange(start_n, min(start_n + block_n, n))[None, :]
                assert not (tile & (rows - keys < window_size)).any() and (keys < sink_size).any()
            # The course's dK/dV kernel visits exactly the blocks the picture does not grey out.
            assert (b * block_m in walked) == (state != "skipped"), (start_n, b, state)


def test_dkdv_column_draws_and_its_widget_builds_headless(capsys):
    from course_utils import widgets

    fig, axes = plt.subplots(1, 2)
    assert list(plots.plot_dkdv_column(128, 16, 32, 24, 4, 32, axes=axes)) == list(axes)
    plt.close(fig)
    open_before = set(plt.get_fignums())  # figures an earlier test in this process left open are not its own
    widget = widgets.dkdv_column_explorer(128, 16, 32, window_size=24, sink_size=4, key_block=9)
    assert [c.description for c in widget.children[:3]] == ["key block", "window W", "sinks S"]
    assert widget.children[0].value == 3  # the last of 4 key blocks
    assert set(plt.get_fignums()) == open_before  # the first picture was shown and closed
    # Its display data holds a PNG of that first picture: what a stored notebook shows without widgets.
    import base64

    bundle = widget._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert "image/png" in widgets.window_explorer(64, 16, 16, window_size=8, sink_size=2)._repr_mimebundle_()


def test_ring_timeline_overlaps_the_send_with_the_compute():
    for compute, transfer in ((3.0, 1.0), (1.0, 3.0)):
        overlapped = plots.ring_timeline(4, compute, transfer, overlap=True)
        sequential = plots.ring_timeline(4, compute, transfer, overlap=False)
        assert max(b[4] for b in overlapped) == 3 * max(compute, transfer) + compute
        assert max(b[4] for b in sequential) == 3 * (compute + transfer) + compute
        sends = [b for b in overlapped if b[0] == 0 and b[1] == "send"]
        computes = [b for b in overlapped if b[0] == 0 and b[1] == "compute"]
        assert [b[2] for b in sends] == [0, 1, 2] and len(computes) == 4  # no send at the last step
        assert all(s[3] == c[3] for s, c in zip(sends, computes))  # each send starts with its step's compute
    fig, axes = plt.subplots(1, 2)
    assert plots.plot_ring_timeline(3, 2e-6, 6e-6, overlap=False, ax=axes[0], title="short") is axes[0]
    assert "in sequence" in axes[0].get_title() and "18 µs, computing 33% of the time" in axes[0].get_title()
    assert plots.plot_ring_timeline(3, 2e-6, 5e-6, ax=axes[1]) is axes[1]
    plt.close(fig)
