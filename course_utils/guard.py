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
            elif event == "os.posix_spawn":  # subprocess.Popen spawns this way where it can (Triton's ptxas does)
                exe = os.path.basename(os.fsdecode(args[0]))
                if exe not in allowed_programs:
                    refuse(f"run the program {exe!r}")
            elif event in ("os.system", "os.exec", "os.spawn", "os.forkpty"):
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


# -- the modules the checks trust ------------------------------------------------
#: What the official checks compute their verdicts and write their results with. The prologue keeps a
#: reference to every function of these modules (and its code) before the learner's first cell; the last
#: cell puts back whatever the notebook replaced (``numpy.allclose = lambda *a: True``, a new
#: ``json.dump``, a function's ``__code__``) before any check runs, and every result says what it put back.
TRUSTED_MODULES = ("builtins", "json", "json.encoder", "math", "os", "numpy", "numpy.testing", "numpy.linalg",
                   "numpy.random")
TORCH_MODULES = ("torch", "torch.testing", "torch.nn.functional")  # added when the lesson imports torch
# Names the kernel itself rebinds while it runs cells (ipykernel's input() for each request): not the learner's.
_KERNEL_OWNED = {("builtins", "input"), ("builtins", "raw_input"), ("builtins", "getpass")}
_MISSING = object()


def _function_of(obj):
    """The Python function behind ``obj`` (itself, a method's, numpy's dispatcher's), or None."""
    import types

    for fn in (obj, getattr(obj, "__func__", None), getattr(obj, "_implementation", None)):
        if isinstance(fn, types.FunctionType):
            return fn
    return None


def snapshot_trusted(names):
    """References to the callables of ``names`` (modules) and their functions' code, as they are now."""
    import importlib
    import types

    modules, attrs, codes = {}, [], []
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed here
            continue
        modules[name] = module
        for attr, obj in list(vars(module).items()):
            if attr.startswith("__") or (name, attr) in _KERNEL_OWNED or not (
                    callable(obj) or isinstance(obj, types.ModuleType)):
                continue
            attrs.append((module, attr, obj))
            fn = _function_of(obj)
            if fn is not None:
                codes.append((fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__))
    shell = _shell()
    events = {e: list(cbs) for e, cbs in shell.events.callbacks.items()} if shell is not None else {}
    return {"modules": modules, "attrs": attrs, "codes": codes, "events": events,
            "trace": (sys.gettrace(), sys.getprofile())}


def _shell():
    try:
        return get_ipython()  # noqa: F821 - defined in an IPython kernel
    except NameError:
        return None


def _code_path(fn):
    """The real path of the file ``fn``'s code (a function, or a method's) comes from; None for a builtin."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return None if code is None else os.path.realpath(code.co_filename)


def _python_roots():
    return {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}


def _library_function(cb) -> bool:
    """Whether ``cb`` is a function or method of an installed library (matplotlib's figure flush)."""
    path = _code_path(cb)
    if path is None:
        return False
    roots = _python_roots()
    return any(path.startswith(r + os.sep) for r in roots) and "site-packages" in path.split(os.sep) or any(
        path.startswith(os.path.realpath(p) + os.sep) for p in sys.path if p.endswith("site-packages"))


def restore_trusted(snap):
    """Put back what was replaced since :func:`snapshot_trusted`; return the names put back."""
    changed = []
    for name, module in snap["modules"].items():
        if sys.modules.get(name) is not module:
            sys.modules[name] = module
            changed.append(f"sys.modules[{name!r}]")
    for module, attr, obj in snap["attrs"]:
        if vars(module).get(attr, _MISSING) is not obj:
            setattr(module, attr, obj)
            changed.append(f"{module.__name__}.{attr}")
    for fn, code, defaults, kwdefaults in snap["codes"]:
        if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults
            changed.append(f"{fn.__module__}.{fn.__qualname__} (its code)")
    shell = _shell()
    if shell is not None:
        for event, cbs in shell.events.callbacks.items():
            keep = snap["events"].get(event, [])
            extra = [cb for cb in cbs if cb not in keep and not _library_function(cb)]
            if extra:
                cbs[:] = [cb for cb in cbs if cb not in extra]
                changed.append(f"an IPython {event} hook")
    if (sys.gettrace(), sys.getprofile()) != snap["trace"]:
        sys.settrace(snap["trace"][0])
        sys.setprofile(snap["trace"][1])
        changed.append("sys.settrace / sys.setprofile")
    return sorted(set(changed))



def _learner_thread(thread) -> bool:
    """A thread running code that is neither Python's, an installed library's nor the course's: the learner's.

    A builtin as the target (``exec``, ``eval``) counts as the learner's too: it runs what it is given.
    """
    target = getattr(thread, "_target", None)
    path = _code_path(target if target is not None else getattr(type(thread), "run", None))
    if path is None:
        return True
    roots = _python_roots()
    roots.add(os.path.dirname(os.path.realpath(__file__)) if "__file__" in globals() else "")
    return not any(r and path.startswith(r + os.sep) for r in roots)


def learner_call_guard(names):
    """Before one call of the learner's function: keep the trusted modules ``names`` as the check set them up.

    Returns ``finish()``, to call when the learner's function has returned (or raised): it puts back whatever
    the call replaced in those modules (the check goes on with what it had) and returns a sentence when the
    call left a thread of its own running (which could change them again while the check decides), else None.
    """
    import threading

    snap = snapshot_trusted(names)
    threads = set(threading.enumerate())

    def finish():
        restore_trusted(snap)
        left = [t for t in threading.enumerate() if t not in threads and t.is_alive() and _learner_thread(t)]
        if left:
            return (f"your function left a thread running ({left[0].name}): a graded function must finish its "
                    "work before it returns.")
        return None

    return finish


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
