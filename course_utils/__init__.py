"""FlashAttention from scratch: the package every course notebook imports first.

Importing it configures the machine (see :mod:`course_utils.environment`):
without a GPU it switches Triton's interpreter on, which must happen before
``import triton``. Modules:

- ``environment``: CPU or GPU, interpreter, default dtype and sizes, the doctor;
- ``references``: float64 reference implementations the graders compare with;
- ``grading``: one ``check_*`` function per exercise;
- ``kernels``: the course's Triton kernels (importable, documented);
- ``plots`` and ``widgets``: pictures and interactive controls for the lessons;
- ``build``: generates the student notebooks from ``solutions/``;
- ``bench``: the GPU benchmark sweep.
"""

from .environment import configure as _configure

ENV = _configure()
DEVICE = ENV.device

# The line the build tool puts where a solution was (course_utils.build uses it).
STUB_LINE = "# YOUR CODE HERE"

__all__ = ["ENV", "DEVICE", "doctor", "require_implemented", "STUB_LINE"]


def doctor() -> None:
    """Print what this machine is and any known problem with it."""
    from .environment import report

    print(report())


def require_implemented(*kernels) -> None:
    """Raise ``NotImplementedError`` while a ``@triton.jit`` stub is unfilled.

    A Triton kernel cannot raise, so a student notebook's launcher calls this
    first: it looks for the ``# YOUR CODE HERE`` line that the build tool puts
    in place of the solution, and raises until the learner replaces it.
    """
    for kernel in kernels:
        src = getattr(kernel, "src", None)
        if src is None and getattr(kernel, "fn", None) is not None:
            # The interpreter's InterpretedFunction has no `.src`: read the Python function's.
            import inspect

            try:
                src = inspect.getsource(kernel.fn)
            except (OSError, TypeError):
                src = None
        if STUB_LINE in (src or ""):
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "the kernel")
            raise NotImplementedError(
                f"`{name}` still has a `{STUB_LINE}` line: replace it with your code, then run this cell again."
            )
