"""Fashion-MNIST (or MNIST) as two in-memory tensors: ``images, labels = load()``.

    >>> from gradsync_tutorial import data
    >>> images, labels = data.load()
    >>> images.shape, images.dtype, labels.shape, labels.dtype
    (torch.Size([60000, 1, 28, 28]), torch.float32, torch.Size([60000]), torch.int64)

The whole training set is 60,000 images of 28x28 bytes, 188 MB as float32: it fits in memory,
so there is no ``DataLoader``, no PIL image per sample and no transform per sample. Every pixel
is normalized once, ``(pixel / 255 - mean) / std``, and a batch is just ``images[idx]``. That
keeps the notebooks about gradient averaging, and it makes a rank's share of the data easy to
see: ``images[rank::world_size]``.

Where the files come from, in this order (:func:`ensure_files`):

1. the unpacked IDX files under ``ROOT/FashionMNIST/raw/`` (``ROOT/MNIST/raw/`` for MNIST),
   read with torchvision's own dataset class, so the folder layout is torchvision's;
2. torchvision's download, if ``download=True`` (a network error only moves on to 3.);
3. the copy that a Debian/Ubuntu package installs (``apt install dataset-fashion-mnist``
   puts it in ``/usr/share/datasets/fashion-mnist/``), unpacked into ``ROOT/.../raw/``;
4. otherwise :class:`FileNotFoundError`, saying how to get the files onto an offline machine.

``ROOT`` is :data:`DEFAULT_ROOT` unless you pass ``root=``. To prepare a workshop machine
without internet, run ``python -m gradsync_tutorial.data`` (or ``make data``) on a machine with
internet and copy the ``data/`` folder it fills, or point ``GRADSYNC_DATA`` at a copy.

Introduced in ``notebooks/01_single_device_baseline.ipynb``.
"""

from __future__ import annotations

import argparse
import errno
import functools
import gzip
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DATASETS", "DEBIAN_DIRS", "DEFAULT_ROOT", "DataError", "ensure_files", "load",
           "main", "resolve_root", "verify"]


class DataError(RuntimeError):
    """The data files are there but cannot be used (or cannot be written): ``problem`` names
    the file and what is wrong with it, ``fix`` says what to do."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}\nfix: {fix}")
        self.problem, self.fix = problem, fix


@dataclass(frozen=True)
class DatasetInfo:
    """What the loader needs to know about one dataset."""

    title: str  # for messages: "Fashion-MNIST"
    folder: str  # torchvision's class name, which is also its folder: ROOT/<folder>/raw/
    mean: float  # mean and std of the training pixels scaled to [0, 1]:
    std: float  # (pixel / 255 - mean) / std has mean ~0 and std ~1 on the training set
    debian_package: str | None  # the Debian/Ubuntu package that ships the files, if any


DATASETS: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo("Fashion-MNIST", "FashionMNIST", 0.2860, 0.3530,
                                 "dataset-fashion-mnist"),
    "mnist": DatasetInfo("MNIST", "MNIST", 0.1307, 0.3081, None),
}

# The four IDX files of each dataset, named as torchvision expects them once unpacked.
RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

# Step 3: folders where a system package keeps the gzipped files (``<name>.gz``). A mapping at
# module level so that tests can point it somewhere else. Debian/Ubuntu ship Fashion-MNIST
# (package dataset-fashion-mnist) but no MNIST package, so MNIST has no folder here.
DEBIAN_DIRS: dict[str, tuple[Path, ...]] = {
    "fashion-mnist": (Path("/usr/share/datasets/fashion-mnist"),),
    "mnist": (),
}

# Step 2 must not hang on a network that drops packets: each socket operation of the download
# gives up after this many seconds.
DOWNLOAD_TIMEOUT = 20.0


def _default_root() -> Path:
    """``$GRADSYNC_DATA``, else :func:`_fallback_root` (a ``~user`` that this machine does not
    know is kept as written: the error comes when the folder is used, not at import)."""
    try:
        return _env_root() or _fallback_root()
    except DataError:
        return Path(os.environ["GRADSYNC_DATA"])


def _expanded(path: str | os.PathLike[str], origin: str, fix: str) -> Path:
    """``path`` with ``~`` expanded; :class:`DataError` naming ``origin`` if it cannot be."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # "Could not determine home directory."
        user = os.fspath(path).split(os.sep)[0]
        raise DataError(f"{origin} starts with {user}, the home folder of a user that this "
                        "machine does not know.", fix) from None


def _env_root() -> Path | None:
    """``$GRADSYNC_DATA`` as a path, None if it is not set."""
    env = os.environ.get("GRADSYNC_DATA")
    if not env:
        return None
    return _expanded(env, f"GRADSYNC_DATA ({env})",
                     "point GRADSYNC_DATA at a folder by its full path (~/x for your own home "
                     f"folder), or unset it to use {_fallback_root()}.")


def _fallback_root() -> Path:
    """``<repo>/data`` in a checkout, else a per-user cache folder."""
    repo = Path(__file__).resolve().parent.parent
    if (repo / "pyproject.toml").is_file():  # running from a checkout of the tutorial
        return repo / "data"
    return Path.home() / ".cache" / "gradsync-tutorial"  # installed as a package


#: Where the data lives when ``root=None``: ``$GRADSYNC_DATA`` if set, else the ``data/``
#: folder of the repository (when the package runs from a checkout), else
#: ``~/.cache/gradsync-tutorial``.
DEFAULT_ROOT: Path = _default_root()


def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The data folder in use: ``root`` if given, else ``$GRADSYNC_DATA``, else DEFAULT_ROOT.

        >>> from gradsync_tutorial import data
        >>> data.resolve_root("/tmp/fmnist")
        PosixPath('/tmp/fmnist')
    """
    if root is not None:
        return _expanded(root, f"the data folder you passed, {root},",
                         "pass a folder by its full path.").resolve()
    return (_env_root() or DEFAULT_ROOT).resolve()  # read again: it may be set after import


def _origin(root: str | os.PathLike[str] | None) -> str:
    """Where the data folder in use was named, for messages: "GRADSYNC_DATA (/x)"..."""
    if root is not None:
        return f"the data folder you passed (root= or --root), {root}"
    env = os.environ.get("GRADSYNC_DATA")
    return f"GRADSYNC_DATA ({env})" if env else f"the default data folder, {DEFAULT_ROOT}"


def _usable_root(root: str | os.PathLike[str] | None) -> Path:
    """:func:`resolve_root`, after checking that it is (or can become) a folder: not a file,
    not under a file, not a symbolic link that loops. Raises :class:`DataError` otherwise."""
    where = _origin(root)
    if root is not None:
        fix = "pass a folder (it is created if it does not exist yet)"
    elif os.environ.get("GRADSYNC_DATA"):
        fix = ("point GRADSYNC_DATA at a folder (it is created if it does not exist yet), or "
               f"unset it to use {_fallback_root()}")
    else:
        fix = (f"move {DEFAULT_ROOT} out of the way, or point GRADSYNC_DATA at a folder (it is "
               "created if it does not exist yet)")
    loop = DataError(f"{where} is a symbolic link that leads back to itself (a loop).",
                     f"remove or repair the link, or {fix}.")
    try:
        path = resolve_root(root)
    except DataError:
        raise
    except RuntimeError:  # "Symlink loop from ..." (pathlib before Python 3.13)
        raise loop from None
    for folder in (path, *path.parents):  # the nearest one that exists must be a folder
        try:
            is_dir = folder.is_dir() if folder.exists() else None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise loop from None
            raise DataError(f"{where} cannot be read: {e.strerror or e}.", f"{fix}.") from None
        if is_dir is None:
            continue
        if not is_dir:
            inside = "is a file" if folder == path else f"is inside {folder}, which is a file"
            raise DataError(f"{where} {inside}, not a folder: the data set is a folder of "
                            "files.", f"{fix}.")
        return path
    return path


def _info(dataset: str) -> tuple[str, DatasetInfo]:
    key = dataset.lower().replace("_", "-")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}: use one of {', '.join(DATASETS)}.")
    return key, DATASETS[key]


def _raw_dir(info: DatasetInfo, root: Path) -> Path:
    return root / info.folder / "raw"


def _missing(raw: Path) -> list[str]:
    return [name for name in RAW_FILES if not (raw / name).is_file()]


def _data_command(key: str, root: Path) -> str:
    """The command that fetches or unpacks ``key`` into ``root``, as the user would type it."""
    flags = "" if key == "fashion-mnist" else f" --dataset {key}"
    if root != resolve_root(None):
        flags += f" --root {root}"
    return f"python -m gradsync_tutorial.data{flags}"


# --------------------------------------------------------------------------------------------
# Are the files what they should be? verify()
# --------------------------------------------------------------------------------------------

# An IDX file starts with a magic number (0x0803: unsigned bytes, 3 dimensions, for images;
# 0x0801, 1 dimension, for labels), then one big-endian uint32 per dimension, then the bytes.
_MAGIC = {3: 0x00000803, 1: 0x00000801}


def _idx_shape(path: Path, redo: str) -> tuple[int, ...]:
    """The shape an IDX file's header announces, after checking that the file matches it.

    Reads 16 bytes and the file's size, so it is cheap enough for every :func:`load`.
    ``redo`` is the fix for a damaged file. Raises :class:`DataError` naming ``path``.
    """
    dims = 3 if "images" in path.name else 1
    kind = "images" if dims == 3 else "labels"
    size = path.stat().st_size
    fix = f"delete {path} and run `{redo}` again, which fetches or unpacks it anew."
    if size == 0:
        raise DataError(f"{path} is empty (an interrupted download or copy?).", fix)
    with open(path, "rb") as f:
        head = f.read(4 + 4 * dims)
    if head[:2] == b"\x1f\x8b":  # gzip's own magic number
        raise DataError(
            f"{path} is still gzip-compressed: torchvision reads the unpacked IDX bytes.",
            f"unpack it in place (`mv {path} {path}.gz && gunzip {path}.gz`), or {fix}",
        )
    magic = int.from_bytes(head[:4], "big")
    if magic != _MAGIC[dims]:
        raise DataError(
            f"{path} is not an IDX file of {kind}: it starts with {head[:4].hex(' ')}, "
            f"not the magic number {_MAGIC[dims]:08x} (a wrong or damaged file).", fix)
    if len(head) < 4 + 4 * dims:
        raise DataError(f"{path} is truncated: {size} bytes, not even a whole header.", fix)
    shape = tuple(int.from_bytes(head[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    expected = len(head) + int(torch.tensor(shape).prod())
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(
            f"{path} is {what}: {size:,} bytes, where its header announces {shape[0]:,} {kind} "
            f"({expected:,} bytes).", fix)
    return shape


def verify(dataset: str = "fashion-mnist", root: str | os.PathLike[str] | None = None
           ) -> dict[str, tuple[int, ...]]:
    """Check the four unpacked IDX files: present, unpacked, whole, and with as many labels
    as images. Returns each file's shape, e.g. ``{"train-images-idx3-ubyte": (60000, 28,
    28), ...}``; raises :class:`DataError` naming the file and the fix, or
    :class:`FileNotFoundError` if a file is missing.

    Reads only the files' headers and sizes: :func:`ensure_files` calls it every time.

        >>> from gradsync_tutorial import data
        >>> data.verify()["t10k-labels-idx1-ubyte"]          # doctest: +SKIP
        (10000,)
    """
    key, info = _info(dataset)
    root = _usable_root(root)
    raw = _raw_dir(info, root)
    missing = _missing(raw)
    if missing:
        raise FileNotFoundError(f"{info.title}: missing {', '.join(missing)} in {raw}/.")
    redo = _data_command(key, root)
    shapes = {name: _idx_shape(raw / name, redo) for name in RAW_FILES}
    for split in ("train", "t10k"):
        images, labels = shapes[f"{split}-images-idx3-ubyte"], shapes[f"{split}-labels-idx1-ubyte"]
        if images[0] != labels[0]:
            raise DataError(
                f"{raw / f'{split}-images-idx3-ubyte'} holds {images[0]:,} images but "
                f"{raw / f'{split}-labels-idx1-ubyte'} holds {labels[0]:,} labels: the two "
                "files come from different copies.",
                f"delete both and run `{redo}` again.")
    return shapes


# --------------------------------------------------------------------------------------------
# Getting the raw files: ensure_files()
# --------------------------------------------------------------------------------------------


@contextmanager
def _socket_timeout(seconds: float) -> Iterator[None]:
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(old)


def _try_download(info: DatasetInfo, root: Path) -> str | None:
    """Step 2: torchvision's download. Returns None on success, else why it failed."""
    import torchvision.datasets

    cls = getattr(torchvision.datasets, info.folder)
    try:
        with _socket_timeout(DOWNLOAD_TIMEOUT):
            cls(str(root), train=True, download=True)  # fetches and unpacks all four files
    except (OSError, RuntimeError) as e:  # URLError and timeouts are OSErrors
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return f"{type(e).__name__}: {reason}"
    return None


def _gunzip(src: Path, dst: Path) -> None:
    """Unpack ``src`` to ``dst`` atomically: a half-written file never has the final name."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".part")
    try:
        with gzip.open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
            shutil.copyfileobj(fin, fout, length=1 << 20)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared data folder must be readable
        os.replace(tmp, dst)  # atomic: two ranks unpacking at once both end with whole files
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _unpack_system_copy(key: str, raw: Path) -> Path | None:
    """Step 3: unpack a packaged copy (``<dir>/<name>.gz``) into ``raw``; return its folder."""
    for folder in DEBIAN_DIRS.get(key, ()):
        folder = Path(folder)
        if all((folder / f"{name}.gz").is_file() for name in RAW_FILES):
            # torchvision's download would reject these files (Debian re-compresses them, so the
            # .gz checksums differ), but the unpacked IDX bytes are what torchvision reads.
            for name in _missing(raw):
                _gunzip(folder / f"{name}.gz", raw / name)
            return folder
    return None


def _not_found_message(key: str, info: DatasetInfo, root: Path, download: bool,
                       download_error: str | None) -> str:
    raw = _raw_dir(info, root)
    if not download:
        step2 = "not tried (download=False)"
    else:
        step2 = f"failed: {download_error}"
    dirs = DEBIAN_DIRS.get(key, ())
    if dirs:
        step3 = "none in " + ", ".join(str(d) for d in dirs)
    else:
        step3 = f"none (no Debian/Ubuntu package ships {info.title})"
    flag = "" if key == "fashion-mnist" else f" --dataset {key}"
    make = "make data" if not flag else f"make data DATA_FLAGS='{flag.strip()}'"
    return (
        f"{info.title} was not found, and could not be fetched.\n"
        f"  1. unpacked files in {raw}/: missing {', '.join(_missing(raw))}\n"
        f"  2. torchvision's download: {step2}\n"
        f"  3. a system package's copy: {step3}\n"
        "To get it, do one of:\n"
        f"  * on a machine with internet, run `python -m gradsync_tutorial.data{flag}` (or "
        f"`{make}`) in the repository, then copy its data/ folder to this machine as "
        f"{root}/ (for an offline workshop: do this once, share the folder);\n"
        f"  * set GRADSYNC_DATA=/path/to/folder, a folder that contains {info.folder}/raw/, or "
        "pass root= / --root;\n"
        + (f"  * install the package: `sudo apt install {info.debian_package}`;\n"
           if info.debian_package else "")
        + ("  * on a machine with internet, call again with download=True (the default; on "
           "the command line: without --no-download).\n" if not download else "")
    ).rstrip()


def ensure_files(
    dataset: str = "fashion-mnist",
    root: str | os.PathLike[str] | None = None,
    download: bool = True,
) -> Path:
    """Make sure the four unpacked IDX files (train and test) exist; return their folder.

    Tries the unpacked files, then torchvision's download (if ``download``), then a Debian/Ubuntu
    packaged copy; raises :class:`FileNotFoundError` listing every option if all fail. Call it
    once in the notebook *before* launching ranks, so that the ranks only read files.

    Example:
        >>> from gradsync_tutorial import data
        >>> data.ensure_files()
        PosixPath('.../data/FashionMNIST/raw')

    Introduced in ``notebooks/01_single_device_baseline.ipynb``.
    """
    key, info = _info(dataset)
    root = _usable_root(root)
    raw = _raw_dir(info, root)
    if not _missing(raw):  # 1. already there
        verify(key, root)
        return raw
    download_error = None
    if download:  # 2. torchvision's download
        download_error = _try_download(info, root)
        if not _missing(raw):
            verify(key, root)
            return raw
        if download_error is None:  # "succeeded" but left files missing: say so
            download_error = "finished without writing every file"
    try:
        unpacked = _unpack_system_copy(key, raw)  # 3. Debian's copy
    except OSError as e:  # no permission, no space left, ...
        owner = (f", or ask the owner of {root} to run `{_data_command(key, root)}` once"
                 if isinstance(e, PermissionError) else "")
        raise DataError(
            f"cannot write the unpacked files into {raw}/: {e.strerror or e} "
            f"({e.filename or raw}).",
            f"point GRADSYNC_DATA at a folder you may write to, with room for 60 MB (or pass "
            f"root= / --root){owner}.",
        ) from None
    if unpacked is not None and not _missing(raw):
        verify(key, root)
        return raw
    raise FileNotFoundError(_not_found_message(key, info, root, download, download_error))


# --------------------------------------------------------------------------------------------
# Reading them: load()
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _read(key: str, train: bool, root: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one split with torchvision and normalize it. Cached: later calls are free."""
    import torchvision.datasets

    info = DATASETS[key]
    cls = getattr(torchvision.datasets, info.folder)
    try:
        # download=False: torchvision only reads the unpacked IDX files (uint8, N x 28 x 28).
        ds = cls(root, train=train, download=False)
    except (AssertionError, RuntimeError, TypeError, ValueError) as e:
        raw = Path(root) / info.folder / "raw"
        raise DataError(
            f"could not read {info.title} from {raw}: {type(e).__name__}: {e}. A file may be "
            "truncated (an interrupted download?).",
            f"delete {raw} and run `{_data_command(key, Path(root))}` again.",
        ) from e
    # One vectorized pass over all pixels, instead of a transform per image:
    # uint8 (N, 28, 28) -> float32 (N, 1, 28, 28) in [0, 1] -> mean ~0, std ~1.
    images = ds.data.unsqueeze(1).to(torch.float32).div_(255).sub_(info.mean).div_(info.std)
    labels = ds.targets.to(torch.int64)
    return images.contiguous(), labels.contiguous()


def load(
    dataset: str = "fashion-mnist",
    train: bool = True,
    root: str | os.PathLike[str] | None = None,
    download: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images, labels)`` of one split, normalized, as in-memory CPU tensors.

    Args:
        dataset: ``"fashion-mnist"`` (default) or ``"mnist"``.
        train: the 60,000 training images if True, else the 10,000 test images.
        root: the data folder; default :data:`DEFAULT_ROOT` (or ``$GRADSYNC_DATA``).
        download: allow torchvision's download if the files are not there yet
            (see :func:`ensure_files` for the order in which sources are tried).

    Returns:
        ``images``: float32, shape ``(N, 1, 28, 28)``, ``(pixel / 255 - mean) / std`` with the
        dataset's standard mean and std (Fashion-MNIST 0.2860 / 0.3530, MNIST 0.1307 / 0.3081).
        ``labels``: int64, shape ``(N,)``, class indices 0..9.

    The result is cached per ``(dataset, train, root)`` in this process, so calling ``load()``
    again (in every epoch, or in every launch on the same workers) costs nothing. The cached
    tensors are shared, not copied: **do not modify them in place** (``images -= 1``,
    ``images[0] = 0``, ``images.mul_(2)``); indexing (``images[idx]``) and arithmetic
    (``images * 2``) make new tensors and are fine. Use ``images.clone()`` for a private copy.

    Example:
        >>> from gradsync_tutorial import data
        >>> images, labels = data.load(train=False)
        >>> images.shape, labels[:5]
        (torch.Size([10000, 1, 28, 28]), tensor([9, 2, 1, 1, 6]))

    Introduced in ``notebooks/01_single_device_baseline.ipynb``.
    """
    key, _ = _info(dataset)
    resolved = _usable_root(root)
    ensure_files(key, root, download=download)  # four file checks when the files are there
    return _read(key, bool(train), str(resolved))


# --------------------------------------------------------------------------------------------
# python -m gradsync_tutorial.data
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: fetch or unpack the data now, and say where it is.

    ``python -m gradsync_tutorial.data [--dataset fashion-mnist|mnist] [--root DIR]
    [--no-download]``. Returns the exit status (0: ready, 1: not found).
    """
    parser = argparse.ArgumentParser(
        prog="python -m gradsync_tutorial.data",
        description="Prepare the tutorial's data set (run it where there is internet, then "
        "copy the data folder to offline machines).",
    )
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fashion-mnist")
    parser.add_argument("--root", default=None,
                        help=f"data folder (default: $GRADSYNC_DATA or {DEFAULT_ROOT})")
    parser.add_argument("--no-download", dest="download", action="store_false",
                        help="do not try the internet; use local or packaged copies only")
    args = parser.parse_args(argv)

    try:
        raw = ensure_files(args.dataset, args.root, download=args.download)
        splits = {split: load(args.dataset, train=train, root=args.root, download=False)
                  for train, split in ((True, "train"), (False, "test"))}
    except (FileNotFoundError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # anything else the system refused: said in a sentence, not a trace
        print(f"error: {e.strerror or e}: {e.filename or args.root or DEFAULT_ROOT}\n"
              "fix: check that the data folder can be read and written, or point "
              "GRADSYNC_DATA (or --root) at another one.", file=sys.stderr)
        return 1
    print(f"{DATASETS[args.dataset].title} is ready in {raw}")  # only once both splits loaded
    for split, (images, labels) in splits.items():
        print(f"  {split:5}: {len(images):6} images {tuple(images.shape[1:])}, "
              f"{labels.unique().numel()} classes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
