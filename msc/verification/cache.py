"""Plan texts this msc has verified before, so that loading one again skips
the plan verifier (about 30 s for a 1024-rank ring, paid by every process
that loads it).

An entry is a file under ``cache_dir()/verified``. It holds what it vouches
for: a digest of msc's own source files (parser, verifier and all), the
reader (plan text or MSCCL XML), the collective the plan was verified
against, the SHA-256 of the text, and an HMAC-SHA256 of these under the key
in ``verified/key`` (32 random bytes made on first use; the file must be the
user's own, mode 0600, or the cache is off). Its name is the SHA-256 of the
same values. So a hit means: this exact text, read the same way by this
exact msc, was verified against this collective by a process that held the
key. Anything else under that name (empty, garbage, half-written, an entry
for another text, collective or msc, one made with another key) is a miss,
and the text is verified again. Entries are written atomically.

What an entry cannot prove, and who can still forge one (the trust model):
the key stops another user who can write to the cache folder but not read
the key; anyone who runs code as you can read it (and needs no cache to
subvert msc). Code in the very process that records (an algorithm file
``msc compile`` runs) is checked only for the plain case: an entry is not
recorded when one of the functions that decide a verdict (the readers, the
verifiers, the collectives, lowering's verification, this module) is no
longer the one captured when its module was imported.

No link is followed: if the cache root, ``verified``, the key or an entry is
a symbolic link, the cache is not used (a warning says so, once). Only
built-in collectives named by the plan are remembered (a custom collective
is a Python object with no stable name). ``MSC_VERIFY_CACHE=0`` turns the
cache off; an unwritable cache directory only costs the second verification.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import importlib.machinery
import json
import os
import stat
import sys
import types
import warnings
from contextlib import suppress
from functools import lru_cache
from pathlib import Path

from msc.files import write_atomic
from msc.resources import PACKAGE_DIR, cache_dir, data_dir

_PACKAGE = PACKAGE_DIR
FORMAT = "msc-verified 2"
KEY = "key"                 # beside the entries (whose names are 64 hex digits)
_KEY_HEX = 64

# The modules whose functions decide what a text means, whether a plan is
# right, and what is recorded: replacing any of their module-level objects
# (or a function's code, defaults or the functions it wraps) stops recording.
VERDICT_MODULES = (
    "msc", "msc.verification.cache", "msc.formats.load", "msc.files", "msc.resources", "msc.errors",
    "msc.ir", "msc.perf", "msc.dsl.collectives", "msc.formats.plan_text", "msc.formats.plan_lines",
    "msc.formats.xml_import", "msc.verification.plan_values", "msc.verification.plan",
    "msc.verification.plan_fast", "msc.ir.arrays", "msc.ir.levels", "msc.verification.program_verifier",
    "msc.verification.program_verifier_fast", "msc.verification.multisets", "msc.ir.accesses", "msc.ir.worklist",
    "msc.lower.pipeline",
)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)       # a FIFO planted as an entry must not block the open
_DIR_FLAGS = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | _NONBLOCK
# Without these (Windows) the cache cannot refuse links, so it is off.
_SUPPORTED = bool(_NOFOLLOW and _DIRECTORY) and all(
    f in os.supports_dir_fd for f in (os.open, os.mkdir, os.rename, os.link, os.unlink))


class CacheWarning(UserWarning):
    """The verified-plan cache is not used, or a verdict is not recorded, and why."""


class _State:
    """The module's mutable state, in one object (the replacement check
    compares this module's globals too)."""

    def __init__(self):
        self.originals: dict = {}      # module name -> (module, {global name: fingerprint})
        self.warned: set = set()


_STATE = _State()


@lru_cache(maxsize=1)
def msc_digest() -> str:
    """SHA-256 over msc's Python modules and the plan grammar (names and
    bytes). The algorithm library is left out: a wheel puts it inside the
    package, a checkout beside it, and it does not read or verify plans."""
    h = hashlib.sha256()
    modules = sorted(p for p in _PACKAGE.rglob("*.py") if p.relative_to(_PACKAGE).parts[0] != "algorithms")
    for name, path in [(p.relative_to(_PACKAGE).as_posix(), p) for p in modules] + [
            ("grammars/plan.lark", data_dir("grammars") / "plan.lark")]:
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _enabled(collective) -> bool:
    return (_SUPPORTED and os.environ.get("MSC_VERIFY_CACHE", "1") != "0"
            and (collective is None or isinstance(collective, str)))


def _warn(reason: str, message: str) -> None:
    if reason not in _STATE.warned:
        _STATE.warned.add(reason)
        warnings.warn(message, CacheWarning, stacklevel=4)


# -- entries ------------------------------------------------------------------
def _body(text: str | bytes, reader: str, plan_collective: str, collective) -> bytes:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    return _body_of_digest(hashlib.sha256(data).hexdigest(), reader, plan_collective, collective)


def _body_of_digest(digest: str, reader: str, plan_collective: str, collective) -> bytes:
    return (f"{FORMAT}\nmsc {msc_digest()}\nreader {json.dumps(reader)}\n"
            f"collective {json.dumps(str(collective or plan_collective))}\n"
            f"text {digest}\n").encode()


def _entry(body: bytes, key: bytes) -> tuple[str, bytes]:
    """The entry's file name and its whole content."""
    return hashlib.sha256(body).hexdigest(), body + f"mac {hmac.new(key, body, 'sha256').hexdigest()}\n".encode()


def known(text: str | bytes, reader: str, plan_collective: str, collective=None) -> bool:
    """Whether this text, read by ``reader`` ("plan" or "xml"), was verified
    before against ``collective`` (or the collective the plan names) by this msc."""
    if not _enabled(collective):
        return False
    try:
        folder = _open_folder(create=False)
        if folder is None:
            return False
        try:
            key = _key(folder, create=False)
            if key is None:
                return False
            name, want = _entry(_body(text, reader, plan_collective, collective), key)
            got = _read(folder, name, len(want) + 1)
            return got is not None and hmac.compare_digest(got, want)
        finally:
            os.close(folder)
    except OSError:
        return False


def enabled(collective=None) -> bool:
    """Whether remember and known use the cache (a writer that streams its
    text hashes it as it goes only then)."""
    return _enabled(collective)


def remember(text: str | bytes, reader: str, plan_collective: str, collective=None) -> None:
    """Record that this text verified (call only after it did, in this
    process). Nothing is recorded if a function that decides a verdict was
    replaced since its module was imported (msc.verification.cache.replaced)."""
    if _enabled(collective):
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        remember_digest(hashlib.sha256(data).hexdigest(), reader, plan_collective, collective)


def remember_digest(digest: str, reader: str, plan_collective: str, collective=None) -> None:
    """remember, given the SHA-256 (hex) of the text's UTF-8 bytes."""
    if not _enabled(collective):
        return
    changed = replaced()
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        _warn("replaced", f"msc: not recording verified plans in this process: {', '.join(changed[:3])}{more} "
                          f"replaced since msc imported it, so the verdict is not msc's own")
        return
    try:
        folder = _open_folder(create=True)
        if folder is None:
            return
        try:
            key = _key(folder, create=True)
            if key is not None:
                name, content = _entry(_body_of_digest(digest, reader, plan_collective, collective), key)
                write_atomic(name, content, mode=0o600, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError:
        pass              # a read-only cache: the next load verifies again, nothing is lost


def user_key() -> bytes | None:
    """The user's cache key (``verified/key``, made if absent), which the
    kernel caches sign their entries with too (msc.cuda.kcache); None where
    no key can be trusted or made (warned once, as for this cache). Not
    turned off by ``MSC_VERIFY_CACHE=0``, which concerns verdicts only."""
    if not _SUPPORTED:
        return None
    try:
        folder = _open_folder(create=True)
        if folder is None:
            return None
        try:
            return _key(folder, create=True)
        finally:
            os.close(folder)
    except OSError:
        return None


# -- the folder, without following links ---------------------------------------
def _is_link(exc: OSError, path: Path) -> bool:
    return exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and path.is_symlink()


def _link_warning(path: Path) -> None:
    _warn(f"link {path}", f"msc: {path} is a symbolic link: the verified-plan cache does not follow links, so it is "
                          f"not used (point MSC_CACHE_DIR at a real folder)")


def _open_folder(create: bool) -> int | None:
    """A descriptor of ``cache_dir()/verified``, each part opened without
    following a link; None if it does not exist (and ``create`` is false)
    or a part is a link (warned once)."""
    root = cache_dir()
    if root.is_symlink():
        _link_warning(root)
        return None
    if create:
        os.makedirs(root, exist_ok=True)        # above the root, links are the user's business
    try:
        top = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if _is_link(exc, root):
            _link_warning(root)
            return None
        raise
    try:
        if create:
            with suppress(FileExistsError):
                os.mkdir("verified", 0o700, dir_fd=top)
        return os.open("verified", _DIR_FLAGS, dir_fd=top)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if _is_link(exc, root / "verified"):
            _link_warning(root / "verified")
            return None
        raise
    finally:
        os.close(top)


def _read(folder: int, name: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``name`` in ``folder``;
    None if it is absent, not a regular file, or a link (warned once)."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=folder)
    except OSError as exc:
        path = cache_dir() / "verified" / name
        if exc.errno != errno.ENOENT and _is_link(exc, path):
            _link_warning(path)
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit)


def _key(folder: int, create: bool) -> bytes | None:
    """The cache's key: 32 bytes from ``verified/key``, a regular file that
    belongs to this user and that no one else may read or write (else None,
    and the cache is off, warned once). ``create``: make it if absent."""
    try:
        fd = os.open(KEY, _FILE_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return _new_key(folder) if create else None
    except OSError as exc:
        if _is_link(exc, cache_dir() / "verified" / KEY):
            _link_warning(cache_dir() / "verified" / KEY)
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        text = f.read(_KEY_HEX + 1) if stat.S_ISREG(st.st_mode) else b""
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    try:
        key = bytes.fromhex(text.decode("ascii")) if len(text) == _KEY_HEX else None
    except ValueError:
        key = None
    if key is None or not mine or st.st_mode & 0o077:
        path = cache_dir() / "verified" / KEY
        _warn(f"key {path}", f"msc: {path} is not a key only this user can read and write (a file of "
                             f"{_KEY_HEX} hex digits, owned by the user, mode 0600): the verified-plan cache is "
                             f"not used (delete the file to start a new cache)")
        return None
    return key


def _new_key(folder: int) -> bytes | None:
    key = os.urandom(_KEY_HEX // 2)
    tmp = f".{KEY}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.hex().encode())
        try:
            os.link(tmp, KEY, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
        except FileExistsError:                  # another process made it first: use theirs
            return _key(folder, create=False)
        except OSError:                          # no hard links here: rename (a racing key may be replaced)
            os.replace(tmp, KEY, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        with suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
    return key


# -- has a verdict function been replaced? --------------------------------------
def _members(cls: type):
    """The functions a class of msc defines (methods, static and class
    methods, properties), by name."""
    for name, value in vars(cls).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = (value.fget, value.fset, value.fdel)
        elif hasattr(value, "func") and type(value).__name__ == "cached_property":
            value = value.func
        if isinstance(value, (types.FunctionType, tuple)):
            yield name, value


def _fingerprint(value, depth: int = 0):
    """What must stay the same object: the value; for a function its code,
    defaults and the functions it closes over (a decorator's wrapped
    function); for msc's classes their functions; for a dict, list or set
    its items."""
    if depth > 4:
        return value
    if isinstance(value, types.FunctionType):
        cells = []
        for cell in value.__closure__ or ():
            with suppress(ValueError):           # an empty cell
                cells.append(_fingerprint(cell.cell_contents, depth + 1)
                             if isinstance(cell.cell_contents, types.FunctionType) else cell.cell_contents)
        kw = value.__kwdefaults__
        return (value, value.__code__, value.__defaults__, tuple(kw.items()) if kw else None, tuple(cells))
    if type(value).__name__ == "_lru_cache_wrapper" and isinstance(value.__wrapped__, types.FunctionType):
        return (value, _fingerprint(value.__wrapped__, depth + 1))
    if isinstance(value, type):
        if not str(getattr(value, "__module__", "")).startswith("msc"):
            return value
        return (value, tuple((name, _fingerprint(f, depth + 1)) for name, f in _members(value)))
    if isinstance(value, tuple) and depth:
        return tuple(_fingerprint(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return (value, tuple(value.items()))
    if isinstance(value, (list, set)):
        return (value, tuple(value))
    return value


def _same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


def _snapshot(module) -> dict:
    return {name: _fingerprint(value) for name, value in list(vars(module).items())
            if not (name.startswith("__") and name.endswith("__"))}


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _capture(module) -> None:
    name = getattr(module, "__name__", None)
    if name in VERDICT_MODULES and name not in _STATE.originals:
        _STATE.originals[name] = (module, _snapshot(module))


def replaced() -> list[str]:
    """The module-level objects of VERDICT_MODULES (``module.name``) that are
    not the ones captured when their module was imported (or, for a module
    imported before this one and still loading then, when first checked)."""
    out = []
    for name in VERDICT_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        if name not in _STATE.originals:
            if not _initializing(module):
                _capture(module)
            continue
        original, shot = _STATE.originals[name]
        if module is not original:
            out.append(name)
            continue
        now = vars(module)
        out += [f"{name}.{attr}" for attr, fp in shot.items()
                if attr not in now or not _same(fp, _fingerprint(now[attr]))]
    return out


class _Capturer:
    """An import hook: each verdict module is captured as soon as its code
    has run, before anyone else can touch it."""

    def find_spec(self, name, path=None, target=None):
        if name not in VERDICT_MODULES or name in _STATE.originals:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if isinstance(loader, (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)):
            run = loader.exec_module

            def exec_module(module):
                run(module)
                _capture(module)

            loader.exec_module = exec_module
        return spec


def _install() -> None:
    for name in VERDICT_MODULES:
        module = sys.modules.get(name)
        if module is not None and (module is sys.modules.get(__name__) or not _initializing(module)):
            _capture(module)
    if not any(isinstance(f, _Capturer) for f in sys.meta_path):
        sys.meta_path.insert(0, _Capturer())


_install()
