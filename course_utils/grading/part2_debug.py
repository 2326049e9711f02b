"""Check for lesson 05b (the flaw hunt): each flaw named by its line and shown by an input.

The learner reviews a classmate's causal GQA forward
(:mod:`course_utils.exhibits.causal_forward_kernel`) and hands in a list of
findings, one per flaw::

    dict(line="a piece of the classmate's code", why="one sentence",
         inputs=dict(q=q, k=k, v=v, is_causal=True, block_m=128, block_n=64))

``inputs`` is a failing input: tensors the contract accepts, on which the
classmate's code gives a wrong answer (or raises) while the float64
reference does not. Two flaws need other evidence: an int32 overflow cannot
be shown on a CPU (the tensors would have billions of elements), so its
finding gives ``shape=(B, Hq, Hkv, N, D)`` instead, checked by arithmetic; and
two flaws no input can show (an epsilon, comments that contradict the code)
are found by reading, so their finding needs only the line.

How a finding is judged. Its ``line`` must be text of the classmate's file,
and it picks the flaws whose lines it touches. For an input-shown flaw the
check builds the classmate's kernel with *every other* flaw fixed (text
patches on the classmate's file, nothing rewritten) and runs the input on it
and on the float64 reference: the finding counts if that copy raises or
gives a wrong ``o`` or ``lse``. The same input must pass the copy with every
flaw fixed, so an input outside the contract (bfloat16 in the interpreter, a
head dim Triton cannot tile) is refused with a reason instead of counting.
The check passes when every flaw has a finding.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import tempfile
from pathlib import Path

import numpy as np

from .. import references
from ..environment import current
from .core import GradingError, Run

__all__ = ["grade_flaw_hunt", "FLAWS", "int32_overflow", "int32_overflows", "classmate_variant"]

EXHIBIT = Path(__file__).resolve().parent.parent / "exhibits" / "causal_forward_kernel.py"
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Flaw:
    key: str
    title: str  # shown once found
    kind: str  # "input", "arithmetic" or "reading"
    anchors: tuple  # substrings that pick the flaw's lines in the exhibit
    hint: str  # said when a finding names this flaw's line but does not show it
    token: str = ""  # for "reading" flaws: the cited text must contain this


# The int32 flaw's lines, each with the offset products (keys of int32_overflows) computed on it: a
# finding is credited only on a line whose own product overflows for its shape (an index's definition
# carries every product of that index).
_INT32_SITES = (
    ("batch_idx = batch_head_idx // N_Q_HEADS", ("batch_q", "batch_k")),
    ("q_head_idx = batch_head_idx % N_Q_HEADS", ("q_head", "kv_head")),
    ("kv_head_idx = q_head_idx // group_size", ("kv_head",)),
    ("+ batch_idx * q_stride_b", ("batch_q",)),  # q's pointers, and o's (built from q's strides)
    ("+ q_head_idx * q_stride_h", ("q_head",)),
    ("K_ptr + batch_idx * k_stride_b", ("batch_k", "kv_head")),
    ("V_ptr + batch_idx * v_stride_b", ("batch_k", "kv_head")),
    ("q_offsets = q_block_idx * BLOCK_M + tl.arange(0, BLOCK_M)", ("seq",)),
    ("row_offsets = kv_start_row_idx + tl.arange(0, BLOCK_N)", ("seq",)),
    ("q_offsets[:, None] * q_stride_s + tl.arange(0, HEAD_DIM)[None, :]", ("seq",)),
    ("row_offsets[None, :] * k_stride_s + tl.arange(0, HEAD_DIM)[:, None]", ("seq",)),
    ("row_offsets[:, None] * v_stride_s + tl.arange(0, HEAD_DIM)[None, :]", ("seq",)),
)

FLAWS = (
    # Its lines: the kernel's parameters for lse, and the wrapper's three places: allocates (next to o),
    # passes (the launch, any argument line of it), returns.
    Flaw("lse_missing", "the wrapper never allocates, passes or returns the logsumexp buffer", "input",
         ("M_ptr, # this is acutally L", "m_stride_b,", "m_stride_h,", "m_stride_s,",
          "o = torch.empty_like(q)", "_flash_attention_forward_gqa_kernel[grid](", "return o"),
         "any input the contract accepts shows it: call the classmate's own wrapper."),
    Flaw("p_cast", "p is cast to bfloat16 by hand before P @ V", "input",
         ("tl.dot(p_ij.to(tl.bfloat16), v_block)",),
         "this line is only wrong when v is not bfloat16: give float32 (or float16) tensors."),
    Flaw("lse_bases", "the logsumexp adds a log2-unit max to a natural log", "input",
         ("m_to_store = m_i + tl.log(l_i + 1e-6)", "qk_scale = softmax_scale * 1.44269504"),
         "any input shows it: compare the returned lse with the reference's."),
    Flaw("epsilon", "+ 1e-6 in the normaliser guards against nothing that can happen here", "reading",
         ("m_to_store = m_i + tl.log(l_i + 1e-6)", "l_i_safe = l_i[:, None] + 1e-6"),
         "", token="1e-6"),
    Flaw("o_strides", "the output pointers are built from q's strides", "input",
         ("o_ptrs = (", "O_ptr\n", "o = torch.empty_like(q)"),
         "o is allocated with torch.empty_like(q), which copies q's strides whenever q is dense: the flaw "
         "needs a q that is not dense (expanded over the batch, or sliced from a wider tensor)."),
    Flaw("head_dim_stride", "the head dimension is assumed contiguous (no stride for d)", "input",
         ("q_offsets[:, None] * q_stride_s + tl.arange(0, HEAD_DIM)[None, :]",
          "row_offsets[None, :] * k_stride_s + tl.arange(0, HEAD_DIM)[:, None]",
          "row_offsets[:, None] * v_stride_s + tl.arange(0, HEAD_DIM)[None, :]"),
         "it needs a tensor whose last dimension is not contiguous (stride(-1) != 1), for example "
         "k.transpose(-1, -2).contiguous().transpose(-1, -2)."),
    Flaw("block_multiple", "phase 1 assumes BLOCK_M is a multiple of BLOCK_N", "input",
         ("for start_n in range(0, q_block_idx * BLOCK_M, BLOCK_N):", "diag_start = q_block_idx * BLOCK_M",
          "for start_n in range(diag_start, (q_block_idx + 1) * BLOCK_M, BLOCK_N):"),
         "the classmate's 128 x 64 blocks hide it: give block_m and block_n with block_n larger than block_m."),
    Flaw("is_causal_ignored", "is_causal is accepted and ignored", "input",
         ("def flash_attention_forward(q, k, v, is_causal=True):",),
         "pass is_causal=False: the contract says that must not silently return causal attention."),
    Flaw("int32_offsets", "batch_idx * stride (and head * stride) are computed in int32 and overflow on large tensors",
         "arithmetic", tuple(anchor for anchor, _ in _INT32_SITES),
         "give shape=(B, Hq, Hkv, N, D) of contiguous tensors for which one of the kernel's int32 offset "
         "products passes 2**31 - 1 (no tensor is created: the check does the arithmetic)."),
    Flaw("comments_swapped", "the comments give the tile shapes with BLOCK_M and BLOCK_N swapped", "reading",
         ("# we need to load blocks of shape (HEAD_DIM, BLOCK_M)", "# shape (BLOCK_N, HEAD_DIM)"),
         "", token="BLOCK"),
)
_BY_KEY = {f.key: f for f in FLAWS}


# --------------------------------------------------------------------------- #
# The classmate's file, and copies of it with flaws fixed
# --------------------------------------------------------------------------- #
def _source() -> str:
    return EXHIBIT.read_text()


def _norm(text: str) -> str:
    return " ".join(text.split())


def _flaw_lines() -> dict[str, set[int]]:
    """For each flaw, the numbers of the exhibit's lines its anchors pick."""
    lines = _source().split("\n")
    out = {}
    for f in FLAWS:
        picked = set()
        for anchor in f.anchors:
            if anchor.endswith("\n"):  # a whole line
                picked |= {i for i, ln in enumerate(lines) if ln.strip() == anchor.strip()}
            elif anchor == "o_ptrs = (":  # the whole o_ptrs block
                start = next(i for i, ln in enumerate(lines) if ln.strip() == anchor)
                end = next(i for i in range(start, len(lines)) if lines[i].strip() == ")")
                picked |= set(range(start, end + 1))
            elif anchor == "return o":
                picked |= {i for i, ln in enumerate(lines) if ln.strip() == "return o"}
            elif anchor == "_flash_attention_forward_gqa_kernel[grid](":  # the launch and what it passes
                start = next(i for i, ln in enumerate(lines) if ln.strip() == anchor)
                end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("HEAD_DIM="))
                picked |= set(range(start, end))
            else:
                found = {i for i, ln in enumerate(lines) if anchor in ln}
                assert found, f"{f.key}: anchor {anchor!r} not in the exhibit"
                picked |= found
        out[f.key] = picked
    return out


_SIGNATURE = (
    "    m_stride_s,    \n",
    "    m_stride_s,    \n    q_stride_d, k_stride_d, v_stride_d,\n"
    "    o_stride_b, o_stride_h, o_stride_s, o_stride_d,\n",
)
# Kernel fixes, applied in this order: (flaw, [(old, new), ...]); every old text must be present.
_FIXES = (
    ("p_cast", [("p_ij.to(tl.bfloat16)", "p_ij.to(v_block.dtype)")]),
    ("lse_bases", [("m_to_store = m_i + tl.log(l_i + 1e-6)",
                    "m_to_store = (m_i + tl.log2(l_i + 1e-6)) * 0.6931471805599453")]),
    ("epsilon", [("(l_i + 1e-6)", "(l_i)"), ("l_i_safe = l_i[:, None] + 1e-6", "l_i_safe = l_i[:, None]")]),
    ("o_strides", [("O_ptr\n        + batch_idx * q_stride_b\n        + q_head_idx * q_stride_h\n"
                    "        + (q_offsets[:, None] * q_stride_s",
                    "O_ptr\n        + batch_idx * o_stride_b\n        + q_head_idx * o_stride_h\n"
                    "        + (q_offsets[:, None] * o_stride_s")]),
    ("head_dim_stride", [
        ("q_stride_s + tl.arange(0, HEAD_DIM)[None, :])", "q_stride_s + tl.arange(0, HEAD_DIM)[None, :] * q_stride_d)"),
        ("o_stride_s + tl.arange(0, HEAD_DIM)[None, :])", "o_stride_s + tl.arange(0, HEAD_DIM)[None, :] * o_stride_d)"),
        ("k_stride_s + tl.arange(0, HEAD_DIM)[:, None]", "k_stride_s + tl.arange(0, HEAD_DIM)[:, None] * k_stride_d"),
        ("v_stride_s + tl.arange(0, HEAD_DIM)[None, :]", "v_stride_s + tl.arange(0, HEAD_DIM)[None, :] * v_stride_d"),
    ]),
    ("block_multiple", [
        ("for start_n in range(0, q_block_idx * BLOCK_M, BLOCK_N):",
         "for start_n in range(0, (q_block_idx * BLOCK_M) // BLOCK_N * BLOCK_N, BLOCK_N):"),
        ("diag_start = q_block_idx * BLOCK_M", "diag_start = (q_block_idx * BLOCK_M) // BLOCK_N * BLOCK_N"),
    ]),
    ("int32_offsets", [
        ("batch_idx = batch_head_idx // N_Q_HEADS", "batch_idx = (batch_head_idx // N_Q_HEADS).to(tl.int64)"),
        ("q_head_idx = batch_head_idx % N_Q_HEADS", "q_head_idx = (batch_head_idx % N_Q_HEADS).to(tl.int64)"),
    ]),
)
_TMP = None
_CACHE: dict = {}


def _kernel_source(keep: frozenset) -> str:
    """The classmate's kernel with every fix applied except those of the flaws in ``keep``."""
    src = _source().split("\ndef flash_attention_forward(")[0]
    assert _SIGNATURE[0] in src
    src = src.replace(*_SIGNATURE)
    for key, patches in _FIXES:
        if key in keep:
            continue
        for old, new in patches:
            if key == "head_dim_stride" and old.startswith("o_stride_s") and old not in src:
                continue  # o still built from q's strides: its head-dim stride is q's (patched above)
            assert old in src, f"fix for {key}: {old!r} not found"
            src = src.replace(old, new)
    return src


def classmate_variant(keep=()):
    """The classmate's kernel with every flaw fixed but those in ``keep``: a launcher ``f(q, k, v, ...)``.

    The launcher passes every argument (so the missing-lse flaw is not in it;
    ``"lse_missing" in keep`` returns the classmate's own wrapper instead), and
    honours ``is_causal`` by refusing ``False`` unless ``"is_causal_ignored" in
    keep``. ``o`` is placed at the start of a NaN-filled buffer as large as
    anything q's strides can reach, so a kernel writing with q's strides
    stays inside memory it owns.
    """
    keep = frozenset(keep)
    if "lse_missing" in keep:
        module = _load(_source(), "classmate_original")
        return module.flash_attention_forward
    kernel_keep = keep & {k for k, _ in _FIXES}
    if kernel_keep not in _CACHE:
        name = "classmate_" + ("_".join(sorted(kernel_keep)) or "fixed")
        header = "import math\nimport torch\nimport triton\nimport triton.language as tl\n\n"
        _CACHE[kernel_keep] = _load(header + _kernel_source(kernel_keep), name)._flash_attention_forward_gqa_kernel
    kernel = _CACHE[kernel_keep]
    ignore_causal = "is_causal_ignored" in keep

    def forward(q, k, v, is_causal=True, block_m=128, block_n=64):
        import torch
        import triton

        if not is_causal and not ignore_causal:
            raise NotImplementedError("this kernel computes causal attention only; is_causal=False is refused")
        batch, n_q_heads, seq_len, head_dim = q.shape
        like = torch.empty_like(q)
        reach = 1 + sum((s - 1) * abs(st) for s, st in zip(q.shape, q.stride()))
        buf = torch.full((max(reach, like.numel()) + 64,), float("nan"), dtype=q.dtype, device=q.device)
        o = buf.as_strided(like.shape, like.stride())
        lse = torch.empty((batch, n_q_heads, seq_len), dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(seq_len, block_m), batch * n_q_heads)
        # num_stages=1: no software pipelining, so the tiles a finding may ask for fit a GPU's shared memory
        # (fp32, D=128, 128 x 64 needs 256 KiB at Triton's default 3 stages on sm_90, 128 KiB at 1; every
        # block pair of 16..128 fits the H200's 227 KiB at 1). The interpreter ignores it; results are the same.
        kernel[grid](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                     v.stride(0), v.stride(1), v.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
                     q.stride(3), k.stride(3), v.stride(3), *o.stride(),
                     1.0 / math.sqrt(head_dim), seq_len, n_q_heads, k.shape[1],
                     HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, num_stages=1)
        return o, lse

    return forward


def _load(src: str, name: str):
    """Import ``src`` as a module from a file (Triton reads a kernel's source from its file)."""
    global _TMP
    if _TMP is None:
        _TMP = Path(tempfile.mkdtemp(prefix="course_flaw_hunt_"))
    path = _TMP / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"course_utils_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- #
# Arithmetic: the int32 overflow
# --------------------------------------------------------------------------- #
def _int32_products(shape):
    """``(key, product, largest index, stride)`` of each int32 offset product, for contiguous tensors of ``shape``."""
    b, hq, hkv, n, d = (int(x) for x in shape)
    return [
        ("batch_q", "batch_idx * q_stride_b", b - 1, hq * n * d),
        ("batch_k", "batch_idx * k_stride_b", b - 1, hkv * n * d),
        ("q_head", "q_head_idx * q_stride_h", hq - 1, n * d),
        ("kv_head", "kv_head_idx * k_stride_h", hkv - 1, n * d),
        ("seq", "q_offsets * q_stride_s", n - 1, d),  # and row_offsets * k_stride_s: the same numbers
    ]


def int32_overflows(shape) -> dict[str, str]:
    """Every int32 offset product of the classmate's kernel that overflows for contiguous tensors of ``shape``.

    ``shape = (B, Hq, Hkv, N, D)``. Triton passes an integer argument below
    2**31 as int32 and ``tl.program_id`` is int32, so ``batch_idx * q_stride_b``
    is computed in int32 unless the stride itself is already 2**31 or more.
    Returns ``{key: sentence}`` for each product past 2**31 - 1, in the
    kernel's order (keys: batch_q, batch_k, q_head, kv_head, seq).
    """
    return {key: f"{what} = {idx} * {stride} = {idx * stride:,} > 2**31 - 1 = {INT32_MAX:,}"
            for key, what, idx, stride in _int32_products(shape)
            if stride <= INT32_MAX and idx * stride > INT32_MAX}


def int32_overflow(shape) -> str | None:
    """Which int32 offset product of the classmate's kernel overflows first for contiguous tensors of ``shape``.

    A sentence naming the first product past 2**31 - 1 (see :func:`int32_overflows`), or ``None``.
    """
    return next(iter(int32_overflows(shape).values()), None)


def _int32_line_products() -> dict[int, set[str]]:
    """For each exhibit line of the int32 flaw, the keys of the offset products computed on it."""
    lines = _source().split("\n")
    out: dict[int, set[str]] = {}
    for anchor, keys in _INT32_SITES:
        for i, ln in enumerate(lines):
            if anchor in ln:
                out.setdefault(i, set()).update(keys)
    return out


def _int32_verdict(shape, lines: set[int]) -> tuple[bool, str]:
    """Whether ``shape`` overflows an offset computed on the finding's ``lines``; if not, why, when
    another line's offset does overflow (a sentence; empty when no product overflows at all)."""
    over = int32_overflows(shape)
    here = set().union(*(_int32_line_products().get(i, set()) for i in lines))
    if any(key in over for key in here):
        return True, ""
    if not over:
        return False, ""
    mine = [(what, idx, stride) for key, what, idx, stride in _int32_products(shape) if key in here]
    wide = " (a stride of 2**31 or more is passed as int64)" if any(st > INT32_MAX for _, _, st in mine) else ""
    return False, (f"with shape={tuple(shape)} an int32 product does overflow, {next(iter(over.values()))}, but it "
                   f"is not computed on this line, whose offsets stay in range: "
                   + "; ".join(f"{what} = {idx} * {st:,} = {idx * st:,}" for what, idx, st in mine)
                   + f"{wide}. Point at the line where the overflowing offset is computed, or give a shape that "
                   "overflows this line's.")


# --------------------------------------------------------------------------- #
# The check
# --------------------------------------------------------------------------- #
MAX_FINDING_LINES = 3  # a finding names one statement; the whole file would "name" every flaw


def _lines_of(run: Run, finding: dict, case: str) -> set[int]:
    text = finding.get("line")
    if not isinstance(text, str) or not text.strip():
        raise run.fail("each finding needs line='...': a piece of the classmate's code, copied from the file.", case)
    lines = _source().split("\n")
    normed = [_norm(ln) for ln in lines]
    picked = set()
    pieces = [p for p in (_norm(p) for p in text.split("\n")) if p]
    if len(pieces) > MAX_FINDING_LINES:
        raise run.fail(f"line= holds {len(pieces)} lines: a finding points at one place, so copy the line the flaw "
                       f"is on (at most {MAX_FINDING_LINES} lines of one statement), one finding per flaw.", case)
    for piece in pieces:
        if len(piece) < 6:
            raise run.fail(f"line={piece!r} is too short to point at one place: copy a whole line.", case)
        found = {i for i, ln in enumerate(normed) if piece in ln}
        if not found:
            raise run.fail(f"line={piece!r} is not in the classmate's file: copy it from the exhibit.", case)
        picked |= found
    return picked


def _validate_inputs(run: Run, inputs, case: str):
    import torch

    if not isinstance(inputs, dict) or not all(name in inputs for name in ("q", "k", "v")):
        raise run.fail("inputs must be a dict with q, k, v (and optionally is_causal, block_m, block_n).", case)
    unknown = set(inputs) - {"q", "k", "v", "is_causal", "block_m", "block_n"}
    if unknown:
        raise run.fail(f"inputs has keys the wrapper does not take: {sorted(unknown)}.", case)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise run.fail("q, k and v must be 4-D torch tensors [B, H, N, D].", case)
    env = current()
    allowed = {torch.float32, torch.float16} | ({torch.bfloat16} if env.device == "cuda" else set())
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in allowed:
        extra = " (bfloat16 is computed wrongly by the interpreter on a CPU, so it is refused here)" \
            if q.dtype == torch.bfloat16 else ""
        raise run.fail(f"q, k, v must share one dtype among {sorted(str(a) for a in allowed)}; got "
                       f"{q.dtype}, {k.dtype}, {v.dtype}{extra}.", case)
    if not (q.device.type == k.device.type == v.device.type == env.device):
        raise run.fail(f"put q, k and v on course_utils.DEVICE ({env.device}).", case)
    b, hq, n, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d or hq % k.shape[1]:
        raise run.fail(f"shapes outside the contract: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                       "(k and v [B, Hkv, N, D] with Hq a multiple of Hkv).", case)
    if d not in (16, 32, 64, 128):
        raise run.fail(f"head dim {d}: this kernel's design needs a power of two from 16 to 128 "
                       "(tl.arange and tl.dot); that limit is not one of the flaws.", case)
    limit = 512 if env.device == "cpu" else 8192
    if n > limit or b * hq > 64:
        raise run.fail(f"keep it small: N <= {limit} and B * Hq <= 64 (every flaw shows on small inputs).", case)
    for key in ("block_m", "block_n"):
        if key in inputs and inputs[key] not in (16, 32, 64, 128):
            raise run.fail(f"{key} must be 16, 32, 64 or 128.", case)
    if not all(torch.isfinite(t).all() for t in (q, k, v)):
        raise run.fail("q, k and v must be finite.", case)


# (o's atol = rtol, lse's atol) per device and dtype. On a GPU float32 dots run in tf32 (inputs rounded to
# 10 mantissa bits: lse off by several 1e-3 at larger scores) and bfloat16 keeps 8 bits: there the same
# tolerances as check_flash_gqa's for lse, so an input the fixed kernel gets right is never refused.
# Every flaw an input shows is off by far more.
_TOL = {
    ("cpu", "float32"): (5e-3, 5e-3), ("cpu", "float16"): (2e-2, 2e-2),
    ("cuda", "float32"): (5e-3, 1e-2), ("cuda", "float16"): (2e-2, 2e-2), ("cuda", "bfloat16"): (3e-2, 3e-2),
}


def _out_of_resources(exc: BaseException) -> bool:
    """Triton's "out of resource: shared memory" (OutOfResources), raised at a GPU launch."""
    return type(exc).__name__ == "OutOfResources" or "out of resource" in str(exc).lower()


def _wrong(run: Run, forward, inputs, expected, case: str = "") -> str | None:
    """Why ``forward`` fails on ``inputs`` (raises, or o/lse beyond tolerance), or None if it is right."""
    try:
        o, lse = forward(**inputs)
    except Exception as exc:  # a crash is a symptom too
        if _out_of_resources(exc):  # a limit of this GPU, not of the code: no verdict on it either way
            q = inputs["q"]
            raise run.fail(
                f"the grader's copy of the kernel cannot launch these tiles on this GPU ({exc}): block_m="
                f"{inputs.get('block_m', 128)} x block_n={inputs.get('block_n', 64)} tiles of head dim {q.shape[-1]} "
                f"in {str(q.dtype).replace('torch.', '')} need more shared memory than it has. That is the "
                "hardware's limit, not one of the flaws: give smaller block_m / block_n, float16, or a smaller "
                "head dim.", case) from None
        return f"it raises {type(exc).__name__}"
    o_ref, lse_ref = expected
    tol, lse_tol = _TOL[(current().device, str(inputs["q"].dtype).replace("torch.", ""))]
    o = o.detach().cpu().double().numpy()
    lse = lse.detach().cpu().double().numpy()
    with np.errstate(invalid="ignore"):
        o_err = np.abs(o - o_ref)
        if not np.all(o_err <= tol + tol * np.abs(o_ref)):
            return f"o is off by up to {np.nanmax(np.where(np.isnan(o_err), np.inf, o_err)):.3g}"
        if not np.all(np.abs(lse - lse_ref) <= lse_tol):
            return f"lse is off by up to {np.nanmax(np.where(np.isnan(lse), np.inf, np.abs(lse - lse_ref))):.3g}"
    return None


def grade_flaw_hunt(findings, *, seed=None):
    """Grade a list of findings about the classmate's kernel of lesson 05b.
    
    Each finding is ``dict(line=..., why=..., inputs=dict(q=, k=, v=, [is_causal, block_m, block_n]))``;
    for the int32 flaw, ``shape=(B, Hq, Hkv, N, D)`` instead of ``inputs``; for flaws no input can
    show, the line alone. Passes when every planted flaw has a finding that shows it.
    """
    __tracebackhide__ = True
    run = Run("check_flaw_hunt", seed, time_limit_s=120.0)
    if not isinstance(findings, (list, tuple)) or not all(isinstance(f, dict) for f in findings):
        raise GradingError("check_flaw_hunt takes a list of findings, each a dict(line=..., why=..., inputs=...).")
    if not findings:
        raise GradingError("check_flaw_hunt: the list of findings is empty.")
    flaw_lines = _flaw_lines()
    credited: dict[str, int] = {}
    for number, finding in enumerate(findings, 1):
        case = f"finding {number} ({_norm(str(finding.get('line', '')))[:60]!r})"
        lines = _lines_of(run, finding, case)
        named = [f for f in FLAWS if flaw_lines[f.key] & lines]
        if not named:
            raise run.fail("that line is not where one of the planted flaws is. If you think it is wrong, "
                           "say so to your classmate; here, point at the line the flaw lives on.", case)
        reasons, shown = [], set()
        for flaw in named:
            if flaw.kind == "reading":
                if flaw.token in finding["line"]:
                    shown.add(flaw.key)
                continue
            if flaw.kind == "arithmetic":
                shape = finding.get("shape")
                if shape is None:
                    reasons.append(f"for {flaw.key}: {flaw.hint}")
                    continue
                try:
                    shape = tuple(int(x) for x in shape)
                except (TypeError, ValueError):
                    shape = ()
                if len(shape) != 5 or min(shape) < 1 or shape[1] % shape[2]:
                    raise run.fail("shape must be (B, Hq, Hkv, N, D), positive, with Hq a multiple of Hkv.", case)
                overflows, elsewhere = _int32_verdict(shape, lines)
                if overflows:
                    shown.add(flaw.key)
                elif elsewhere:
                    reasons.append(elsewhere)
                else:
                    reasons.append(f"with shape={tuple(shape)} every int32 product stays below 2**31 - 1. Likely "
                                   f"cause: {flaw.hint}")
                continue
            inputs = finding.get("inputs")
            if inputs is None:
                reasons.append(f"this line needs a failing input: inputs=dict(q=..., k=..., v=...). {flaw.hint}")
                continue
            _validate_inputs(run, inputs, case)
            q, k, v = (inputs[x].detach().cpu().double().numpy() for x in ("q", "k", "v"))
            causal = bool(inputs.get("is_causal", True))
            expected = references.attention_lse(q, k, v, causal=causal)
            if not causal and flaw.key != "is_causal_ignored":
                reasons.append("is_causal=False only shows the is_causal flaw: use is_causal=True for the others.")
                continue
            if causal:
                fixed_problem = _wrong(run, classmate_variant(()), inputs, expected, case)
                if fixed_problem:
                    raise run.fail(f"this input fails even with every flaw fixed ({fixed_problem}): it is outside "
                                   "what the contract promises, so it shows no flaw.", case)
            run.cases += 1
            symptom = _wrong(run, classmate_variant((flaw.key,)), inputs, expected, case)
            if symptom:
                shown.add(flaw.key)
            else:
                reasons.append(f"on a copy of the classmate's kernel with only this flaw left, this input gives the "
                               f"right o and lse. Likely cause: {flaw.hint}")
        for key in shown:
            credited.setdefault(key, number)
        if not shown:
            raise run.fail("this finding shows none of the flaws on its line: " + " ".join(reasons), case)
    missing = [f for f in FLAWS if f.key not in credited]
    if missing:
        found = [f"  - {f.title}" for f in FLAWS if f.key in credited]
        kinds = {kind: sum(f.kind == kind for f in missing) for kind in ("input", "arithmetic", "reading")}
        raise GradingError(
            f"check_flaw_hunt: you have shown {len(credited)} of the {len(FLAWS)} flaws:\n" + "\n".join(found)
            + f"\nStill to find: {kinds['input']} that a failing input shows, {kinds['arithmetic']} shown by "
            f"arithmetic on a shape, {kinds['reading']} found only by reading. Go back to the contract: each "
            "promise it makes is a place to look."
        )
    return run.passed()
