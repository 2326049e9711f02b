"""The batch grader's checks, run after a hand-in's notebook has ended: a verdict the learner's code cannot touch.

:mod:`course_utils.grade` runs a handed-in notebook in a kernel that only
collects the learner's answers: each official grader cell copies the objects
it names (``softmax`` in ``check_softmax(softmax)``) out by value
(:mod:`course_utils.transport`), and the last cell writes them to a file. The
kernel is then shut down, and this module runs, in the same operating-system
sandbox (:mod:`course_utils.os_sandbox`), as two fresh processes:

- **the checks process** (``python -m course_utils.grade_checks checks CFG``)
  imports the course's own ``course_utils`` and never loads the learner's code.
  It cannot be read or written by another process of the sandbox (it makes itself
  non-dumpable, ``PR_SET_DUMPABLE``). For every exercise whose
  :attr:`~course_utils.grading.exercises.Exercise.verdict_outside` holds, it runs
  the official check here: the learner's function is a stand-in (:class:`Answer`)
  that sends the check's inputs to the learner's process and gets back only data
  (:mod:`course_utils.wire`: the result, the arguments as the function left them,
  or its exception) — so the comparisons, the diagnoses and the status are all
  decided in a process the learner's code never ran in. The course functions
  the check refuses to the learner's code are refused in the learner's process
  for the length of each call. The results go to this process's standard output,
  which no other process of the sandbox can write to.
- **the learner's process** (``python -m course_utils.grade_checks learner CFG FD``)
  starts with the batch grader's write guard (:mod:`course_utils.guard`), loads the
  learner's answers, answers the checks process's calls, and then runs the checks of
  the exercises that must watch the learner's code as it runs
  (:data:`~course_utils.grading.exercises.VERDICT_IN_LEARNER_PROCESS`: their
  proof of work sees the Triton launches and torch operators of the process
  that runs them) with :mod:`course_utils.grade_harness`, as the notebook's kernel
  did before. Those verdicts are the residual: code written to find the harness's
  state in that process could still change them.

Neither process sees the notebook's kernel: what its cells left behind (IPython
hooks, input transformers, threads, replaced functions) is gone before any check
starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time

import numpy as np

__all__ = ["main", "Answer", "RECORD_MARK"]

RECORD_MARK = "COURSE-GRADE-RECORD "
STATUSES = frozenset({"passed", "failed", "error", "timeout", "crashed", "not_attempted"})  # a gradebook status  # the checks process's record, one JSON line per update on its stdout
_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grade_harness.py")
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
MSG_DIED = "{check}: the kernel died while this check ran your code (a segfault, a GPU fault or os._exit)"


def _not_dumpable() -> None:
    """Make this process unreadable to its siblings: no ptrace, no /proc/<pid>/mem (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
        except (OSError, AttributeError):
            pass


# -- the checks process ---------------------------------------------------------------------------------------------
class _Signature:
    """Text that prints as itself (a default value or an annotation of the learner's signature)."""

    def __init__(self, text):
        self.text = str(text)

    def __repr__(self):
        return self.text


def _signature(desc):
    import inspect

    if desc is None:
        return None
    params, returns = desc
    try:
        return inspect.Signature(
            [inspect.Parameter(str(name), inspect._ParameterKind(int(kind)),
                               default=inspect.Parameter.empty if default is None else _Signature(default),
                               annotation=inspect.Parameter.empty if annotation is None else _Signature(annotation))
             for name, kind, default, annotation in params],
            return_annotation=inspect.Signature.empty if returns is None else _Signature(returns))
    except (TypeError, ValueError):
        return None


class _CannotCross(Exception):
    """An argument of a check's call that cannot be sent to the learner's process: grade this one there."""


class Answer:
    """The learner's function as the checks process sees it: calls go to the learner's process, data comes back."""

    def __init__(self, learner, index, where, name, signature):
        self._learner, self._index, self._where = learner, index, where
        self.__name__ = self.__qualname__ = str(name)
        self.__signature__ = _signature(signature)

    def __call__(self, *args, **kwargs):
        __tracebackhide__ = True
        return self._learner.call(self._index, self._where, args, kwargs)

    def __repr__(self):
        return f"<your function {self.__name__}>"


def _remote_watch(args, kwargs):
    """Arguments that are the check's watched arrays (a tile log, :func:`.inputs.tile_log`, or lesson 02's
    whole-row log) as plain copies, and what the learner's process needs to watch them the same way:
    ``(args, kwargs, watch, log)``.

    ``watch`` is ``(spec, {position or name: tags})`` (None when no argument is watched); the learner's process
    keeps the same log around the call and returns what it found (``log["untiled"]``, or the arrays reduced
    along whole rows), which goes into ``log``.
    """
    from course_utils.grading import inputs

    found, logs = {}, []
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        if isinstance(value, inputs.Watched) and value._log is not None:
            found[key] = sorted(value._tags)
            if all(value._log is not other for other in logs):
                logs.append(value._log)
    if not found:
        return args, kwargs, None, None
    if len(logs) != 1 or not logs[0].get("spec"):
        return args, kwargs, None, None  # another kind of watching: _instrumented() sends it to the learner's process
    args = tuple(np.array(inputs.plain(a), copy=True) if i in found else a for i, a in enumerate(args))
    kwargs = {k: np.array(inputs.plain(v), copy=True) if k in found else v for k, v in kwargs.items()}
    return args, kwargs, (logs[0]["spec"], found), logs[0]


def _instrumented(value, depth=0) -> bool:
    """Whether ``value`` holds an object of the course's own (an array subclass that logs what is done with it):
    such a check must run where the learner's code runs, or what it watches would go unseen."""
    if depth > 8:
        return False
    if isinstance(value, (list, tuple)):
        return any(_instrumented(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_instrumented(v, depth + 1) for v in value.values())
    return (type(value).__module__ or "").startswith("course_utils.")


def _rebuilt_exception(reply, core):
    """The learner's exception, rebuilt from data: same type name, same text, same notes."""
    import builtins

    _, kind, type_name, module, message, notes, code = reply
    if kind == "forbidden":
        return core.Forbidden(str(message))
    if kind == "exit":
        return SystemExit(code)
    base = getattr(builtins, str(type_name), None) if module == "builtins" else None
    if not (isinstance(base, type) and issubclass(base, BaseException)) or base in (KeyboardInterrupt, SystemExit,
                                                                                     GeneratorExit):
        base = Exception
    cls = type(str(type_name), (base,), {"__module__": str(module), "__str__": lambda self, m=str(message): m})
    exc = cls(str(message))
    for note in notes or ():
        exc.add_note(str(note))
    return exc


def _copy_back(given, state):
    """Write what the learner's function left in an argument (an in-place edit) into the check's own argument."""
    try:
        if hasattr(given, "copy_") and hasattr(state, "shape") and tuple(given.shape) == tuple(state.shape):
            with __import__("torch").no_grad():
                given.copy_(state.to(given.device, given.dtype))
        elif hasattr(given, "flags") and given.flags.writeable and getattr(state, "shape", None) == given.shape:
            given[...] = state
    except Exception:  # noqa: BLE001 - a shape or dtype the check did not pass: nothing to copy
        pass


class Learner:
    """The learner's process, seen from the checks process: started on first use, restarted after a hang or crash."""

    def __init__(self, cfg_path, cfg):
        self.cfg_path, self.cfg = cfg_path, cfg
        self.proc = self.conn = None
        self.answers = None
        self.now, self.allowed_now = (), ()
        self.check = "the check"
        self.log = open(cfg["learner_log"], "ab") if cfg.get("learner_log") else subprocess.DEVNULL

    def start(self):
        from multiprocessing.connection import Connection

        here, there = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "course_utils.grade_checks", "learner", self.cfg_path,
                                      str(there.fileno())], pass_fds=(there.fileno(),), stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log, cwd=self.cfg.get("cwd") or None)
        there.close()
        self.conn = Connection(here.detach())
        self.answers = self._ask(("hello",), timeout=self.cfg.get("start_timeout_s", 120))

    def stop(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def _ask(self, message, timeout=None):
        from course_utils import wire

        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        if timeout is not None and not self.conn.poll(timeout):
            raise TimeoutError("the learner's process did not answer")
        return wire.loads(self.conn.recv_bytes())

    def ready(self):
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()
        return self.answers

    def call(self, index, where, args, kwargs):
        __tracebackhide__ = True
        from course_utils.grading import core, proof

        self.ready()
        args, kwargs, watch, log = _remote_watch(args, kwargs)
        if _instrumented(args) or _instrumented(kwargs):
            raise _CannotCross("an argument that watches the learner's code")
        try:
            message = pickle.dumps(("call", index, where, args, kwargs, proof.active_traps(), self.now,
                                    self.allowed_now, watch), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001
            raise _CannotCross(f"{type(exc).__name__}: {exc}") from None
        try:
            self.conn.send_bytes(message)
            raw = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.stop()
            raise core.Crashed(MSG_DIED.format(check=self.check)) from None
        except BaseException:  # the check's time limit (SIGALRM) while the learner's code ran: it is still running
            self.stop()
            raise
        from course_utils import wire

        try:
            reply = wire.loads(raw)
        except Exception as exc:  # noqa: BLE001 - not data: refused
            self.stop()
            raise core.GradingError(f"{self.check}: what came back from your function could not be read as data "
                                    f"({type(exc).__name__}).") from None
        if reply[0] == "returned":
            _, value, states, seen = reply
            if log is not None:  # what the same log saw in the learner's process
                from course_utils.grading import inputs

                inputs.add_seen(log, seen)
            for key, state in states:
                given = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key)
                if given is not None:
                    _copy_back(given, state)
            return value
        raise _rebuilt_exception(reply, core)


def _emit(record):
    sys.stdout.write(RECORD_MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def _read_envelope(cfg):
    """What the notebook's last cell wrote: ``{"token", "answers", "hidden", "tampered"}`` (builtin data only)."""
    import io

    from course_utils import wire

    try:
        with open(cfg["answers_file"], "rb") as f:
            raw = f.read()
    except OSError:
        return None
    envelope = wire._BuiltinsOnly(io.BytesIO(raw)).load()
    return envelope if isinstance(envelope, dict) else None


def _arguments(learner, index, desc):
    """(args, kwargs) for the check, or None when one of them can only be used in the learner's process."""
    kind = desc[0]
    if kind != "ok":
        return None
    _, args, kwargs = desc

    def one(where, d):
        if d[0] == "call":
            return Answer(learner, index, where, d[1], d[2])
        if d[0] == "data":
            return d[1]
        raise _CannotCross(d[0])

    try:
        return tuple(one(i, d) for i, d in enumerate(args)), {k: one(k, d) for k, d in kwargs.items()}
    except _CannotCross:
        return None


def _checks_main(cfg_path):
    _not_dumpable()
    with open(cfg_path) as f:
        cfg = json.load(f)
    record = {"token": cfg["token_b"], "running": None, "results": [], "hidden": {}, "setup_error": None,
              "tampered": [], "verdicts": {}}
    try:
        envelope = _read_envelope(cfg)
    except Exception as exc:  # noqa: BLE001 - the notebook's file is not data
        envelope = None
        record["setup_error"] = f"the notebook's answers could not be read ({type(exc).__name__})"
    if envelope is None or envelope.get("token") != cfg["token_b"]:
        record["token"] = None  # the grading cell did not run
        _emit(record)
        return 0
    record["hidden"] = {str(k): str(v) for k, v in dict(envelope.get("hidden") or {}).items()}
    record["tampered"] = [str(t) for t in list(envelope.get("tampered") or ())][:200]
    try:
        import importlib

        sys.path.insert(0, cfg["root"])
        from course_utils import grade_harness, grading
        from course_utils.grading import core, exercises
        from course_utils.grading import outcome as outcomes
    except BaseException as exc:  # noqa: BLE001
        record["setup_error"] = f"{type(exc).__name__}: {exc}"
        _emit(record)
        return 0
    note = ""
    if record["tampered"]:
        shown = ", ".join(record["tampered"][:12]) + (
            f" and {len(record['tampered']) - 12} more" if len(record["tampered"]) > 12 else "")
        note = (f"\n(Your notebook changed {shown}; the checks ran in a fresh process and did not use your "
                "notebook's copies.)")
    learner = Learner(cfg_path, cfg)
    skip = set(cfg.get("skip", ()))
    done = {}
    try:
        for call in cfg["calls"]:
            index = call["index"]
            exercise = exercises.by_name(call["check"])
            if index in skip or exercise is None or not exercise.verdict_outside:
                continue
            entry = _run_outside(learner, call, record, grading, core, outcomes, grade_harness, cfg)
            if entry is not None:
                entry["message"] += note
                entry["verdict"] = "grader"
                done[index] = entry
                record["results"] = sorted(done.values(), key=lambda e: e["index"])
                _emit(record)
        rest = [c for c in cfg["calls"] if c["index"] not in skip and c["index"] not in done]
        for entry in _run_in_learner(learner, rest, cfg, record, done):
            entry["verdict"] = "learner process"
            done[entry["index"]] = entry
            record["results"] = sorted(done.values(), key=lambda e: e["index"])
            _emit(record)
    finally:
        learner.stop()
    record["running"] = None
    record["results"] = sorted(done.values(), key=lambda e: e["index"])
    _emit(record)
    return 0


def _run_outside(learner, call, record, grading, core, outcomes, harness, cfg):
    """Run one check here, the learner's function in its own process; None: it must run there instead."""
    index = call["index"]
    entry = {"index": index, "check": call["check"], "status": None, "message": "", "seed": None, "seconds": 0.0}
    try:
        answers = learner.ready()
    except (TimeoutError, EOFError, OSError) as exc:
        entry["status"], entry["message"] = "crashed", (f"{call['check']}: the process that loads your answers "
                                                         f"did not start ({type(exc).__name__})")
        return entry
    desc = answers.get(index)
    if desc is None or desc[0] != "ok":
        entry["status"] = "error"
        entry["message"] = harness.missing_answer(call, desc[1] if desc else "its cell did not run")
        return entry
    got = _arguments(learner, index, desc)
    if got is None:
        return None
    args, kwargs = got
    check = getattr(grading, call["check"])
    kwargs = harness.seeded(check, kwargs, entry)
    harness.forget_borrowed(cfg)
    learner.check = call["check"]
    learner.now, learner.allowed_now = tuple(call.get("answer_keys", ())), tuple(call.get("allowed", ()))
    record["running"] = index
    start = time.perf_counter()
    try:
        outcome, exc = check(*args, **kwargs), None
    except _CannotCross:
        return None
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001
        outcome, exc = None, error
    record["running"] = None
    entry["seconds"] = round(time.perf_counter() - start, 3)
    harness.judge(entry, call, outcome, exc, harness.borrowed_name(cfg), core, outcomes)
    return entry


def _run_in_learner(learner, calls, cfg, record, done):
    """The checks that watch the learner's code run, in the learner's process (restarted after a crash)."""
    pending = [c["index"] for c in calls]
    while pending:
        learner.stop()
        try:
            learner.start()
            learner.conn.send_bytes(pickle.dumps(("rest", pending), protocol=pickle.HIGHEST_PROTOCOL))
        except (TimeoutError, EOFError, OSError) as exc:
            for index in pending:
                call = next(c for c in calls if c["index"] == index)
                yield {"index": index, "check": call["check"], "status": "crashed", "seed": None, "seconds": 0.0,
                       "message": f"{call['check']}: the process that loads your answers did not start "
                                  f"({type(exc).__name__})"}
            return
        deadline = cfg.get("deadline")
        timeout = None if deadline is None else max(1.0, deadline - time.time())
        hung = False
        try:
            learner.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
        learner.stop()
        try:
            with open(cfg["learner_result"]) as f:
                theirs = json.load(f)
            os.remove(cfg["learner_result"])
        except (OSError, ValueError):
            theirs = {}
        known = {c["index"]: c for c in calls}
        got = {}
        for entry in theirs.get("results", []) if isinstance(theirs, dict) else []:
            try:
                index = int(entry["index"])
                if index in known and index in pending and entry.get("status") in STATUSES:
                    got[index] = {"index": index, "check": known[index]["check"], "status": entry["status"],
                                  "message": str(entry.get("message", "")), "seed": entry.get("seed"),
                                  "seconds": float(entry.get("seconds") or 0.0)}
            except (KeyError, TypeError, ValueError):
                continue
        if isinstance(theirs, dict) and theirs.get("setup_error"):
            for index in pending:
                yield {"index": index, "check": known[index]["check"], "status": "error", "seed": None,
                       "seconds": 0.0, "message": "the grader could not import course_utils: " + str(theirs["setup_error"])}
            return
        yield from got.values()
        pending = [i for i in pending if i not in got]
        running = theirs.get("running") if isinstance(theirs, dict) else None
        if running in pending and hung:
            for index in pending:
                yield {"index": index, "check": known[index]["check"], "status": "timeout", "seed": None,
                       "seconds": 0.0, "message": f"{known[index]['check']}: the checks ran out of the notebook's "
                                                  "time limit" + (" while this one ran" if index == running else "")}
            return
        if running in pending:  # it died while this check ran: the others get a fresh process
            yield {"index": running, "check": known[running]["check"], "status": "crashed", "seed": None,
                   "seconds": 0.0, "message": MSG_DIED.format(check=known[running]["check"])}
            pending.remove(running)
        elif not (isinstance(theirs, dict) and theirs.get("poisoned") is not None):
            for index in pending:  # nothing came back for them and nothing says why
                yield {"index": index, "check": known[index]["check"], "status": "crashed", "seed": None,
                       "seconds": 0.0, "message": MSG_DIED.format(check=known[index]["check"])}
            return
        # else: a CUDA fault lost the context after one check; a fresh process for the others


# -- the learner's process ------------------------------------------------------------------------------------------
def _describe(obj):
    """How the checks process should see one of the learner's arguments."""
    import inspect

    try:
        from triton.runtime.jit import KernelInterface

        if isinstance(obj, KernelInterface):
            return ("kernel",)
    except ImportError:
        pass
    if callable(obj) and not isinstance(obj, type):
        try:
            sig = inspect.signature(obj)
            params = [(p.name, int(p.kind), None if p.default is p.empty else repr(p.default),
                       None if p.annotation is p.empty else inspect.formatannotation(p.annotation))
                      for p in sig.parameters.values()]
            signature = (params, None if sig.return_annotation is sig.empty
                         else inspect.formatannotation(sig.return_annotation))
        except (TypeError, ValueError):
            signature = None
        return ("call", str(getattr(obj, "__name__", None) or type(obj).__name__), signature)
    return ("data", obj)


def _states(args, kwargs, before):
    """The arrays and tensors among the arguments that the call changed: [(position or name, value)]."""
    changed = []
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        old = before.get(key)
        if old is None:
            continue
        try:
            if hasattr(value, "detach"):
                same = value.shape == old.shape and bool((value.detach() == old).all()) if value.numel() else True
            else:
                same = np.array_equal(value, old, equal_nan=True)
        except Exception:  # noqa: BLE001
            same = False
        if not same:
            changed.append((key, value))
    return changed


def _copies(args, kwargs):
    out = {}
    for key, value in list(enumerate(args)) + list(kwargs.items()):
        if hasattr(value, "detach") and hasattr(value, "clone"):
            out[key] = value.detach().clone()
        elif isinstance(value, np.ndarray):
            out[key] = np.array(value, copy=True)
    return out


def _watched(args, kwargs, found, log, inputs):
    """The arguments named in ``found`` as watched arrays of ``log``, tagged as the check tagged them."""
    def one(key, value):
        if key not in found:
            return value
        w = np.array(value, copy=True).view(inputs.Watched)
        w._log, w._tags = log, frozenset(found[key])
        return w

    return (tuple(one(i, a) for i, a in enumerate(args)), {k: one(k, v) for k, v in kwargs.items()})


def _reply_raised(exc, core):
    if isinstance(exc, core.Forbidden) or type(exc).__name__ == "Forbidden":
        return ("raised", "forbidden", type(exc).__name__, "", str(exc), [], None)
    if isinstance(exc, SystemExit):
        code = exc.code if exc.code is None or type(exc.code) in (int, str) else str(exc.code)
        return ("raised", "exit", "SystemExit", "builtins", "", [], code)
    if isinstance(exc, KeyboardInterrupt):
        return ("raised", "error", "RuntimeError", "builtins", "your code raised KeyboardInterrupt", [], None)
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001
        text = f"<{type(exc).__name__}>"
    notes = [str(n) for n in (getattr(exc, "__notes__", None) or [])]
    return ("raised", "error", type(exc).__name__, type(exc).__module__, text, notes, None)


def _learner_main(cfg_path, fd):
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    with open(cfg_path) as f:
        cfg = json.load(f)
    sys.path.insert(0, cfg["root"])
    ns = {"__name__": "__course_grader__", "__file__": _GUARD}
    for path, name in ((_GUARD, "<course-guard>"), (_HARNESS, "<course-grader>")):
        with open(path) as f:
            exec(compile(f.read(), name, "exec"), ns)
    ns["prologue"](cfg)  # the write guard, and the trusted modules as they are before any learner code
    import io

    import cloudpickle

    import course_utils  # noqa: F401 - the copy the learner's answers refer to, as the notebook imported it
    from course_utils import wire
    from course_utils.grading import core, inputs, proof

    with open(cfg["answers_file"], "rb") as f:
        envelope = wire._BuiltinsOnly(io.BytesIO(f.read())).load()
    box = ns["_box"](cfg["token_a"])
    described = {}
    for index, shipped in dict(envelope.get("answers") or {}).items():
        if shipped[0] == "ok":
            try:
                args, kwargs = cloudpickle.loads(shipped[1])
                box.calls[index] = ("ok", tuple(args), dict(kwargs))
                described[index] = ("ok", [_describe(a) for a in args], {k: _describe(v) for k, v in kwargs.items()})
            except BaseException as exc:  # noqa: BLE001 - a learner's object may fail to rebuild
                why = f"it could not be rebuilt in the grader's process ({type(exc).__name__}: {exc})"
                box.calls[index] = ("missing", why, None)
                described[index] = ("missing", why)
        else:
            box.calls[index] = ("missing", str(shipped[1]), None)
            described[index] = ("missing", str(shipped[1]))
    old = {n: m for n, m in list(sys.modules.items()) if n == "course_utils" or n.startswith("course_utils.")}
    trips = ns["_Trips"](old, set(cfg.get("allowed", ())), cfg["borrow_file"],
                         {key for call in cfg["calls"] for key in call.get("answer_keys", ())})

    def send(value):
        try:
            conn.send_bytes(wire.dumps(value))
        except Exception as exc:  # noqa: BLE001 - an answer nested too deep, say
            conn.send_bytes(wire.dumps(("raised", "error", "ValueError", "builtins",
                                        f"the grader could not send your function's result back ({exc})", [], None)))

    guarded = ("course_utils.references", "course_utils.kernels")
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 0
        if message[0] == "hello":
            send(described)
        elif message[0] == "call":
            _, index, where, args, kwargs, traps, now, allowed_now, watch = message
            fn = box.calls[index][1][where] if isinstance(where, int) else box.calls[index][2][where]
            log, watching = None, contextlib.nullcontext()
            if watch is not None:  # the check's log, kept here around the call
                spec, found = watch
                log = inputs.log_from_spec(spec)
                args, kwargs = _watched(args, kwargs, found, log, inputs)
                watching = inputs.watching(log)
            before = _copies(args, kwargs)
            trips.now, trips.allowed_now, trips.active = set(now), set(allowed_now), True
            try:
                with proof.trapped([t for t in traps if not t.startswith(guarded)]), watching:
                    value = fn(*args, **kwargs)
                reply = ("returned", value, _states(args, kwargs, before), None if log is None else inputs.seen_in(log))
            except BaseException as exc:  # noqa: BLE001 - everything the learner's code raises goes back as data
                reply = _reply_raised(exc, core)
            finally:
                trips.active = False
            send(reply)
        elif message[0] == "rest":
            trips.undo()
            rest = set(message[1])
            ns["grade"](dict(cfg, result_file=cfg["learner_result"],
                             skip=sorted({c["index"] for c in cfg["calls"]} - rest)))
            return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["checks"]:
        return _checks_main(argv[1])
    if argv[:1] == ["learner"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return _learner_main(argv[1], int(argv[2]))
    print("usage: python -m course_utils.grade_checks checks CFG | learner CFG FD", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
