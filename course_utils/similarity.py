"""Which learners handed in the same exercise code, once the surface differences are removed.

The batch grader (:mod:`course_utils.grade`) calls :func:`report` after grading a
class. For each exercise cell of each notebook, every pair of learners whose code
is at least ``threshold`` similar after normalisation is listed (``summary.md``),
with the two cells side by side in ``gradebook/similar/``. It never changes a
grade: a similar pair is a place for the instructor to look, not a verdict (short
exercises have few ways to be written, and the starting code is shared).

Normalisation (:func:`tokens`): Python's own tokenizer; comments, blank lines,
indentation tokens and docstrings dropped; every name that is not a keyword, a
builtin or an attribute (``np.exp`` keeps ``exp``) renamed ``v1, v2, ...`` in order
of first use; string literals replaced by one token. Similarity is
:class:`difflib.SequenceMatcher`'s ratio of the two token lists.
"""

from __future__ import annotations

import builtins
import difflib
import html
import io
import keyword
import tokenize
from pathlib import Path

__all__ = ["tokens", "similarity", "similar_pairs", "report", "THRESHOLD", "MIN_TOKENS"]

THRESHOLD = 0.9  # pairs at least this similar are listed
MIN_TOKENS = 30  # cells shorter than this (after normalisation) are not compared: too few ways to write them
_BUILTINS = set(dir(builtins))


def tokens(source: str) -> list[str] | None:
    """The normalised tokens of ``source`` (None if Python cannot tokenize it)."""
    out: list[str] = []
    names: dict[str, str] = {}
    previous = None
    try:
        stream = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}
    line_start = True
    for tok in stream:
        if tok.type in (tokenize.NEWLINE, tokenize.NL):
            line_start = True
        if tok.type in skip:
            continue
        if tok.type == tokenize.STRING:
            if line_start and previous in (None, ":"):
                previous, line_start = tok.string, False
                continue  # a docstring
            out.append("<str>")
        elif tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) and tok.string not in _BUILTINS \
                and previous != ".":
            out.append(names.setdefault(tok.string, f"v{len(names) + 1}"))
        else:
            out.append(tok.string)
        previous, line_start = tok.string, False
    return out


def similarity(a: list[str], b: list[str]) -> float:
    """How alike two token lists are, 0 to 1."""
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def similar_pairs(cells: dict[str, str], stub: str = "", *, threshold: float = THRESHOLD,
                  min_tokens: int = MIN_TOKENS) -> list[tuple[str, str, float]]:
    """``(learner_a, learner_b, similarity)`` for each pair at least ``threshold`` alike, most alike first.

    ``cells`` maps a learner to their code of one exercise cell; cells equal to the
    ``stub`` (not attempted), shorter than ``min_tokens`` or not Python are left out.
    """
    stub_tokens = tokens(stub) if stub else None
    normal = {}
    for learner, source in cells.items():
        t = tokens(source)
        if t is None or len(t) < min_tokens or t == stub_tokens:
            continue
        normal[learner] = t
    learners = sorted(normal)
    pairs = []
    for i, a in enumerate(learners):
        for b in learners[i + 1:]:
            s = similarity(normal[a], normal[b])
            if s >= threshold:
                pairs.append((a, b, s))
    return sorted(pairs, key=lambda p: (-p[2], p[0], p[1]))


def _side_by_side(title: str, a: str, code_a: str, b: str, code_b: str) -> str:
    """A small HTML page with the two learners' cells in two columns, as they wrote them."""
    cell = '<td style="vertical-align:top"><h3>{}</h3><pre>{}</pre></td>'
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{t}</title></head><body><h2>{t}</h2>"
            "<table><tr>{l}{r}</tr></table></body></html>\n").format(
        t=html.escape(title), l=cell.format(html.escape(a), html.escape(code_a)),
        r=cell.format(html.escape(b), html.escape(code_b)))


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def report(exercise_cells: dict[tuple[str, str], tuple[str, dict[str, str]]], out: Path, *,
           threshold: float = THRESHOLD, min_tokens: int = MIN_TOKENS) -> list[str]:
    """Write ``out/similar/*.html`` (two cells side by side); return the lines for ``summary.md``.

    ``exercise_cells`` maps ``(notebook, exercise label)`` to ``(stub, {learner: code})``.
    """
    folder = out / "similar"
    lines = ["## Similar hand-ins", "",
             f"Pairs of learners whose code of an exercise cell is at least {threshold:.0%} alike once comments, "
             "whitespace and variable names are removed (cells under "
             f"{min_tokens} tokens and unchanged stubs are not compared). This never changes a grade: "
             "it is a place to look.", ""]
    found = False
    for (notebook, label), (stub, cells) in sorted(exercise_cells.items()):
        pairs = similar_pairs(cells, stub, threshold=threshold, min_tokens=min_tokens)
        for a, b, s in pairs:
            if not found:
                folder.mkdir(parents=True, exist_ok=True)
                found = True
            name = f"{_safe(notebook)}__{_safe(label)}__{_safe(a)}__{_safe(b)}.html"
            (folder / name).write_text(_side_by_side(f"{notebook}: {label}, {s:.0%} alike", a, cells[a], b, cells[b]))
            lines.append(f"- `{label}` ({notebook}): {a} and {b}, {s:.0%} alike: [side by side](similar/{name})")
    if not found:
        lines.append("No pair above the threshold.")
    return lines
