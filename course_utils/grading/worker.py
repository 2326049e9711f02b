"""A separate Python process that runs checks, so a learner's kernel cannot break the notebook.

On a GPU a bad memory access inside a kernel (a ``tl.store`` far past the end
of a tensor) leaves the process's CUDA context unusable: every CUDA call after
it fails, and the only way out is to restart the notebook. A kernel that loops
forever cannot be interrupted at all. CUDA does not survive ``fork``, so the
CPU's trick (:func:`.isolation.isolated` forks a child) is not available there.

Instead, the first Triton check of a notebook starts one worker process
(:func:`main`) with a fresh CUDA context of its
own, and every later check is sent to it:

- the learner's launcher and kernels travel **by value**: functions defined in
  the notebook are pickled with `cloudpickle`_, and each ``@triton.jit`` kernel
  is rebuilt in the worker from its source (Triton compiles from source, which
  a notebook cell does not have on disk, so we hand it over);
- the worker runs the check and answers with the outcome (and what the
  learner's code printed);
- if the check faulted CUDA, the worker exits after answering, and the next
  check starts a fresh one; if it runs past the time limit, it is killed.

The notebook's own process never touches the faulting context, so a correct
kernel checked right after a faulting one passes.

.. _cloudpickle: https://github.com/cloudpipe/cloudpickle
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection

from ..guard import WORKER_ENTRY, install_from_environment

__all__ = ["Worker", "WorkerCrashed", "WorkerTimeout", "main"]

_MAX_PRINTED = 20_000  # characters of the learner's printing sent back


class WorkerCrashed(RuntimeError):
    """The worker process died while running a check (``returncode`` says how)."""

    def __init__(self, returncode):
        super().__init__(f"the grading worker died (exit code {returncode})")
        self.returncode = returncode


class WorkerTimeout(RuntimeError):
    """The check ran past its time limit; the worker was killed."""


# ---------------------------------------------------------------------------
# The parent's side
# ---------------------------------------------------------------------------


class Worker:
    """One grading process, started on demand and reused.

    ``device="cuda"``: a worker with its own CUDA context. ``device="cpu"``:
    a worker with the GPU hidden (``CUDA_VISIBLE_DEVICES=""``) and Triton's
    interpreter on, for running a check's kernels on the CPU.
    """

    def __init__(self, device: str, start_timeout_s: float = 180.0):
        self.device = device
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["PYTHONUNBUFFERED"] = "1"
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_ENTRY, str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        if not self._recv.poll(start_timeout_s):
            self.kill()
            raise WorkerTimeout(f"the grading worker did not start within {start_timeout_s:g} s")
        try:
            hello = self._recv.recv()
        except EOFError:
            self.proc.wait()
            raise WorkerCrashed(self.proc.returncode) from None
        self.info = hello

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, payload: bytes, timeout_s: float):
        """Send one pickled ``(check, fn, kwargs)``; return ``(outcome, printed, cuda_broken)``.

        ``outcome`` is :func:`.outcome.run_check`'s ``(kind, value, status)``, or
        ``("unpicklable", traceback, "error")`` when the payload could not be rebuilt there.
        """
        try:
            self._send.send_bytes(payload)
        except (BrokenPipeError, OSError):
            self.proc.wait()
            raise WorkerCrashed(self.proc.returncode) from None
        if not self._recv.poll(timeout_s):
            self.kill()
            raise WorkerTimeout(f"no answer within {timeout_s:g} s")
        try:
            outcome = self._recv.recv()
        except EOFError:
            self.proc.wait()
            raise WorkerCrashed(self.proc.returncode) from None
        if outcome[2]:  # CUDA is broken there: the worker exits; let it
            self.proc.wait(timeout=30)
        return outcome

    def kill(self):
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=30)
        for conn in (self._send, self._recv):
            with contextlib.suppress(Exception):
                conn.close()


# ---------------------------------------------------------------------------
# The worker's side
# ---------------------------------------------------------------------------


def _cuda_broken() -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:
        return True
    return False


def _serve(conn_in: Connection, conn_out: Connection) -> None:
    import cloudpickle

    import course_utils  # first: decides CPU/interpreter or GPU for this process
    from .outcome import run_check

    conn_out.send({"pid": os.getpid(), "device": course_utils.DEVICE})
    while True:
        try:
            payload = conn_in.recv_bytes()
        except EOFError:  # the notebook went away
            return
        printed = io.StringIO()
        try:
            check, fn, kwargs = cloudpickle.loads(payload)
        except BaseException:
            outcome = ("unpicklable", traceback.format_exc(limit=3), "error")
        else:
            with contextlib.redirect_stdout(printed):
                outcome = run_check(check, fn, kwargs)
        broken = _cuda_broken()
        try:
            conn_out.send((outcome, printed.getvalue()[-_MAX_PRINTED:], broken))
        except Exception:  # an answer that does not pickle: say so in words
            conn_out.send((("error", f"the check's result could not be sent back: {outcome[1]!r:.500}", "error"),
                           "", broken))
        if broken:
            return


def main(argv=None) -> int:
    """Serve checks over the two pipe descriptors given as arguments."""
    argv = sys.argv[1:] if argv is None else argv
    # Started from a notebook that the batch grader runs: the same guard here, first, and each call of the
    # learner's function gets the modules the checks trust back as they were before it.
    if install_from_environment():
        from ..guard import TORCH_MODULES, TRUSTED_MODULES, learner_call_guard
        from .core import LEARNER_CALL_GUARDS

        LEARNER_CALL_GUARDS.append(lambda: learner_call_guard(TRUSTED_MODULES + TORCH_MODULES))
    conn_in = Connection(int(argv[0]), writable=False)
    conn_out = Connection(int(argv[1]), readable=False)
    _serve(conn_in, conn_out)
    return 0
