"""The code the batch grader runs inside a learner's notebook kernel, and inside the learner's process (stdlib only).

:mod:`course_utils.grade` does not import this module: it reads its text and
runs it inside the learner's kernel, in a private namespace, at three places:

- ``prologue(cfg)``, the first cell, before any learner code: a write guard
  (an audit hook, which Python cannot remove once added) that refuses to
  write, delete or rename files outside the notebook's temporary folder, to
  run other programs, or to signal other processes; and a snapshot of the
  functions of the modules the checks trust (:data:`TRUSTED_MODULES`);
- ``collect(user_ns, cfg)``, in place of each official grader cell: takes
  the learner's objects named by the grader cell (``softmax`` in
  ``check_softmax(softmax)``), copies them by value (:mod:`course_utils.transport`)
  as they are at that cell, and runs the cell's hidden tests;
- ``export(cfg)``, the last cell: writes those copies to a file for
  :mod:`course_utils.grade_checks`. No check runs in the kernel, and the kernel is
  shut down before any does.

:mod:`course_utils.grade_checks` runs the same text in the learner's process (a fresh
process of the sandbox that loads the copies), where ``grade(cfg)`` runs the checks
that must watch the learner's code as it runs
(:data:`course_utils.grading.exercises.VERDICT_IN_LEARNER_PROCESS`): it puts back
whatever the learner's code replaced in the trusted modules (and removes the IPython
hooks and trace functions it added), drops every ``course_utils`` module from
``sys.modules``, imports a pristine copy from the course's own files, and calls the
official checks on the collected objects; around each call of the learner's function it puts back what
that call replaced in the trusted modules and refuses a thread it left running
(:func:`course_utils.guard.learner_call_guard`, through ``core.LEARNER_CALL_GUARDS``). While a check runs, a call from the
learner's code into the course's references or kernels (the copies the learner's
answers refer to) raises instead of answering (:class:`_Trips`); :func:`judge` turns
how each check ended into the gradebook's status and message (the checks process
uses it too).

Those verdicts are computed in the process that runs the learner's code: it stops the
replacements a learner makes in plain Python, not code written to find the harness's
own state there (it is reachable, as everything in a process is). The other exercises'
verdicts are computed where the learner's code never runs (:mod:`course_utils.grade_checks`).
"""

# NOTE: no module-level imports from course_utils here, on purpose.
import json
import os
import sys

BORROWED = "[course-grader: borrowed answer]"
if "install" not in globals():  # imported as a module; injected, course_utils.guard's text runs first
    from .guard import (TORCH_MODULES, TRUSTED_MODULES, install, learner_call_guard,  # noqa: F401
                        restore_trusted, snapshot_trusted)


def _box(token):
    import types

    name = "_course_grade_" + token
    box = sys.modules.get(name)
    if box is None:
        box = types.ModuleType(name)
        box.calls, box.hidden, box.shipped = {}, {}, {}
        sys.modules[name] = box
    return box


# -- the modules the checks trust: course_utils.guard keeps them (snapshot_trusted / restore_trusted) --------
_snapshot, _restore = snapshot_trusted, restore_trusted


# -- the first cell -----------------------------------------------------------
def prologue(cfg):
    """Install the write guard and the resource limits (before learner code); see :mod:`course_utils.guard`.

    Also keep the trusted modules' functions as they are now (:func:`_snapshot`), for the last cell.
    """
    box = _box(cfg["token_a"])
    install(cfg)
    box.snapshot = _snapshot(TRUSTED_MODULES + (TORCH_MODULES if cfg.get("uses_torch") else ()))


# -- in place of each grader cell ---------------------------------------------
def collect(user_ns, cfg):
    """Evaluate the grader cell's arguments in the learner's namespace; run its hidden tests."""
    box = _box(cfg["token_a"])
    for call in cfg["calls"]:
        try:
            args = tuple(eval(expr, user_ns) for expr in call["args"])
            kwargs = {k: eval(expr, user_ns) for k, expr in call["kwargs"].items()}
            box.calls[call["index"]] = ("ok", args, kwargs)
        except BaseException as exc:  # noqa: BLE001 - a learner's name may be missing or raise
            box.calls[call["index"]] = ("missing", f"{type(exc).__name__}: {exc}", None)
            box.shipped[call["index"]] = ("missing", f"{type(exc).__name__}: {exc}")
            continue
        # By value, as they are now: the checks run later in a fresh process (course_utils.grade_checks).
        try:
            from course_utils import transport

            box.shipped[call["index"]] = ("ok", transport.dumps((args, kwargs)))
        except BaseException as exc:  # noqa: BLE001 - an open file, a lock, a generator...
            why = f"{type(exc).__name__}: {exc}"[:400]
            box.shipped[call["index"]] = ("missing", (
                f"the grader runs the checks in a fresh process and could not copy your answer there ({why}); "
                "a graded answer must not hold open files, locks, threads or generators"))
    if cfg.get("hidden"):
        try:
            exec(compile(cfg["hidden"], f"<hidden tests of {cfg['cell']}>", "exec"), user_ns)
        except BaseException as exc:  # noqa: BLE001
            box.hidden[cfg["cell"]] = f"{type(exc).__name__}: {exc}"


# -- the last cell --------------------------------------------------------------
def export(cfg):
    """Write the answers the grader cells collected (by value) for :mod:`course_utils.grade_checks`.

    Also what the notebook replaced in the modules the checks trust (only to tell the learner: the checks
    run in another process) and the hidden tests' failures. Builtin data only: the checks process reads it
    without unpickling anything else.
    """
    import pickle

    box = _box(cfg["token_a"])
    tampered = _restore(box.snapshot) if getattr(box, "snapshot", None) else []
    shipped = {int(k): (str(v[0]), v[1] if isinstance(v[1], bytes) else str(v[1])) for k, v in box.shipped.items()}
    envelope = {"token": cfg["token_b"], "answers": shipped, "hidden": {str(k): str(v) for k, v in box.hidden.items()},
                "tampered": [str(t) for t in tampered]}
    tmp = cfg["answers_file"] + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(envelope, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, cfg["answers_file"])


def _fresh_course_utils(root):
    """Import a pristine course_utils from ``root``; return the old modules."""
    import importlib
    import importlib.machinery
    import importlib.util

    old = {n: m for n, m in list(sys.modules.items()) if n == "course_utils" or n.startswith("course_utils.")}
    for name in old:
        del sys.modules[name]
    stock = (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter, importlib.machinery.PathFinder)
    sys.meta_path[:] = [f for f in sys.meta_path if f in stock or type(f).__module__.startswith("_frozen_importlib")]
    for f in stock:
        if f not in sys.meta_path:
            sys.meta_path.append(f)
    sys.path_hooks[:] = [h for h in sys.path_hooks if getattr(h, "__module__", "").startswith(("zipimport", "_frozen_importlib"))]
    sys.path_importer_cache.clear()
    package = os.path.join(root, "course_utils")
    spec = importlib.util.spec_from_file_location("course_utils", os.path.join(package, "__init__.py"),
                                                  submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules["course_utils"] = module
    spec.loader.exec_module(module)
    if os.path.dirname(os.path.realpath(module.__file__)) != os.path.realpath(package):
        raise RuntimeError("could not import the course's own course_utils")
    return old


class _Trips:
    """Make the learner's copies of the course's references and kernels refuse to answer.

    Each function of the old ``course_utils.references`` / ``course_utils.kernels*``
    modules gets its code replaced by a trampoline: while a check runs, a call
    whose caller is not itself course code (one of those old modules) raises a
    ``PermissionError`` marked ``BORROWED`` and records the name in a file;
    otherwise it calls the original. Triton kernels get the same guard on launch.
    ``allowed`` names the helpers a lesson gives learners to call (the names the
    solution notebook imports from ``course_utils.kernels``).
    """

    def __init__(self, old_modules, allowed, record_path, answer_keys=()):
        import types

        self.active = False
        # A helper the lesson allows that is also some exercise's answer key is guarded too, but trips
        # only while that exercise's check runs (``now``: the running check's answer keys).
        self.conditional = {key for key in answer_keys if key.rsplit(".", 1)[-1] in allowed}
        self.now = set()
        self.allowed_now = set()  # what the running check's exercise lets its answer call (Exercise.allowed)
        self.record_path = record_path
        guarded = {n: m for n, m in old_modules.items()
                   if n == "course_utils.references" or n == "course_utils.kernels" or n.startswith("course_utils.kernels.")}
        self.course_globals = {id(vars(m)) for m in old_modules.values()}
        trips = self
        self.restore = []

        def make_trampoline(original, qualname, nfree):
            copy = types.FunctionType(original.__code__, original.__globals__, original.__name__,
                                      original.__defaults__, original.__closure__)
            copy.__kwdefaults__ = original.__kwdefaults__
            free = [f"_f{i}" for i in range(nfree)]
            src = "def _outer():\n"
            for name in free:
                src += f"    {name} = None\n"
            src += "    def _tramp(*args, **kwargs):\n"
            if free:
                src += "        (" + ", ".join(free) + ",)\n"
            src += "        return _GUARD(_COPY, _NAME, args, kwargs)\n    return _tramp\n"
            # The trampoline runs with the original's globals: keep its helpers there under private names.
            ns = {}
            exec(src, ns)
            code = ns["_outer"]().__code__
            tag = f"__course_grade_{len(trips.restore)}"
            original.__globals__[tag + "_copy"] = copy
            code = code.replace(co_names=tuple(
                {"_GUARD": "__course_grade_guard", "_COPY": tag + "_copy", "_NAME": tag + "_name"}.get(n, n) for n in code.co_names))
            original.__globals__[tag + "_name"] = qualname
            original.__globals__["__course_grade_guard"] = trips.guard
            return code

        def guard_function(fn, qualname):
            if getattr(fn, "__code__", None) is None or fn.__code__.co_flags & 0xA0:  # generators/coroutines: leave
                return
            nfree = len(fn.__code__.co_freevars)
            original_code = fn.__code__
            fn.__code__ = make_trampoline(fn, qualname, nfree)
            self.restore.append((fn, "__code__", original_code))

        for modname, module in guarded.items():
            for attr, obj in list(vars(module).items()):
                qualname = f"{modname}.{attr}"
                allowed_here = attr in allowed
                if isinstance(obj, types.FunctionType) and obj.__module__ == modname:
                    if not allowed_here or qualname in self.conditional:
                        guard_function(obj, qualname)
                elif isinstance(obj, type) and obj.__module__ == modname and not allowed_here and any(
                        base.__module__.startswith("torch.autograd") for base in obj.__mro__[1:]):
                    for name, member in vars(obj).items():
                        func = getattr(member, "__func__", member)
                        if isinstance(func, types.FunctionType):
                            guard_function(func, f"{qualname}.{name}")
                elif hasattr(obj, "run") and hasattr(obj, "__getitem__") and type(obj).__module__.startswith("triton") and not allowed_here:
                    self._guard_launch(obj, qualname)

    def _guard_launch(self, kernel, qualname):
        trips = self

        def run(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and "triton" in frame.f_code.co_filename.split(os.sep):
                frame = frame.f_back
            if trips.active and qualname not in trips.allowed_now and (
                    frame is None or id(frame.f_globals) not in trips.course_globals):
                trips.hit(qualname)
            # Through the class, so that a check's count_launches() (which patches the class) sees the launch.
            return type(kernel).run(kernel, *args, **kwargs)

        kernel.run = run
        self.restore.append((kernel, "run", None))

    def undo(self):
        """Give the guarded functions and kernels back their own code."""
        for obj, attr, value in reversed(self.restore):
            if value is None:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, value)
        self.restore = []

    def guard(self, copy, qualname, args, kwargs):
        if (qualname in self.conditional and qualname not in self.now) or qualname in self.allowed_now:
            return copy(*args, **kwargs)
        if self.active and id(sys._getframe(2).f_globals) not in self.course_globals:
            self.hit(qualname)
        return copy(*args, **kwargs)

    def hit(self, qualname):
        fd = os.open(self.record_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (qualname + "\n").encode())
        finally:
            os.close(fd)
        raise PermissionError(
            f"{BORROWED} your code called `{qualname}`, the course's own answer. "
            "Graded answers must be your own code: write it in the notebook."
        )


def missing_answer(call, why):
    """The message of a call whose answer the grader could not take from the notebook."""
    return f"{call['check']}: the grader cell could not find your answer (`{', '.join(call['args'])}`): {why}"


def seeded(check, kwargs, entry):
    """``kwargs`` with a fresh ``seed`` (also written into ``entry``) if ``check`` takes one."""
    import inspect
    import secrets

    kwargs = dict(kwargs)
    try:
        accepts_seed = "seed" in inspect.signature(check).parameters
    except (TypeError, ValueError):
        accepts_seed = False
    if accepts_seed:
        entry["seed"] = kwargs["seed"] = secrets.randbelow(2**31)
    return kwargs


def forget_borrowed(cfg):
    """Empty the record of refused course calls before a check runs."""
    try:
        os.remove(cfg["borrow_file"])
    except FileNotFoundError:
        pass


def borrowed_name(cfg):
    """The first course function the learner's code was refused while the last check ran ("" if none)."""
    if os.path.exists(cfg["borrow_file"]):
        with open(cfg["borrow_file"]) as f:
            return _first_line(f.read())
    return ""


def judge(entry, call, outcome, exc, borrowed, core, outcomes):
    """Fill ``entry``'s status and message from how the check ended (``outcome`` or ``exc``)."""
    if borrowed:
        entry["status"] = "failed"
        entry["message"] = (f"{call['check']}: your code called `{borrowed}`, the course's own answer; "
                            "graded answers must be your own code. " + (_first_line(exc) if exc else ""))
    elif exc is None:
        if isinstance(outcome, core.Passed):
            entry["status"], entry["message"] = "passed", repr(outcome)
        else:
            entry["status"] = "failed"
            entry["message"] = f"{call['check']} returned {type(outcome).__name__}, not a pass"
    else:
        text = str(exc)
        notes = getattr(exc, "__notes__", None) or []
        if isinstance(exc, core.GradingError):
            # the check's status ("failed", "timed_out", "crashed") in the gradebook's words
            entry["status"] = {"timed_out": "timeout"}.get(outcomes.status_of(exc), outcomes.status_of(exc))
            entry["message"] = text
        elif isinstance(exc, NotImplementedError) or (
            isinstance(exc, outcomes.KernelError) and "\nNotImplementedError" in text
        ):
            entry["status"] = "not_attempted"
            entry["message"] = f"{call['check']}: not attempted (your function still raises NotImplementedError)"
        elif BORROWED in text:
            entry["status"], entry["message"] = "failed", text.replace(BORROWED + " ", "")
        else:
            entry["status"] = "error"
            name = type(exc).__name__
            if isinstance(exc, SystemExit):
                text = f"your code called sys.exit({exc.code!r})"
            if isinstance(exc, outcomes.KernelError):  # the learner's traceback, from the check's own process
                lines = [ln for ln in text.splitlines() if ln.strip()]
                entry["message"] = f"{call['check']}: {lines[-1].strip()}\n{text}"
            else:
                entry["message"] = f"{name}: {text}"
            if notes:
                entry["message"] += "\n" + "\n".join(str(n) for n in notes)


def _first_line(text):
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def grade(cfg):
    """Run the official checks from a pristine course_utils; write the results file."""
    import time

    box = _box(cfg["token_a"])
    # Before anything else (json.dump writes the results): put back what the notebook replaced.
    tampered = _restore(box.snapshot) if getattr(box, "snapshot", None) else []
    result_path = cfg["result_file"]
    record = {"token": cfg["token_b"], "running": None, "results": [], "hidden": dict(box.hidden), "setup_error": None,
              "tampered": tampered}
    note = ""
    if tampered:
        shown = ", ".join(tampered[:12]) + (f" and {len(tampered) - 12} more" if len(tampered) > 12 else "")
        note = (f"\n(Your notebook changed {shown}; the checks rely on them, so the grader put the originals "
                "back before checking.)")

    def save():
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, result_path)

    save()
    try:
        old = _fresh_course_utils(cfg["root"])
        import importlib

        grading = importlib.import_module("course_utils.grading")
        core = importlib.import_module("course_utils.grading.core")
        # Each call of the learner's function gets the trusted modules as the check set them up, back.
        guarded = TRUSTED_MODULES + (TORCH_MODULES if cfg.get("uses_torch") else ())
        core.LEARNER_CALL_GUARDS.append(lambda: learner_call_guard(guarded))
        outcomes = importlib.import_module("course_utils.grading.outcome")
        trips = _Trips(old, set(cfg.get("allowed", ())), cfg["borrow_file"],
                       {key for call in cfg["calls"] for key in call.get("answer_keys", ())})
    except BaseException as exc:  # noqa: BLE001
        record["setup_error"] = f"{type(exc).__name__}: {exc}"
        save()
        return
    skip = set(cfg.get("skip", ()))
    for call in cfg["calls"]:
        index = call["index"]
        if index in skip:
            continue
        entry = {"index": index, "check": call["check"], "status": None, "message": "", "seed": None, "seconds": 0.0}
        got = box.calls.get(index)
        if got is None or got[0] != "ok":
            entry["status"] = "error"
            entry["message"] = missing_answer(call, got[1] if got else "its cell did not run")
            record["results"].append(entry)
            save()
            continue
        _, args, kwargs = got
        check = getattr(grading, call["check"], None)
        if check is None:
            entry["status"], entry["message"] = "error", f"the course has no check named {call['check']}"
            record["results"].append(entry)
            save()
            continue
        kwargs = seeded(check, kwargs, entry)
        record["running"] = index
        save()
        forget_borrowed(cfg)
        start = time.perf_counter()
        trips.now = set(call.get("answer_keys", ()))
        trips.allowed_now = set(call.get("allowed", ()))
        trips.active = True
        try:
            outcome = check(*args, **kwargs)
            exc = None
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # noqa: BLE001 - anything the learner's code raises
            outcome, exc = None, error
        finally:
            trips.active = False
        entry["seconds"] = round(time.perf_counter() - start, 3)
        judge(entry, call, outcome, exc, borrowed_name(cfg), core, outcomes)
        record["running"] = None
        entry["message"] += note
        record["results"].append(entry)
        if exc is not None and outcomes.is_cuda_fault(str(exc)):
            # The CUDA context is lost: every later check would fail too. The grader
            # runs the notebook again for the checks that did not get their turn.
            record["poisoned"] = index
            save()
            break
        save()
    trips.undo()
