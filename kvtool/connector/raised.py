"""Where a connector's exception came from, in one line, and its whole traceback for later.

An exception raised inside kvtool on behalf of a connector (an `IndexError` from
`slot_tensor(-1)`, say) is the connector's doing: the line to show is the connector's own call,
not kvtool's `raise`. `describe_error` walks the traceback from the innermost frame outward to the
first frame of the connector's code: outside the kvtool package and outside installed libraries
(the standard library, site-packages); failing that, a frame of kvtool's own connectors
(`kvtool/connectors`, for the built-in ones); failing that, any frame outside kvtool; else the
innermost frame (an error of kvtool itself). The hook guards use it (the runtime's
`ConnectorRuntime.call`, the follower ranks' `RankExecutor._call`), and `with_wrapped_location`
adds the place to an error kvtool raised around a connector's (a constructor's, a registration's).
A class Python refuses to instantiate (an abstract method left out) raises with no frame of the
connector's code at all: `describe_construction_error` names the class's `class` statement then.
"""

from __future__ import annotations

import inspect
import sysconfig
import traceback
from pathlib import Path

_STOPS_KVTOOL = (KeyboardInterrupt, GeneratorExit)

_KVTOOL = Path(__file__).resolve().parents[1]
_BUILT_IN_CONNECTORS = _KVTOOL / "connectors"
_LIBRARIES = tuple({Path(p).resolve() for name in ("stdlib", "platstdlib", "purelib", "platlib")
                    if (p := sysconfig.get_paths().get(name))})


def stops_kvtool(exc: BaseException) -> bool:
    """True for what stops kvtool itself (Ctrl-C, a closed generator), which a hook guard raises
    again. Everything else a connector raises is the connector's failure: an `Exception`, a
    `SystemExit`, and the `BaseException`s of native extensions (a Rust panic reaches Python as
    pyo3's `PanicException`, which derives from `BaseException`, as NVIDIA Dynamo's KVBM shows)."""
    return isinstance(exc, _STOPS_KVTOOL)


def _path(filename: str) -> Path | None:
    if filename.startswith("<"):
        return None
    try:
        return Path(filename).resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def _inside(path: Path | None, folder: Path) -> bool:
    return path is not None and path.is_relative_to(folder)


def _is_library(path: Path | None) -> bool:
    return path is None or any(path.is_relative_to(library) for library in _LIBRARIES)


def _blamed_index(frames: traceback.StackSummary) -> int:
    paths = [_path(f.filename) for f in frames]
    outside = [i for i, p in enumerate(paths) if not _inside(p, _KVTOOL)]
    own = [i for i in outside if not _is_library(paths[i])]
    built_in = [i for i, p in enumerate(paths) if _inside(p, _BUILT_IN_CONNECTORS)]
    for candidates in (own, built_in, outside):
        if candidates:
            return candidates[-1]   # the innermost of them: the call nearest the raise
    return len(frames) - 1


def blamed_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The frame of the connector's code that led to `exc` (see the module docstring); None when
    `exc` has no traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[_blamed_index(frames)] if frames else None


def location(exc: BaseException) -> str | None:
    """`file:line` of the connector's frame (`blamed_frame`); when that line called into kvtool,
    which raised, followed by `, raised inside kvtool's <the function it called>`. None without a
    traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    i = _blamed_index(frames)
    where = f"{frames[i].filename}:{frames[i].lineno}"
    callee = frames[i + 1] if i + 1 < len(frames) else None
    if callee is not None and not is_connector_code(callee):
        where += f", raised inside kvtool's {callee.name}"
    return where


def describe_error(exc: BaseException) -> str:
    """`Type: message (file:line)`, the line being the connector's (see `location`)."""
    text = f"{type(exc).__name__}: {exc}"
    where = location(exc)
    return f"{text} ({where})" if where else text


def describe_construction_error(exc: BaseException, cls: type) -> str:
    """`describe_error(exc)` for `exc` raised while constructing `cls`, except for a `SystemExit`
    (said as the call it was) and where Python refused
    to instantiate an abstract `cls` (no frame of the connector's code raised): then the place named
    is `cls`'s `class` statement, `file:line`, when its source can be found."""
    if isinstance(exc, SystemExit):
        return (f"called sys.exit({exc.code!r}) while constructing its scheduler and worker: "
                "a connector must raise, not exit")
    frames = traceback.extract_tb(exc.__traceback__)
    refused = isinstance(exc, TypeError) and getattr(cls, "__abstractmethods__", None) and \
        not any(is_connector_code(f) for f in frames)
    where = class_location(cls) if refused else None
    return f"{type(exc).__name__}: {exc} ({where})" if where else describe_error(exc)


def class_location(cls: type) -> str | None:
    """`file:line` of `cls`'s `class` statement (past its decorators); None without its source."""
    try:
        lines, first = inspect.getsourcelines(cls)
        file = inspect.getsourcefile(cls)
    except (OSError, TypeError):
        return None
    offset = next((i for i, line in enumerate(lines) if line.lstrip().startswith("class ")), 0)
    return f"{file}:{first + offset}" if file else None


def is_connector_code(frame: traceback.FrameSummary) -> bool:
    """Whether `frame` lies outside kvtool's own machinery (a connector's file, a library it called,
    or one of kvtool's built-in connectors)."""
    path = _path(frame.filename)
    return not _inside(path, _KVTOOL) or _inside(path, _BUILT_IN_CONNECTORS)


def with_wrapped_location(exc: BaseException) -> str:
    """`str(exc)` for an error kvtool raised around a connector's exception (`raise ... from None`
    inside the `except`, as the constructor guard does), followed by where in the connector's code
    that exception came from, when it came from there and the message does not say it yet."""
    text = str(exc)
    inner = exc.__cause__ or exc.__context__
    frame = blamed_frame(inner) if inner is not None else None
    if inner is None or frame is None or not is_connector_code(frame):
        return text
    where = location(inner)
    return f"{text} ({where})" if where and where not in text else text


def format_error(exc: BaseException) -> str:
    """The whole traceback of `exc`, as Python prints it (chained exceptions included)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
