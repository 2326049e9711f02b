"""The gradebook in an LMS's import format: Canvas's gradebook CSV.

``python -m course_utils.grade class/ --roster roster.csv`` writes
``gradebook/canvas.csv`` through :func:`write_canvas`. Canvas's gradebook import
reads the columns ``Student, ID, SIS User ID, SIS Login ID, Section``, then one
column per assignment, with a ``Points Possible`` row under the header; here an
assignment is a lesson (its points: the sum of its exercises' points).

The roster maps the learners' folder names to their LMS identities: a CSV with a
``folder`` column and any of ``Student``, ``ID``, ``SIS User ID``, ``SIS Login ID``,
``Section`` (Canvas's own export of its gradebook has them all; add ``folder``).
A graded learner missing from the roster is never dropped: their row is written
with the folder name as ``Student`` and empty identities, and :func:`write_canvas`
returns their names so that the summary can list them.
"""

from __future__ import annotations

import csv
from pathlib import Path

__all__ = ["IDENTITY", "read_roster", "write_canvas"]

IDENTITY = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")


def read_roster(path: Path) -> dict[str, dict[str, str]]:
    """``{folder: {identity column: value}}`` from a roster CSV (``ValueError`` if it has no ``folder`` column)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "folder" not in reader.fieldnames:
            raise ValueError(f"{path}: the roster needs a `folder` column (the learner's folder name), "
                             f"beside {', '.join(IDENTITY)}; its columns are {reader.fieldnames}")
        roster = {}
        for row in reader:
            folder = (row.get("folder") or "").strip()
            if folder:
                roster[folder] = {k: (row.get(k) or "").strip() for k in IDENTITY}
    return roster


def _num(x: float):
    return int(x) if float(x).is_integer() else round(float(x), 2)


def write_canvas(rows: list[dict], roster: dict[str, dict[str, str]], path: Path, lessons: list[str]) -> list[str]:
    """Write Canvas's gradebook CSV to ``path``; return the graded learners missing from ``roster``.

    ``rows`` are the gradebook's rows (learner, notebook, points, max_points);
    ``lessons`` the notebooks' stems in course order (one column each).
    """
    possible = {lesson: 0.0 for lesson in lessons}
    seen_exercise = set()
    points: dict[str, dict[str, float]] = {}
    for row in rows:
        lesson = row["notebook"]
        if lesson not in possible:
            continue
        if (lesson, row["exercise"]) not in seen_exercise:
            seen_exercise.add((lesson, row["exercise"]))
            possible[lesson] += row["max_points"]
        points.setdefault(row["learner"], {}).setdefault(lesson, 0.0)
        points[row["learner"]][lesson] += row["points"]
    in_roster = [name for name in roster if name in points] + [name for name in roster if name not in points]
    missing = sorted(name for name in points if name not in roster)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(list(IDENTITY) + lessons)
        writer.writerow(["Points Possible", "", "", "", ""] + [_num(possible[lesson]) for lesson in lessons])
        for name in in_roster + missing:
            who = roster.get(name) or {"Student": name}
            mine = points.get(name, {})
            writer.writerow([who.get(k, "") or (name if k == "Student" else "") for k in IDENTITY]
                            + [_num(mine[lesson]) if lesson in mine else "" for lesson in lessons])
    return missing
