"""The generated student notebooks run, and stop at the first exercise with a clear error.

Everything before the first exercise (imports, the doctor, demonstrations)
must run as it does in the solution; the first error must be the stub's
``NotImplementedError`` (or, for a Triton kernel stub, the launcher's), not
a ``NameError`` or a ``SyntaxError`` left by the build.
"""

from pathlib import Path

import nbformat
import pytest
from course_utils.build import notebook_client
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Lessons with nothing to fill in run to the end.
NO_EXERCISE = {"00_setup.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_student_notebook_stops_at_its_first_stub(path):
    nb = nbformat.read(path, as_version=4)
    has_stub = any(c.cell_type == "code" and "raise NotImplementedError()" in c.source for c in nb.cells) or any(
        c.cell_type == "code" and "# YOUR CODE HERE" in c.source for c in nb.cells
    )
    client = notebook_client(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}})
    if path.name in NO_EXERCISE:
        client.execute()
        return
    assert has_stub, f"{path.name} has no exercise stub"
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "NotImplementedError", f"{path.name}: first error is {err.value.ename}: {err.value.evalue}"
