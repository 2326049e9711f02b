"""Shipping notebook functions and Triton kernels to another Python process, by value.

A function defined in a notebook cell cannot be imported by name in another
process, and a ``@triton.jit`` kernel there has no source file for Triton to
compile from. :func:`dumps` pickles such objects with `cloudpickle`_: notebook
functions (and modules that another process could not import) travel by value,
each ``@triton.jit`` kernel as its source, rebuilt on arrival under its own file
name. What another process can import by name (:func:`by_reference`) travels
as a reference. Load the bytes with ``cloudpickle.loads``.

Used by the grading worker (:mod:`course_utils.grading.worker`) and by the ring
attention launcher (:mod:`course_utils.distributed`).

.. _cloudpickle: https://github.com/cloudpipe/cloudpickle
"""

from __future__ import annotations

import io
import itertools
import linecache
import os
import sys
import types

__all__ = ["dumps", "by_reference", "kernel_classes"]




def _import_attr(module: str, qualname: str):
    import importlib

    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _found_on_path(module_name: str) -> bool:
    """Whether a fresh Python with this ``sys.path`` would import ``module_name`` from the same file.

    Not so for a notebook (``__main__``), nor for a module loaded from a file
    outside ``sys.path`` (``importlib.util.spec_from_file_location``).
    """
    if module_name in (None, "__main__", "__mp_main__"):
        return False
    top_name = module_name.split(".")[0]
    top = sys.modules.get(top_name)
    file = getattr(top, "__file__", None)
    if top is None:
        return False
    if file is None:  # built-in, frozen or namespace package
        return True
    # Ask the import system's finders (sys.path, and e.g. an editable install's finder),
    # as a fresh process would, whether they find this very file.
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(top_name, None)
        except Exception:
            continue
        if spec is not None and spec.origin and os.path.abspath(spec.origin) == os.path.abspath(file):
            return True
    return False


def _modules_only_here():
    """Loaded modules that another process could not import by name: they travel by value."""
    return [m for name, m in list(sys.modules.items())
            if m is not None and "." not in name and not name.startswith("__") and getattr(m, "__name__", None) == name
            and getattr(m, "__file__", None) and not _found_on_path(name)]


def by_reference(obj):
    """``(module, qualname)`` when ``obj`` can be imported by name in another process."""
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not _found_on_path(module) or not name or "<locals>" in name:
        return None
    try:
        return (module, name) if _import_attr(module, name) is obj else None
    except Exception:
        return None


def _course_function_of_a_replaced_copy(fn):
    """``(module, qualname)`` of a ``course_utils`` function whose module has since been imported afresh.

    After the batch grader imports a pristine ``course_utils`` (:mod:`course_utils.grade_harness`), the
    notebook's functions still hold the functions of the copy the notebook imported, under the same names.
    Sent by value, such a function would take that copy's globals along (with the grader's trampolines in
    them); sent by name, it is the pristine module's function in the other process, as in this one.
    """
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None)
    if not (module == "course_utils" or module.startswith("course_utils.")) or not name or "<locals>" in name:
        return None
    if not _found_on_path(module):
        return None
    try:
        current = _import_attr(module, name)
    except Exception:
        return None
    return (module, name) if isinstance(current, types.FunctionType) and current is not fn else None


def _import_wrapped(module: str, qualname: str):
    return _import_attr(module, qualname).__wrapped__


def _wrapped_reference(fn):
    """``(module, qualname)`` of a decorated function whose ``__wrapped__`` is ``fn``."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None)
    if not _found_on_path(module) or not name or "<locals>" in name:
        return None
    try:
        return (module, name) if getattr(_import_attr(module, name), "__wrapped__", None) is fn else None
    except Exception:
        return None


def _lru_cached(fn, maxsize, typed):
    """The worker's side of a ``functools.lru_cache`` wrapper sent by value: ``fn`` wrapped again (cache empty)."""
    import functools

    return functools.lru_cache(maxsize=maxsize, typed=typed)(fn)


def _reduce_lru_cached(wrapper):
    """A ``functools.lru_cache`` (or ``functools.cache``) wrapper that cannot travel by name.

    pickle sends such a wrapper by name only (its ``__reduce__`` is its qualified name), and refuses it
    when the name now leads to another object: after the batch grader (:mod:`course_utils.grade_harness`)
    imports a fresh ``course_utils``, a notebook function still holds the ``_sm_count_of`` of the copy it
    imported (``PicklingError: ... it's not the same object as course_utils.kernels.decode._sm_count_of``).
    Such a wrapper travels as its wrapped function (by reference or by value, as cloudpickle decides) and
    is wrapped again on arrival, with an empty cache.
    """
    if by_reference(wrapper) is not None:
        return NotImplemented
    params = wrapper.cache_parameters()
    return _lru_cached, (wrapper.__wrapped__, params["maxsize"], params["typed"])


_copies = itertools.count()


def _rebuild_kernel(fn, lines, start, options, filename=None):
    """The worker's side of a pickled ``@triton.jit`` kernel.

    Triton reads a kernel's source with :mod:`inspect`, from the file its code
    object names. cloudpickle renames every code object it sends by value
    ``<dynamic-code>``, so the kernels of different cells and modules would
    share one file name and overwrite each other's lines; and a kernel defined
    in a notebook cell has no file on disk. So the kernel gets back its own
    file name (a copy's name where the file on disk differs) and its source is
    registered in :mod:`linecache` under it, at its line, as Jupyter does.
    """
    filename = filename or fn.__code__.co_filename
    end = start - 1 + len(lines)
    if os.path.exists(filename):
        on_disk = linecache.getlines(filename)
        if on_disk[start - 1 : end] == list(lines):
            fn.__code__ = fn.__code__.replace(co_filename=filename)
            return _jit(fn, options)
        filename = f"<{filename}, as sent to the grading worker #{next(_copies)}>"
    cached = linecache.cache.get(filename)
    have = list(cached[2]) if cached else []
    have.extend("\n" for _ in range(end + 1 - len(have)))  # and a blank line after the kernel
    have[start - 1 : end] = lines
    linecache.cache[filename] = (sum(map(len, have)), None, have, filename)
    fn.__code__ = fn.__code__.replace(co_filename=filename)
    return _jit(fn, options)


def _jit(fn, options):
    import triton

    options = dict(options)
    if options.pop("gluon", False):  # a @gluon.jit function (lesson 11) stays one
        from triton.experimental import gluon

        return gluon.jit(fn, **options)
    return triton.jit(fn, **options)


def _reduce_kernel(kernel):
    import inspect

    ref = by_reference(kernel)
    if ref is not None:
        return _import_attr, ref
    fn = kernel.fn
    lines, start = inspect.getsourcelines(fn)
    options = {}
    for key in ("do_not_specialize", "noinline", "debug"):
        value = getattr(kernel, key, None)
        if value:
            options[key] = list(value) if key == "do_not_specialize" else value
    if type(kernel).__name__ == "GluonJITFunction":
        options["gluon"] = True
    # do_not_specialize holds indices once parsed; triton.jit accepts indices.
    return _rebuild_kernel, (fn, lines, start, options, fn.__code__.co_filename)


def kernel_classes() -> tuple:
    """Triton's kernel classes in this process: ``JITFunction``, and ``InterpretedFunction`` where it exists."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:  # pragma: no cover
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return tuple(classes)


def dumps(obj, *, course_by_name: bool = False) -> bytes:
    """Pickle ``obj`` for the worker: notebook functions by value, kernels by source.

    ``course_by_name``: a ``course_utils`` function of a copy of the package that
    has since been imported afresh travels by name (the pristine module's function
    in the other process) instead of by value with that copy's globals; the ring's
    rank processes use it (:func:`course_utils.distributed.portable`).
    Raises when something in it cannot travel (an open file, a generator, a
    lock...): the caller then runs the check in its own process instead.
    """
    import cloudpickle

    import functools

    kernels = kernel_classes()
    lru_wrapper = getattr(functools, "_lru_cache_wrapper", ())

    class _Pickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj):
            if kernels and isinstance(obj, kernels):
                return _reduce_kernel(obj)
            if lru_wrapper and isinstance(obj, lru_wrapper):
                reduced = _reduce_lru_cached(obj)
                if reduced is not NotImplemented:
                    return reduced
            if isinstance(obj, types.FunctionType):
                ref = _wrapped_reference(obj)
                if ref is not None:  # a check under its decorator: import it there
                    return _import_wrapped, ref
                ref = _course_function_of_a_replaced_copy(obj) if course_by_name else None
                if ref is not None:  # the course's function, from the copy the notebook imported
                    return _import_attr, ref
            return super().reducer_override(obj)

    local = _modules_only_here()
    for module in local:
        cloudpickle.register_pickle_by_value(module)
    try:
        buf = io.BytesIO()
        _Pickler(buf, protocol=5).dump(obj)
        return buf.getvalue()
    finally:
        for module in local:
            cloudpickle.unregister_pickle_by_value(module)
