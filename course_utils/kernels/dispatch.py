"""The forward dispatch: validate once at the entry, decide once which kernel runs, launch.

Both public functions of :mod:`course_utils.kernels` and the autograd function
of :mod:`.backward` come here; nothing here calls back up to the package::

    kernels.flash_attention / flash_attention_with_lse / backward.FlashAttentionFunction
        -> check_call (once; FlashAttentionFunction skips it when flash_attention has run it)
        -> window_in_effect (the public entries: a window of N keys or more is plain causal attention)
        -> launch_forward (the one decision)
            -> forward.flash_attention_mods_forward    (lesson 12's keywords: every machine)
            -> hopper_ws.attention                     (from GLUON_MIN_N tokens on, where set; a window too
                                                        from GLUON_MIN_WINDOW keys and GLUON_WINDOW_MIN_N
                                                        tokens, where set; on the persistent
                                                        grid where gluon_persistent says so,
                                                        walked as gluon_heads_together says)
            -> fast_window.attention_forward_window    (a window the Hopper kernel supports: lessons 06 + 08)
            -> forward.flash_attention_window_forward  (any other window: lesson 08, every machine)
            -> fast.attention_forward_tuned            (plain attention the Hopper kernel supports)
            -> forward.flash_attention_gqa_forward     (everything else: lesson 05's kernel)

The launchers get ``_validated=True`` (or are the fast kernel's unchecked
path): the input was checked by :func:`check_call`, so it is not checked again.
"""

from __future__ import annotations

from . import fast, fast_window, forward, gluon_cpu

__all__ = ["check_call", "launch_forward", "GLUON_MIN_N", "GLUON_WINDOW_MIN_N", "GLUON_MIN_WINDOW",
           "GLUON_WINDOW_PERSISTENT", "GLUON_NONCAUSAL_PERSISTENT", "GLUON_FMA", "GLUON_WALK_KV_HEADS",
           "GLUON_WALK_WINDOWS", "GLUON_WALK_CAUSAL", "gluon_applies", "gluon_persistent", "gluon_heads_together",
           "window_in_effect"]

# Lesson 11's Gluon forward (kernels.hopper_ws, its serial loop) for plain attention from this many tokens on, where
# gluon_applies says it can run. On an H100, over three ladders (results/fp8_bench_gluon_h100*.json) and two main
# sweeps (results/forward_bench_lesson11_h100*.json), it ran 1.01-1.09x the course's forward at N >= 8192, 0.96-1.05x
# at N = 4096 and 0.92-1.01x below (the H200's probe: 1.03-1.06x at 4k and 16k). Lowered from 8192 to 4096 after
# the public forward at 4k read 1.027-1.034x with the causal mask and 0.994-1.048x without it with this route against
# lesson 06's kernel (four H100 route checks of four rounds each: results/route_check_min4k_h100*.json,
# route_check_fp8_min4k_h100_run2.json, route_check_h100_min4k.json). None: never.
GLUON_MIN_N: int | None = 4096
# Lesson 08's window goes there from this many tokens (and GLUON_MIN_WINDOW keys wide), a threshold of its own since
# GLUON_MIN_N came down to 4096: the window's route was timed from 8k (the route checks and persistent probes below),
# and in the two H100 grids run with it from 4k (results/window_bench_h100_min4k*.md) the forward at W = 1024 without
# sinks, 4k read 0.19-0.22 ms, where lesson 08's kernel had read 0.16 ms in the five grids before (H100 and H200,
# results/window_bench_h{100,200}*.md). Three H100 route checks at 4k then read the route 0.93-1.03x there and
# 1.02-1.11x at W = 1024 with sinks and W = 4096 (results/route_check_min4k_h100_run4.json,
# route_check_min4k_window_h100_run{2,3}.json): not settled at W = 1024, so 8192 stays. None: never.
GLUON_WINDOW_MIN_N: int | None = 8192
# The same kernel with lesson 08's window (and sinks): where the window is at least this wide (and N reaches
# GLUON_WINDOW_MIN_N), on its persistent grid (GLUON_WINDOW_PERSISTENT). One program per (query block, head) tile ran
# 1.08-1.09x the course's window forward at W = 4096 but 0.99-1.03x at 1024 and 0.82-0.84x at 256 (an H100, N = 16k,
# results/hopper_ws_window_probe_h100.json): a window's loop is short, and each program pays its prologue and
# epilogue alone. The persistent grid loads the next tile's Q under this one's loop, and ran 1.06-1.11x the course's
# window forward at W = 1024 (N = 16k and 64k, with and without sinks), 1.01-1.02x at 4096 and 0.94-0.97x at 256 (an
# H100, results/hopper_ws_window_probe_persistent_h100.json, both timed in the same process). None: never.
GLUON_MIN_WINDOW: int | None = 1024
# Whether a window on the Gluon route runs the persistent grid (hopper_ws.attention(..., persistent=True)) rather
# than a program per tile: at W = 1024, 16k, 1.06-1.11x the course's window forward against 0.99-1.03x (each
# measured beside the course's kernel in its own process, in two H100 probes hours apart), level at W = 4096.
GLUON_WINDOW_PERSISTENT: bool = True
# Whether plain attention without the causal mask on the Gluon route runs the persistent grid: every work tile is
# as long as every other, and the next tile's Q lands under this one's loop. In two H100 probes at non-causal 16k
# (results/hopper_ws_probe{,_overlap}_h100.json, the serial loop without the FMA softmax, each beside cuDNN in its own
# process) it read 0.954x and 0.943x cuDNN against the one-program-per-tile grid's 0.914x and 0.909x (0.940x and
# 0.934x with the FMA softmax). Under the causal mask the persistent grid lost (0.92x against 0.96x at 16k, 0.92x
# against 0.93x at 4k), so causal attention keeps a program per tile. Timed at 16k only; route_check.py --modes
# persistent times the route both ways at 8k and 16k.
GLUON_NONCAUSAL_PERSISTENT: bool = True
# Whether the Gluon route folds the softmax's scale into one fused multiply-add per score (hopper_ws.attention's
# fma=True: the max taken on the raw scores, exp2(s * scale - m) in one instruction). In two H100 probes of the
# one-program-per-tile grid (results/hopper_ws_probe{,_overlap}_h100.json) the serial loop with it read 1.01-1.03x
# the serial loop without it beside cuDNN in the same processes. The route itself both ways, in one process, four
# rounds (benchmarks/route_check.py --modes fma, results/route_check_fma_h100.json, an H100): plain causal 8k and
# 16k 1.024x and 1.028x faster with it, the windows (W 1024 / 4096, S 0 / 4, N 8k-64k) 0.99-1.05x, median 1.015x.
GLUON_FMA: bool = True
# Whether plain attention without the causal mask on the persistent grid walks its work tiles a kv head at a time
# (hopper_ws.attention's heads_together=hopper_ws.kv_head_order(H, group): the programs that run together read one
# kv head's K/V tiles, where the default walk streams every (batch, kv head) at once). The route both ways on an H100
# (benchmarks/route_check.py --modes walk, two processes of four rounds, results/route_check_walk_h100{,_run2}.json):
# 1.043x / 1.053x / 1.017x and 1.038x / 1.068x / 1.019x faster with it at 4k / 8k / 16k (16k tokens a batch), as
# the A/B before it read (1.036x / 1.030x / 1.013x, results/gluon_ab_walk_h100.json). Not timed on an H200.
GLUON_WALK_KV_HEADS: bool = True
# Whether a window on the Gluon route's persistent grid (GLUON_WINDOW_PERSISTENT) walks a kv head at a time too. By
# default the programs that run together take every head's block of the same position, so they read the K/V windows
# of every kv head at once; a kv head at a time, they read one kv head's, over more blocks. Not timed yet
# (benchmarks/route_check.py --modes walkwindow times the route both ways), so off.
GLUON_WALK_WINDOWS: bool = False
# Whether plain causal attention on the Gluon route (a program per tile) walks a kv head's query heads at a time: the
# GPU starts the programs in the grid's order, so by default every row's blocks follow one another and the last rows'
# longest blocks start last (in the load model of hopper_ws.kv_head_order's docstring, the last SM ends 3.3% after
# the mean at 4k one row at a time, 0.2% four rows at a time). The walk is read from the grid's shape
# (hopper_ws._grid_tile), so lesson 11's loader walks with it. Timed once as a kernel A/B on an H100 (the forty-eighth
# session's results/gluon_ab_walk_h100.json: 1.004x-1.059x bf16), not yet as a route (route_check.py --modes
# walkcausal), so off.
GLUON_WALK_CAUSAL: bool = False


def check_call(q, k, v, causal=False, window_size=None, sink_size=0, *, cu_seqlens=None, softcap=None,
               alibi_slopes=None, sink_logits=None) -> None:
    """Raise ``ValueError`` (one sentence) unless the call can go to a forward kernel.

    The tensors first (:func:`.forward.validate`), then the mask settings
    (:func:`.forward.validate_window`), then lesson 12's keywords
    (:func:`.forward.validate_mods`: ``cu_seqlens``, ``softcap``,
    ``alibi_slopes``, ``sink_logits``, each by a small helper of its own).
    """
    forward.validate(q, k, v)
    forward.validate_window(causal, window_size, sink_size)
    forward.validate_mods(q, cu_seqlens, softcap, alibi_slopes, sink_logits)


def gluon_applies(q, k, v, window_size=None, *, min_n: int | None = None, min_window: int | None = None) -> bool:
    """Whether :func:`launch_forward` runs lesson 11's Gluon forward for this call: ``min_n`` (default
    :data:`GLUON_MIN_N`, or :data:`GLUON_WINDOW_MIN_N` for a window) set and reached, no window or one at least
    ``min_window`` wide (default :data:`GLUON_MIN_WINDOW`, which must be set for a window to go there), D = 128 (the
    head dim it was timed at), and inputs ``hopper_ws.attention`` takes on this machine (a Hopper GPU, or the CPU inside
    ``gluon_cpu.running()``)."""
    if min_n is None:
        min_n = GLUON_MIN_N if window_size is None else GLUON_WINDOW_MIN_N
    min_window = GLUON_MIN_WINDOW if min_window is None else min_window
    if min_n is None or q.shape[-1] != 128 or q.shape[2] < min_n:
        return False
    if window_size is not None and (min_window is None or window_size < min_window):
        return False
    if not gluon_cpu.can_run(q):  # before importing Gluon: elsewhere it is never loaded
        return False
    from .hopper_ws import unsupported_reason  # Gluon: imported only where the route is set and can run

    return unsupported_reason(q, k, v) is None


def gluon_persistent(causal: bool, window_size=None) -> bool:
    """Whether a call on the Gluon route runs :func:`.hopper_ws.attention`'s persistent grid: a window while
    :data:`GLUON_WINDOW_PERSISTENT`, plain attention without the causal mask while :data:`GLUON_NONCAUSAL_PERSISTENT`,
    causal attention never (its rows' unequal lengths, longest first, already fill a grid of one program per tile)."""
    if window_size is not None:
        return GLUON_WINDOW_PERSISTENT
    return not causal and GLUON_NONCAUSAL_PERSISTENT


def gluon_heads_together(q, k, causal: bool, window_size=None) -> int | None:
    """The grid's walk for a call on the Gluon route (``hopper_ws.attention``'s ``heads_together``): a kv head's
    query heads at a time (:func:`.hopper_ws.kv_head_order`) for plain attention without the causal mask on the
    persistent grid while :data:`GLUON_WALK_KV_HEADS`, for a window on it while :data:`GLUON_WALK_WINDOWS`, for
    plain causal attention on a program per tile while :data:`GLUON_WALK_CAUSAL`, else ``None`` (the grid's default
    walk)."""
    if window_size is not None:
        walks = GLUON_WALK_WINDOWS and gluon_persistent(causal, window_size)
    elif causal:  # a program per tile (gluon_persistent): its walk is the grid's shape
        walks = GLUON_WALK_CAUSAL
    else:
        walks = GLUON_WALK_KV_HEADS and gluon_persistent(causal)
    if not walks:
        return None
    from .hopper_ws import kv_head_order

    return kv_head_order(q.shape[1], q.shape[1] // k.shape[1])


def window_in_effect(q, window_size=None, sink_size=0) -> tuple:
    """``(window_size, sink_size)`` as they act on a call with ``q``'s ``N`` (a causal call :func:`check_call` has
    accepted): a window of at least ``N`` keys hides nothing the causal mask does not (no query has ``N`` earlier
    keys), and then its sinks select nothing either, so it is ``(None, 0)``, plain causal attention, whose kernels
    (forward and backward) are the fastest; any other window as given."""
    if window_size is not None and window_size >= q.shape[2]:
        return None, 0
    return window_size, sink_size


def launch_forward(q, k, v, causal: bool, window_size=None, sink_size=0, *, cu_seqlens=None, softcap=None,
                   alibi_slopes=None, sink_logits=None):
    """``(o, lse)`` by the one kernel that fits, for a call :func:`check_call` has accepted.

    With any of lesson 12's keywords (documents, soft-cap, ALiBi, sink
    logits, alone or with a window), kernel D of :mod:`.forward` on every
    machine. On a Hopper GPU, for the shapes the fast kernel covers
    (bf16/fp16, D of 64 or 128, N a multiple of 64), lesson 06's kernels: with
    a window alone (lesson 08) :mod:`.fast_window`'s, otherwise the autotuned
    kernel of :mod:`.fast`. Everywhere else, and in the interpreter, the
    lesson kernels of :mod:`.forward`: lesson 08's window kernel for a window,
    lesson 05's GQA kernel (MHA, GQA and MQA, causal or not) for the rest. Where :func:`gluon_applies` (only
    when :data:`GLUON_MIN_N` is set), plain attention runs lesson 11's Gluon forward instead, and so does a window
    of at least :data:`GLUON_MIN_WINDOW` keys from :data:`GLUON_WINDOW_MIN_N` tokens where those are set (on its
    persistent grid where :func:`gluon_persistent` says so, walked as :func:`gluon_heads_together` says; the
    softmax's scale in one FMA while :data:`GLUON_FMA`).
    """
    if forward.has_mods(cu_seqlens, softcap, alibi_slopes, sink_logits):
        return forward.flash_attention_mods_forward(q, k, v, causal, window_size=window_size, sink_size=sink_size,
                                                    cu_seqlens=cu_seqlens, softcap=softcap,
                                                    alibi_slopes=alibi_slopes, sink_logits=sink_logits,
                                                    _validated=True)
    if gluon_applies(q, k, v, window_size):
        from .hopper_ws import attention as gluon_attention

        return gluon_attention(q, k, v, causal, window_size=window_size, sink_size=sink_size,
                               persistent=gluon_persistent(causal, window_size), fma=GLUON_FMA,
                               heads_together=gluon_heads_together(q, k, causal, window_size))
    supported = fast.is_supported(q, k, v)
    if window_size is not None:
        if supported:
            return fast_window.attention_forward_window(q, k, v, window_size=window_size, sink_size=sink_size)
        return forward.flash_attention_window_forward(q, k, v, window_size=window_size, sink_size=sink_size,
                                                      _validated=True)
    if supported:
        return fast.attention_forward_tuned(q, k, v, causal=causal)
    return forward.flash_attention_gqa_forward(q, k, v, causal=causal, _validated=True)
