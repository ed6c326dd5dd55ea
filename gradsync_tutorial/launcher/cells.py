"""Functions from notebook cells: sent by value with their cell's lines, and named as IPython
names the cell, so that what a rank reports points into the reader's notebook.

A cell is no file on disk: its code's file name is a temporary path of the kernel's, which only
the kernel's ``linecache`` knows. Three things follow, each a function here:

* :func:`serialize`: ``fn`` and ``args`` by value (cloudpickle), keeping the cell's file name on
  the code (cloudpickle writes ``<dynamic-code>``), plus the cell's lines, which the worker puts
  in its own ``linecache``: a rank's traceback and warnings quote the cell's lines;
* :func:`with_cell_labels`, :func:`file_label`: ``File "/tmp/ipykernel_1/123.py"`` becomes
  ``Cell In[3]`` in a rank's traceback and in the hang report, as IPython writes it;
* :func:`shown_from_caller`: the error raised in the notebook shows the reader's own line, not
  the launcher's frames.

    >>> payload, sources = serialize(lambda rank, world_size: rank, ())
    >>> [lines[0].strip() for lines in sources.values()]  # no file holds a doctest: its lines
    ['payload, sources = serialize(lambda rank, world_size: rank, ())']
    >>> with_cell_labels('File "train.py", line 3, in train')   # no IPython: unchanged
    'File "train.py", line 3, in train'

Part of ``gst.launch`` (introduced in ``notebooks/00_launching_workers.ipynb``).
"""

from __future__ import annotations

import functools
import importlib
import io
import linecache
import os
import re
import sys
import types
from collections.abc import Sequence
from typing import Any


def serialize(fn, args: Sequence[Any]) -> tuple[bytes, dict[str, list[str]]]:
    """``fn`` and ``args`` by value, and the source lines of notebook cells they come from."""
    buffer = io.BytesIO()
    pickler = _pickler_class()(buffer)
    try:
        pickler.dump((fn, tuple(args)))
    except Exception as e:
        raise TypeError(f"could not send fn and args to the workers: {type(e).__name__}: {e}. "
                        f"{_unpicklable_part(fn, args)}") from e
    # A notebook cell is no file on disk: send its lines, so that a rank's tracebacks and
    # warnings quote them.
    sources = {name: linecache.getlines(name) for name in pickler.filenames
               if not os.path.exists(name) and linecache.getlines(name)}
    return buffer.getvalue(), sources


def _unpicklable_part(fn, args: Sequence[Any]) -> str:
    """Which part of ``(fn, args)`` cannot be sent, and what to do: an argument, or a global or
    closure variable that ``fn`` uses (then it was passed nothing wrong)."""
    def fails(obj) -> bool:
        try:
            _pickler_class()(io.BytesIO()).dump(obj)
        except Exception:  # noqa: BLE001 - any error: this part cannot be sent
            return True
        return False

    bad_args = [f"args[{i}] ({type(a).__name__})" for i, a in enumerate(args) if fails(a)]
    if bad_args:
        return (f"Every argument is copied to each rank, and {', '.join(bad_args)} cannot be: "
                "pass tensors, numbers and plain containers, and create objects such as open "
                "files, locks, data loaders or process groups inside fn.")
    used = _names_used(fn)
    bad = [f"`{name}` ({type(value).__name__})" for name, value in used.items() if fails(value)]
    what = (f"fn uses {', '.join(bad)}, a global or closure variable" if bad
            else "fn uses a global or closure variable that")
    return (f"{what} which cannot be copied to each rank: create it inside fn (or import the "
            "module it comes from there).")


def _names_used(fn) -> dict[str, Any]:
    """The globals and closure variables ``fn``'s code (and its nested code) refers to."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names |= set(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    found = {n: fn.__globals__[n] for n in sorted(names) if n in getattr(fn, "__globals__", {})}
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return found


def by_reference(obj):
    """How to pickle a module that a plain pickler copies by value, or None.

    torch puts module *subclasses* in ``sys.modules`` (``torch.backends.cudnn`` is a
    ``CudnnModule``); cloudpickle sends plain modules importable by name as a reference, but
    not these (``cannot pickle 'CudnnModule' object``). One importable by name is imported by
    name on the other side, as a plain module is.
    """
    if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
            and sys.modules.get(obj.__name__) is obj):
        return importlib.import_module, (obj.__name__,)
    return None


def dumps(obj) -> bytes:
    """``obj`` pickled as :func:`serialize` pickles ``fn`` (with :func:`by_reference`)."""
    buffer = io.BytesIO()
    _pickler_class()(buffer).dump(obj)
    return buffer.getvalue()


def _pickler_class():
    import cloudpickle

    reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]

    class KeepFileNames(cloudpickle.Pickler):
        """cloudpickle, except that code keeps its file name (not ``<dynamic-code>``), so a
        rank's tracebacks and warnings from a notebook cell's functions and classes point to
        the cell; and torch's module subclasses go by name (:func:`by_reference`)."""

        def __init__(self, file):
            super().__init__(file)
            self.filenames: set[str] = set()

        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):
                self.filenames.add(obj.co_filename)
                make, fields = reduce_code(obj)
                return make, tuple(obj.co_filename if isinstance(f, str) and
                                   f == "<dynamic-code>" else f for f in fields)
            reference = by_reference(obj)
            if reference is not None:
                return reference
            return super().reducer_override(obj)

    return KeepFileNames


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+), in ')


def with_cell_labels(tb: str) -> str:
    """A rank's traceback with each notebook cell named as IPython names it (``Cell In[3]``)."""
    def label(match):
        return f"{file_label(match.group(1))}, line {match.group(2)}, in "

    return _FILE_LINE.sub(label, tb)


def file_label(path: str) -> str:
    """``Cell In[3]`` for a notebook cell, as IPython names it (its file is a temporary path of
    the kernel's), else ``File "path"``."""
    try:
        from IPython import get_ipython

        label = get_ipython().compile.format_code_name(path)
    except Exception:  # noqa: BLE001 - no IPython, or not a cell: the plain form
        label = None
    return f"{label[0]} {label[1]}" if label else f'File "{path}"'


def shown_from_caller(error: BaseException) -> BaseException:
    """``error``, set to show in IPython from the caller's line, without the launcher's frames.

    IPython hides the frames that set ``__tracebackhide__`` except the last one, the line that
    raised: ``run.py: raise error ...`` under the reader's cell. An exception that has a
    ``_render_traceback_`` is shown by it instead (IPython's hook; ipyparallel's remote errors
    use it), so give this one a traceback without any hidden frame. pytest honours
    ``__tracebackhide__`` itself, and plain Python shows the whole traceback.
    """
    error._render_traceback_ = functools.partial(_render_from_caller, error)
    return error


def _render_from_caller(error: BaseException) -> list[str]:
    """IPython's own rendering of ``error``, its ``__tracebackhide__`` frames left out."""
    from IPython import get_ipython

    kept = []
    tb = error.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_locals.get("__tracebackhide__"):
            kept.append(tb)
        tb = tb.tb_next
    shown = None
    for tb in reversed(kept):
        shown = types.TracebackType(shown, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return get_ipython().InteractiveTB.structured_traceback(type(error), error, shown,
                                                            tb_offset=0)
