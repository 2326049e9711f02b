"""The batch grader's checks process and the learner's process (course_utils.grade_checks, course_utils.wire).

One run of the checks process, without a notebook: the answers are shipped the way a
grader cell ships them, and the record is read from its standard output, as
``course_utils.grade`` reads it. Each call checks one way the learner's function can
behave across the process boundary: it must get the verdict, and the message, that
the notebook's own check gives.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

from course_utils import grade, grade_checks, transport, wire
from test_grading_part1 import tiled_vectorised

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the checks process is a Linux process")

SOFTMAX = """
def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
"""
TILE_COPY = """import course_utils, torch, triton
import triton.language as tl

@triton.jit
def copy_tile_kernel(x_ptr, y_ptr, n_rows, n_cols, stride_xr, stride_xc, stride_yr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tile = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask)
    tl.store(y_ptr + rows[:, None] * stride_yr + cols[None, :], tile, mask=mask)

def copy(x, block_r=16, block_c=32):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_r), triton.cdiv(x.shape[1], block_c))
    copy_tile_kernel[grid](x, y, x.shape[0], x.shape[1], x.stride(0), x.stride(1), y.stride(0),
                           BLOCK_R=block_r, BLOCK_C=block_c)
    return y
"""
# Lesson 02's tiled loop, as the part-1 tests write it correctly, defined in the notebook.
TILED = "import math\n" + inspect.getsource(tiled_vectorised) + "answer = tiled_vectorised\n"
ANSWERS = {  # index: (check, source defining `answer`)
    0: ("check_softmax", SOFTMAX + "answer = softmax"),
    1: ("check_softmax", "def answer(x):\n    return x"),  # the wrong signature
    2: ("check_softmax", "def answer(x, axis=-1):\n    raise ValueError('boom')"),
    3: ("check_softmax", "def answer(x, axis=-1):\n    while True:\n        pass"),  # runs past the time limit
    4: ("check_softmax", SOFTMAX + "answer = softmax"),  # after the hang: a fresh learner's process
    5: ("check_softmax", "import os\ndef answer(x, axis=-1):\n    os._exit(3)"),
    6: ("check_kv_head", "def answer(q_head, n_q_heads, n_kv_heads):\n    return q_head // (n_q_heads // n_kv_heads)"),
    7: ("check_softmax", "from course_utils import references\ndef answer(x, axis=-1):\n"
                         "    return references.softmax(x, axis=axis)"),  # borrowed
    8: ("check_softmax", "class Scores:\n    pass\ndef answer(x, axis=-1):\n    return Scores()"),
    9: ("check_mods_backward", "def answer(q, k, v, o, lse, do, *, cu_seqlens, causal, softcap, alibi_slopes, "
                               "sink_logits):\n    q *= 2\n    return q, k, v, None"),  # edits its input in place
    10: ("check_softmax", "def answer(x, axis=-1):\n    raise NotImplementedError"),
    11: ("check_softmax", SOFTMAX + "import numpy\ndef answer(x, axis=-1):\n"
                          "    numpy.allclose = lambda *a, **k: True\n    numpy.abs = lambda x, *a, **k: 0 * x\n"
                          "    return x"),  # replaces numpy where it runs: not where the verdict is
    # Judged in the learner's process: its proof of work watches the kernel launch there.
    12: ("check_tile_copy", TILE_COPY + "answer = copy"),
    # Judged in the learner's process, and attacked there: numpy replaced inside the launcher (its copy is
    # wrong), and a thread of its own left running (its copy is right).
    13: ("check_tile_copy", TILE_COPY + """
import numpy
def answer(x, block_r=16, block_c=32):
    y = copy(torch.zeros_like(x), block_r, block_c)  # a wrong copy, written by the learner's own kernel
    numpy.abs = lambda a, *args, **kwargs: numpy.zeros_like(numpy.asarray(a, dtype=float))
    numpy.isfinite = lambda a, *args, **kwargs: numpy.ones(numpy.shape(a), dtype=bool)
    return y
"""),
    14: ("check_tile_copy", TILE_COPY + """
import threading, time
def answer(x, block_r=16, block_c=32):
    threading.Thread(target=lambda: time.sleep(3), daemon=True).start()
    return copy(x, block_r, block_c)
"""),
    # Lesson 02's tiled loop: its check watches the tiles the learner's code takes; the learner's process keeps
    # the same tile log around each call and sends back what it saw (judged outside).
    15: ("check_tiled_attention", TILED),
    16: ("check_tiled_attention", """import math
def answer(q, k, v, block_m, block_n, causal=False):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # the whole score matrix at once: not tiled
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool), s.shape[-1] - s.shape[-2]), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return p @ v / p.sum(-1, keepdims=True), (m[..., 0] + np.log(p.sum(-1)))
"""),
    # Lesson 02's online softmax: its check watches for reductions over whole rows, here too.
    17: ("check_online_softmax", """def answer(x, block_size):
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for s in range(0, x.shape[-1], block_size):
        blk = x[..., s:s + block_size]
        m_new = np.maximum(m, blk.max(axis=-1))
        l = l * np.exp(m - m_new) + np.exp(blk - m_new[..., None]).sum(axis=-1)
        m = m_new
    return np.exp(x - m[..., None]) / l[..., None]
"""),
    18: ("check_online_softmax", """def answer(x, block_size):
    e = np.exp(x - x.max(axis=-1, keepdims=True))  # one max over the whole row: right values, no streaming
    return e / e.sum(axis=-1, keepdims=True)
"""),
}


def _ship(source: str):
    """``answer`` defined in a notebook-like module (by value, as a grader cell ships it)."""
    module = types.ModuleType("__main__")
    module.__dict__["np"] = np
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    import linecache

    name = f"<cell-{abs(hash(source))}>"  # as IPython does: Triton reads a kernel's source through linecache
    source = textwrap.dedent(source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    try:
        exec(compile(source, name, "exec"), module.__dict__)
        return ("ok", transport.dumps(((module.answer,), {})))
    finally:
        sys.modules["__main__"] = saved


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    base = tmp_path_factory.mktemp("checks")
    (base / "work").mkdir()
    envelope = {"token": "b" * 32, "answers": {i: _ship(src) for i, (_, src) in ANSWERS.items()},
                "hidden": {}, "tampered": []}
    (base / "answers.pkl").write_bytes(pickle.dumps(envelope))
    calls = [{"index": i, "check": check, "args": ["answer"], "kwargs": {}, "answer_keys": [], "allowed": []}
             for i, (check, _) in ANSWERS.items()]
    # As course_utils.grade sets them up: on a GPU, Triton writes its cache and starts ptxas to compile the kernels.
    cfg = {"token_a": "a" * 16, "token_b": "b" * 32, "write_roots": [str(base)], "hidden_dirs": [],
           "allowed_programs": list(grade.ALLOWED_PROGRAMS), "data_limit_bytes": None, "uses_torch": True,
           "answers_file": str(base / "answers.pkl"), "borrow_file": str(base / "borrowed.txt"), "root": str(ROOT),
           "calls": calls, "allowed": [], "skip": [], "result_file": str(base / "result.json"),
           "learner_result": str(base / "learner.json"), "learner_log": str(base / "learner.log"),
           "cwd": str(base / "work"), "deadline": None}
    (base / "checks.json").write_text(json.dumps(cfg))
    env = dict(os.environ, TRITON_CACHE_DIR=str(base / "triton-cache"))
    proc = subprocess.run([sys.executable, "-m", "course_utils.grade_checks", "checks", str(base / "checks.json")],
                          capture_output=True, timeout=600, cwd=base / "work", env=env)
    lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith(grade_checks.RECORD_MARK)]
    assert proc.returncode == 0 and lines, proc.stderr.decode()[-3000:]
    rec = json.loads(lines[-1][len(grade_checks.RECORD_MARK):])
    return {e["index"]: e for e in rec["results"]}


def test_a_correct_answer_passes_and_is_judged_where_the_learner_code_never_ran(record):
    for i in (0, 4, 6):
        assert record[i]["status"] == "passed" and record[i]["verdict"] == "grader", record[i]


def test_a_kernel_exercise_is_judged_in_the_learners_process(record):
    assert record[12]["status"] == "passed" and record[12]["verdict"] == "learner process", record[12]["message"]


def test_what_a_launcher_replaces_or_leaves_running_in_the_learners_process_is_undone_or_refused(record):
    # numpy put back after each call: the zero copy gets its real verdict (it passed before the call guard)
    assert record[13]["status"] == "failed" and "the copy is wrong" in record[13]["message"], record[13]["message"]
    assert record[14]["status"] == "failed" and "left a thread running" in record[14]["message"], record[14]


def test_a_tiled_loop_is_judged_outside_and_an_untiled_one_still_refused(record):
    assert record[15]["status"] == "passed" and record[15]["verdict"] == "grader", record[15]
    assert record[16]["status"] == "failed" and "did not tile" in record[16]["message"], record[16]
    assert record[16]["verdict"] == "grader"


def test_the_online_softmax_is_judged_outside_and_a_whole_row_max_still_refused(record):
    assert record[17]["status"] == "passed" and record[17]["verdict"] == "grader", record[17]
    assert record[18]["status"] == "failed" and record[18]["verdict"] == "grader", record[18]
    assert "whole row" in record[18]["message"] or "streaming" in record[18]["message"], record[18]


def test_the_learners_own_errors_keep_their_type_text_and_notes(record):
    assert record[1]["status"] == "failed" and "your function cannot take the arguments" in record[1]["message"]
    assert "`answer(x)`" in record[1]["message"]  # its signature, as the learner wrote it
    assert record[2]["status"] == "error" and record[2]["message"].startswith("ValueError: boom")
    assert "[check_softmax] raised by your function on case" in record[2]["message"]
    assert record[10]["status"] == "not_attempted"


def test_a_hang_and_a_dead_process_get_their_status_and_the_next_check_a_fresh_process(record):
    assert record[3]["status"] == "timeout" and "was stopped" in record[3]["message"], record[3]
    assert record[5]["status"] == "crashed" and "died while this check ran your code" in record[5]["message"]
    assert record[4]["status"] == "passed" and record[6]["status"] == "passed"


def test_a_borrowed_answer_is_refused_in_the_learners_process(record):
    assert record[7]["status"] == "failed"
    assert "your code called `course_utils.references.softmax`, the course's own answer" in record[7]["message"]


def test_what_cannot_cross_as_data_keeps_its_type_name_and_an_in_place_edit_is_seen(record):
    assert record[8]["status"] == "failed" and "your function's result is a Scores; return a NumPy array" in \
        record[8]["message"], record[8]
    assert record[9]["status"] == "failed" and "changed its input q in place" in record[9]["message"], record[9]


def test_replacing_numpy_in_the_learners_process_does_not_reach_the_verdict(record):
    assert record[11]["status"] == "failed" and "wrong" in record[11]["message"], record[11]


def test_wire_rebuilds_data_and_refuses_anything_that_could_run_code():
    import torch

    value = {"a": (1, 2.5, [np.arange(6.0).reshape(2, 3), np.float32(3)]), "b": {1, 2}, "r": range(3),
             "t": torch.randn(1, 4, 8).expand(3, 4, 8), "s": torch.randn(4, 10)[:, 2:7]}
    back = wire.loads(wire.dumps(value))
    assert np.array_equal(back["a"][2][0], value["a"][2][0]) and back["b"] == {1, 2} and back["r"] == range(3)
    for key in ("t", "s"):  # the layout is part of the answer (an expanded or sliced tensor)
        assert torch.equal(back[key], value[key]) and back[key].stride() == value[key].stride()
    for hostile in (pickle.dumps(np.arange(3)), transport.dumps(len), pickle.dumps(wire.Opaque("x"))):
        with pytest.raises(pickle.UnpicklingError, match="refused"):
            wire.loads(hostile)
    with pytest.raises(ValueError, match="strides reach past"):
        wire.decode(("tensor", "float32", [4], "cpu", False, b"\0" * 8, [1], 0))
