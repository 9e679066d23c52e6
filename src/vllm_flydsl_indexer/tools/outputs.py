# SPDX-License-Identifier: Apache-2.0
"""Every file the tools write, one way: atomically, to a regular file or a new one, never clobbering.

A temporary file beside the target is renamed over it. A symlink is written through to its resolved
target and stays a link; a device node, a FIFO or a directory is refused, never replaced.
:func:`outputs_problem` refuses them, and two outputs of one run that are the same file, before the run.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import IO

from vllm_flydsl_indexer.tools.files import FileRefused, kind_of

__all__ = [
    "OUTPUT_RULE",
    "kind_problem",
    "lock_path",
    "locked",
    "outputs_problem",
    "place_problem",
    "write_atomic",
    "write_atomic_bytes",
]

# What every output accepts, as --help says it.
OUTPUT_RULE = (
    "each output is a regular file or a new one, replaced atomically; a symlink is written through to its "
    "target (a new file if there is none yet) and stays a link; refused before any work: a device, FIFO or "
    "directory, this command's own stdout or stderr (redirect the report, not an output, there), two "
    "outputs that are one file, a path under /proc or /sys, a path ending in / that is no directory, a "
    "file of the installed plugin, the table $VLLM_FLYDSL_INDEXER_TUNED_CSV names (but tune --out merges "
    "into it), and any path where a regular file cannot be created"
)
# Kernel interfaces: nothing written there is a file (``/proc/version`` took a whole run, then failed).
KERNEL_TREES = ("/proc", "/sys")
# The variable naming the plugin's tuned table (envs.TUNED_CSV); written here so that the tools'
# output rule reads without the runtime wing.
TUNED_CSV_VARIABLE = "VLLM_FLYDSL_INDEXER_TUNED_CSV"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _package_dir() -> str:
    import vllm_flydsl_indexer

    return os.path.realpath(os.path.dirname(vllm_flydsl_indexer.__file__))


def place_problem(
    path: str, merge_into_table: bool = False, environ: dict[str, str] | None = None
) -> str | None:
    """Why ``path`` is no place for an output, whatever is there now, or ``None``.

    Refused: a path under /proc or /sys; a path ending in ``/`` where no such directory exists
    (``--json out/`` would write a file named ``out``); a file of the installed plugin package (its
    built-in table); the table ``$VLLM_FLYDSL_INDEXER_TUNED_CSV`` names, unless ``merge_into_table``
    (``tune --out`` merging into it); a directory where no regular file can be created (a temporary
    file is created there and removed, as :func:`write_atomic` will).
    """
    env = os.environ if environ is None else environ
    real = os.path.realpath(path)
    for root in KERNEL_TREES:
        if _under(real, root) or _under(os.path.abspath(path), root):
            return f"{path} is under {root}, a kernel interface, not a file; give a file path"
    if path.endswith(("/", os.sep)) and not os.path.isdir(path):
        return f"{path} ends in '/' but there is no such directory; give a file path"
    package = _package_dir()
    if _under(real, package):
        return f"{path} is a file of the installed vllm_flydsl_indexer package ({package}); give another path"
    table = env.get(TUNED_CSV_VARIABLE, "").strip()
    if table and not merge_into_table and os.path.realpath(table) == real:
        return (
            f"{path} is the tuned table {TUNED_CSV_VARIABLE} names (the plugin reads it); give another path"
            " (tune --out merges into it)"
        )
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        return None  # a link to a missing directory: outputs_problem's open names it
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(real)}.", suffix=".tmp")
    except OSError as e:
        return f"cannot create a file beside {path} ({e.strerror or e})"
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    if not regular:
        return f"{path}: what is created there is not a regular file; give a file path"
    return None


def _standard_streams() -> list[tuple[str, os.stat_result]]:
    out = []
    for fd, name in ((1, "standard output"), (2, "standard error")):
        try:
            out.append((name, os.fstat(fd)))
        except OSError:
            continue
    return out


def kind_problem(path: str) -> str | None:
    """Why ``path`` cannot be written (an existing non-regular file, through any links, or this
    process's own stdout or stderr), or ``None``."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None  # a new file, or a link to one (written through: the link stays)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    for name, stream in _standard_streams():
        if (info.st_dev, info.st_ino) == (stream.st_dev, stream.st_ino):
            return f"{path} is this command's {name}; give an output its own file"
    if stat.S_ISREG(info.st_mode):
        return None
    return f"{path} is {kind_of(info.st_mode)}, not a regular file; give a file path"


def outputs_problem(outputs: Iterable[tuple[str, str]]) -> str | None:
    """The first ``(flag, path)`` that cannot be written, or that names the file an earlier one does.

    Paths are compared resolved (symlinks, ``./``, ``..``), and by inode where both exist.
    Each is opened for appending now, without blocking (a new file is removed again).
    """
    seen: dict[str, str] = {}
    for flag, path in outputs:
        problem = kind_problem(path)
        if problem is not None:
            return f"argument {flag}: {problem}"
        real = os.path.realpath(path)
        same = next((f for r, f in seen.items() if r == real or _same_inode(r, real)), None)
        if same is not None:
            return f"argument {flag}: {path} is the file {same} writes too; give each output its own file"
        seen[real] = flag
        existed = os.path.lexists(real)
        try:
            fd = os.open(real, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
            os.close(fd)
        except OSError as e:
            return f"argument {flag}: cannot open {path} for writing ({e.strerror or e})"
        if not existed:
            with contextlib.suppress(OSError):
                os.unlink(real)
    return None


def _same_inode(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _replace_atomic(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write a temporary file beside ``path``'s resolved target, sync it, rename it over the target."""
    problem = kind_problem(path)
    if problem is not None:
        raise FileRefused(problem)
    target = os.path.realpath(path)  # a link is written through and stays a link
    directory, name = os.path.split(target)
    try:
        mode = os.stat(target).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o644 & ~umask
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str, text: str, newline: str | None = None) -> None:
    """Replace ``path`` with ``text`` all at once: readers see the old file or the new one.

    UTF-8; ``newline`` as for :func:`open` (``""``: no translation). The mode
    of an existing file is kept; a new file gets 0o644 less the umask.
    """
    if newline not in ("", "\n"):
        text = text.replace("\n", os.linesep if newline is None else newline)
    data = text.encode("utf-8")
    _replace_atomic(path, lambda f: f.write(data))


def write_atomic_bytes(path: str, data: bytes) -> None:
    """:func:`write_atomic` for bytes (a rendered plot)."""
    _replace_atomic(path, lambda f: f.write(data))


def lock_path(path: str) -> str:
    """The lock file of ``path``: ``.NAME.lock`` beside its resolved target (a link's target is the
    file replaced, so two links to one table share one lock)."""
    directory, name = os.path.split(os.path.realpath(path))
    return os.path.join(directory, f".{name}.lock")


@contextlib.contextmanager
def locked(path: str, waiting: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock for a read-merge-replace of ``path``: the one lock of every file a tool merges
    into (``tune --out``'s table, ``tune --model``'s node cache), whose writer reads it *after* taking this
    lock, so none loses another's rows. ``waiting``: a line for stderr when another holder makes it wait.

    ``fcntl.flock`` on :func:`lock_path` (the file itself is replaced by a rename, so it cannot carry the
    lock); it blocks until the holder is done and is released when the block ends, or the process dies.
    The lock file stays, empty. Where ``fcntl`` is missing, or the lock file cannot be opened, the block
    runs unlocked.
    """
    try:
        import fcntl

        fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except (ImportError, OSError):  # not POSIX, or no lock file
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
