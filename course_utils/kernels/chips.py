"""What each GPU the course targets allows a kernel: per-block shared memory and registers per thread.

A table with no imports, so that any kernel module can check its tiles against it (``hopper_ws``: a Hopper
block's shared memory) without importing :mod:`.targets`, the tool that compiles the lesson kernels.
"""

# Per-block shared memory a kernel may use (opt-in maximum) and the chips' names.
TARGETS = {
    75: ("Tesla T4 (Colab's free GPU)", 64 * 1024),
    80: ("A100", 163 * 1024),
    86: ("RTX 30xx / A10", 99 * 1024),
    89: ("RTX 40xx / L4", 99 * 1024),
    90: ("H100 / H200", 227 * 1024),
}
MAX_REGISTERS = 255
