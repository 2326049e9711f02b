"""The batch grader's write guard, and the one program it lets a graded notebook start (stdlib only).

The batch grader (:mod:`course_utils.grade`) runs each learner's notebook in a
fresh kernel whose first cell calls :func:`install`. :mod:`course_utils.grade`
does not import this module there: it runs this file's text in the learner's
kernel (before any learner code, and before ``course_utils`` is imported), so
nothing here may import ``course_utils``.

The guard is an audit hook (:func:`sys.addaudithook`) that refuses to write,
delete or rename files outside the notebook's temporary folder, to run other
programs, or to signal other processes. It stops honest accidents and simple
tricks inside Python; it is not an operating-system boundary (``ctypes``, file
descriptors and subprocesses can reach past an audit hook).

The one program it lets through is the course's grading worker
(:data:`WORKER_ENTRY`, :mod:`course_utils.grading.worker`), and only with
:data:`GUARD_VAR` in its environment: the worker calls :func:`install` with the
same settings before it reads anything.
"""

# NOTE: stdlib only, and no import of course_utils: this text runs before course_utils is imported.
import json
import os
import sys

# The course's grading worker, the one program a graded notebook may start besides compilers.
WORKER_ENTRY = "import sys; from course_utils.grading.worker import main; sys.exit(main())"
# The environment variable that carries the guard's settings (JSON) into the worker.
GUARD_VAR = "COURSE_GRADE_GUARD"


def install_from_environment() -> bool:
    """Install the guard described by :data:`GUARD_VAR`, if this process was started with it."""
    guard = os.environ.get(GUARD_VAR)
    if not guard:
        return False
    install(json.loads(guard))
    return True


def install(cfg):
    """Install the write guard and the resource limits in this process (before any learner code).

    ``cfg``: ``write_roots`` (folders it may write in), ``hidden_dirs`` (folders it may not list),
    ``allowed_programs`` (executables it may start), ``data_limit_bytes`` (``RLIMIT_DATA``, or None).
    The guard is an audit hook: Python cannot remove it once added. It also goes into the
    environment (:data:`GUARD_VAR`) so that the course's worker, started from here, installs it too.
    """
    if cfg.get("data_limit_bytes"):
        try:
            import resource

            limit = int(cfg["data_limit_bytes"])
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        except (ImportError, ValueError, OSError):
            pass
    guard = json.dumps({"token_a": "worker", **{k: cfg.get(k) for k in
                        ("write_roots", "hidden_dirs", "allowed_programs", "data_limit_bytes")}}, sort_keys=True)
    os.environ[GUARD_VAR] = guard
    roots = tuple(os.path.realpath(p) for p in cfg["write_roots"])
    hidden = tuple(os.path.realpath(p) for p in cfg.get("hidden_dirs", ()))
    allowed_programs = frozenset(cfg.get("allowed_programs", ()))
    me = os.getpid()
    state = {"busy": False}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path):
        try:
            if isinstance(path, int):
                return True  # an already-open file descriptor
            path = os.fsdecode(os.fspath(path))
            if path in ("/dev/null", "/dev/stdout", "/dev/stderr") or path.startswith("/dev/shm/"):
                return True
            real = os.path.realpath(path)
        except (TypeError, ValueError):
            return False
        return any(real == r or real.startswith(r + os.sep) for r in roots)

    def refuse(what):
        raise PermissionError(f"the grader does not let a notebook {what}")

    def hook(event, args):
        if state["busy"]:
            return
        state["busy"] = True
        try:
            if event == "open":
                path, mode, flags = args
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    mode is None and isinstance(flags, int) and flags & write_flags
                )
                if writing and not inside(path):
                    refuse(f"write to {path!r} (outside its own folder)")
            elif event in ("os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.mkdir"):
                if not inside(args[0]):
                    refuse(f"change {args[0]!r} (outside its own folder)")
            elif event in ("os.rename", "os.link", "os.symlink"):
                if not (inside(args[0]) and inside(args[1])):
                    refuse(f"move or link {args[0]!r} (outside its own folder)")
            elif event == "shutil.rmtree":
                if not inside(args[0]):
                    refuse(f"delete {args[0]!r} (outside its own folder)")
            elif event in ("os.listdir", "os.scandir"):
                if args and args[0] is not None and not isinstance(args[0], int):
                    real = os.path.realpath(os.fsdecode(os.fspath(args[0])))
                    if real in hidden:
                        refuse("list the grader's folder")
            elif event in ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.forkpty"):
                refuse("run other programs")
            elif event == "subprocess.Popen" and _is_guarded_worker(args, guard):
                pass  # the course's grading worker, which installs this guard first (see WORKER_ENTRY)
            elif event == "subprocess.Popen":
                exe = os.path.basename(os.fsdecode(args[0] if args[0] else (args[1][0] if not isinstance(args[1], (str, bytes)) else str(args[1]).split()[0])))
                if exe not in allowed_programs:
                    refuse(f"run the program {exe!r}")
            elif event in ("os.kill", "os.killpg"):
                pid = args[0]
                if pid not in (me, 0) and not _is_child(pid, me):
                    refuse("signal other processes")
            elif event == "ctypes.dlsym":
                name = args[1] if len(args) > 1 else None
                if isinstance(name, str) and name in _BLOCKED_SYMBOLS:
                    refuse(f"call the C function {name!r}")
        finally:
            state["busy"] = False

    sys.addaudithook(hook)


_BLOCKED_SYMBOLS = frozenset(
    "unlink unlinkat remove rmdir rename renameat renameat2 system execv execve execvp execvpe execl execlp "
    "popen posix_spawn posix_spawnp open open64 openat openat64 creat creat64 truncate truncate64 ftruncate "
    "chmod fchmod fchmodat chown lchown fchown kill killpg syscall link linkat symlink symlinkat mkdir "
    "fopen fopen64 freopen freopen64 mkdirat mknod mknodat tkill tgkill".split()
)


def _is_guarded_worker(popen_args, guard):
    """Whether a ``subprocess.Popen`` (audit arguments: executable, args, cwd, env) starts the course's worker, guarded."""
    argv, env = popen_args[1], popen_args[3]
    if not isinstance(argv, (list, tuple)) or len(argv) < 3:
        return False
    if [os.fsdecode(a) if isinstance(a, bytes) else a for a in argv[:3]] != [sys.executable, "-c", WORKER_ENTRY]:
        return False
    return (os.environ if env is None else env).get(GUARD_VAR) == guard


def _is_child(pid, me):
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == me
    except (OSError, ValueError, IndexError):
        return False
