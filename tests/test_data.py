"""Loading the data set: every source in order, on small IDX files written here.

The synthetic files go through the real path (torchvision's reader included); only the network
is never touched: every call passes download=False, or replaces the download step.
"""

import gzip
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradsync_tutorial import data

FILES = data.RAW_FILES
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")


def idx_images(pixels: np.ndarray) -> bytes:
    """IDX3: magic 2051 (unsigned bytes, 3 dims), then N, rows, cols, all big-endian."""
    n, rows, cols = pixels.shape
    return struct.pack(">IIII", 2051, n, rows, cols) + pixels.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    """IDX1: magic 2049 (unsigned bytes, 1 dim), then N, big-endian."""
    return struct.pack(">II", 2049, len(labels)) + labels.astype(np.uint8).tobytes()


@pytest.fixture
def fake():
    """Six training and four test images with known pixels and labels."""
    return fake_files()


def fake_files() -> tuple[dict, dict]:
    """(arrays, IDX bytes) of six training and four test images, by file name."""
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.array([0, 1, 2, 3, 9, 5], dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.array([7, 8, 9, 0], dtype=np.uint8),
    }
    blobs = {
        name: (idx_images(a) if "images" in name else idx_labels(a)) for name, a in arrays.items()
    }
    return arrays, blobs


@pytest.fixture(autouse=True)
def no_system_copies(monkeypatch):
    """Unless a test says otherwise, no Debian copy exists anywhere."""
    monkeypatch.setattr(data, "DEBIAN_DIRS", {"fashion-mnist": (), "mnist": ()})


def write_unpacked(folder: Path, blobs: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        (folder / name).write_bytes(blob)


def write_gzipped(folder: Path, blobs: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        (folder / f"{name}.gz").write_bytes(gzip.compress(blob))


def expected_images(pixels: np.ndarray, mean: float, std: float) -> torch.Tensor:
    x = torch.from_numpy(pixels.astype(np.float64)) / 255
    return ((x - mean) / std).unsqueeze(1)


def check_split(images, labels, pixels, label_values, mean, std):
    n = len(pixels)
    assert images.shape == (n, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (n,) and labels.dtype == torch.int64
    assert labels.tolist() == label_values.tolist()
    expected = expected_images(pixels, mean, std)
    torch.testing.assert_close(images.double(), expected, rtol=0, atol=1e-6)
    # The statistics follow from the pixels: mean and std shift and scale with the formula.
    scaled = pixels.astype(np.float64) / 255
    assert images.double().mean().item() == pytest.approx((scaled.mean() - mean) / std, abs=1e-6)
    assert images.double().std().item() == pytest.approx(scaled.std(ddof=1) / std, rel=1e-6)


# --------------------------------------------------------------------------------------------
# 1. unpacked files under ROOT/<Folder>/raw/
# --------------------------------------------------------------------------------------------


def test_loads_unpacked_files_normalized(tmp_path, fake):
    arrays, blobs = fake
    write_unpacked(tmp_path / "FashionMNIST" / "raw", blobs)

    images, labels = data.load(root=tmp_path, download=False)
    check_split(images, labels, arrays["train-images-idx3-ubyte"],
                arrays["train-labels-idx1-ubyte"], 0.2860, 0.3530)

    test_images, test_labels = data.load(train=False, root=tmp_path, download=False)
    check_split(test_images, test_labels, arrays["t10k-images-idx3-ubyte"],
                arrays["t10k-labels-idx1-ubyte"], 0.2860, 0.3530)


def test_load_is_cached(tmp_path, fake):
    write_unpacked(tmp_path / "FashionMNIST" / "raw", fake[1])
    first = data.load(root=tmp_path, download=False)
    again = data.load("Fashion_MNIST", root=str(tmp_path), download=False)  # same data set
    assert again[0] is first[0] and again[1] is first[1]


def test_mnist_uses_its_own_folder_and_statistics(tmp_path, fake):
    arrays, blobs = fake
    write_unpacked(tmp_path / "MNIST" / "raw", blobs)
    images, labels = data.load("mnist", root=tmp_path, download=False)
    check_split(images, labels, arrays["train-images-idx3-ubyte"],
                arrays["train-labels-idx1-ubyte"], 0.1307, 0.3081)
    with pytest.raises(FileNotFoundError):  # the Fashion-MNIST folder is still empty
        data.load("fashion-mnist", root=tmp_path, download=False)


def test_present_files_need_neither_download_nor_system_copy(tmp_path, fake, monkeypatch):
    write_unpacked(tmp_path / "FashionMNIST" / "raw", fake[1])
    monkeypatch.setattr(data, "_try_download", lambda *a: pytest.fail("tried to download"))
    monkeypatch.setattr(data, "_unpack_system_copy", lambda *a: pytest.fail("tried Debian"))
    assert data.ensure_files(root=tmp_path, download=True) == tmp_path / "FashionMNIST" / "raw"


def test_truncated_file_gets_a_clear_error(tmp_path, fake):
    raw = tmp_path / "FashionMNIST" / "raw"
    write_unpacked(raw, fake[1])
    blob = fake[1]["train-images-idx3-ubyte"]
    (raw / "train-images-idx3-ubyte").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(RuntimeError, match="truncated"):
        data.load(root=tmp_path, download=False)


def _damage(kind: str, raw: Path, blobs: dict) -> None:
    """Spoil the unpacked files in ``raw`` the way ``kind`` says (see DAMAGES)."""
    images = raw / "train-images-idx3-ubyte"
    blob = blobs["train-images-idx3-ubyte"]
    if kind == "half of the training images":
        images.write_bytes(blob[: len(blob) // 2])
    elif kind == "still gzipped":
        images.write_bytes(gzip.compress(blob))
    elif kind == "bad magic number":
        images.write_bytes(b"<!DOCTYPE html>" + blob[15:])  # a saved error page, say
    elif kind == "empty":
        images.write_bytes(b"")
    elif kind == "longer than its header":
        images.write_bytes(blob + b"\0" * 784)
    elif kind == "labels of another copy":
        (raw / "train-labels-idx1-ubyte").write_bytes(idx_labels(np.zeros(5, dtype=np.uint8)))


#: Each damage: the file the message must name, and what it must say about it.
DAMAGES = {
    "half of the training images": ("train-images-idx3-ubyte",
                                    r"is truncated: 2,360 bytes, where its header announces 6 "
                                    r"images \(4,720 bytes\)"),
    "still gzipped": ("train-images-idx3-ubyte", r"is still gzip-compressed(?s:.*)gunzip"),
    "bad magic number": ("train-images-idx3-ubyte", r"is not an IDX file of images: it starts "
                                                    r"with 3c 21 44 4f, not the magic number "
                                                    r"00000803"),
    "empty": ("train-images-idx3-ubyte", r"is empty"),
    "longer than its header": ("train-images-idx3-ubyte", r"is longer than its header says"),
    "labels of another copy": ("train-labels-idx1-ubyte", r"holds 6 images but .* holds 5 "
                                                          r"labels(?s:.*)delete both"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_file_is_named_with_its_fix(tmp_path, fake, damage):
    raw = tmp_path / "FashionMNIST" / "raw"
    write_unpacked(raw, fake[1])
    _damage(damage, raw, fake[1])
    name, message = DAMAGES[damage]
    with pytest.raises(data.DataError, match=message) as info:
        data.load(root=tmp_path, download=False)
    assert str(raw / name) in info.value.problem
    assert f"python -m gradsync_tutorial.data --root {tmp_path.resolve()}" in info.value.fix
    with pytest.raises(data.DataError, match=message):  # the test split alone is refused too
        data.load(train=False, root=tmp_path, download=False)


def test_an_unwritable_root_is_named_with_its_fix(tmp_path, fake, monkeypatch):
    debian = tmp_path / "debian"
    write_gzipped(debian, fake[1])
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (debian,))
    root = tmp_path / "read-only"

    def no_write(dir, **kwargs):  # what mkstemp meets in a folder this user may not write
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(data.tempfile, "mkstemp", no_write)
    with pytest.raises(data.DataError) as info:
        data.ensure_files(root=root, download=False)
    raw = root / "FashionMNIST" / "raw"
    assert info.value.problem == (f"cannot write the unpacked files into {raw}/: Permission "
                                  f"denied ({raw}).")
    assert "GRADSYNC_DATA" in info.value.fix and "--root" in info.value.fix
    assert data.main(["--root", str(root), "--no-download"]) == 1  # the CLI: a message


def _not_a_folder(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A data folder that cannot be one (see ROOTS): the path, and what the message says."""
    afile = tmp_path / "data.tar"
    afile.write_bytes(b"not a folder")
    if kind == "a file":
        return afile, "is a file, not a folder"
    if kind == "under a file":
        return afile / "data", f"is inside {afile}, which is a file, not a folder"
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    return tmp_path / "loop-a", "is a symbolic link that leads back to itself (a loop)"


#: Data folders that cannot be one: a raw NotADirectoryError or "RuntimeError: Symlink loop"
#: came out of them, from the Debian copy's unpacking and from pathlib.
ROOTS = ["a file", "under a file", "a symbolic link loop"]


@pytest.mark.parametrize("kind", ROOTS)
@pytest.mark.parametrize("debian_copy", [False, True], ids=["no copy", "a Debian copy"])
def test_gradsync_data_that_cannot_be_a_folder_gets_a_sentence(tmp_path, fake, monkeypatch,
                                                               kind, debian_copy):
    if debian_copy:  # unpacking it is what met the file (mkdir: NotADirectoryError)
        write_gzipped(tmp_path / "debian", fake[1])
        monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (tmp_path / "debian",))
    root, says = _not_a_folder(tmp_path, kind)
    monkeypatch.setenv("GRADSYNC_DATA", str(root))
    for call in (lambda: data.ensure_files(download=False), lambda: data.verify(),
                 lambda: data.load(download=False)):
        with pytest.raises(data.DataError) as info:
            call()
        assert info.value.problem == f"GRADSYNC_DATA ({root}) {says}" + (
            "." if "loop" in kind else ": the data set is a folder of files.")
        assert "point GRADSYNC_DATA at a folder" in info.value.fix
        assert f"unset it to use {data._fallback_root()}" in info.value.fix


@pytest.mark.parametrize("kind", ROOTS)
def test_a_root_that_cannot_be_a_folder_gets_a_sentence_from_the_cli(tmp_path, capsys, kind):
    root, says = _not_a_folder(tmp_path, kind)
    assert data.main(["--root", str(root), "--no-download"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"error: the data folder you passed (root= or --root), {root} {says}")
    assert "\nfix: " in err and "pass a folder" in err
    assert "Traceback" not in err and "ready" not in out


def test_python_m_data_prints_no_traceback(tmp_path):
    """The command itself, as a learner runs it: one sentence and its fix, exit status 1."""
    root, _ = _not_a_folder(tmp_path, "under a file")
    env = {**os.environ, "GRADSYNC_DATA": str(root)}
    done = subprocess.run([sys.executable, "-m", "gradsync_tutorial.data", "--no-download"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: GRADSYNC_DATA ({root}) is inside ")
    assert "Traceback" not in done.stderr and "\nfix: " in done.stderr


def test_another_refusal_of_the_system_gets_a_sentence_too(tmp_path, fake, monkeypatch, capsys):
    debian = tmp_path / "debian"
    write_gzipped(debian, fake[1])
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (debian,))

    def full(dir, **kwargs):  # what mkstemp meets on a full disk
        raise OSError(28, "No space left on device", str(dir))

    monkeypatch.setattr(data.tempfile, "mkstemp", full)
    with pytest.raises(data.DataError, match="No space left on device") as info:
        data.ensure_files(root=tmp_path / "root", download=False)
    assert "room for 60 MB" in info.value.fix and "owner" not in info.value.fix

    def unreadable(*args, **kwargs):  # anything else the system refuses, in the CLI
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(data, "ensure_files", unreadable)
    assert data.main(["--root", str(tmp_path), "--no-download"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: Permission denied: {tmp_path / 'x'}\nfix: ")
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------
# 2. and 3. download, then the Debian/Ubuntu copy
# --------------------------------------------------------------------------------------------


def test_unpacks_the_debian_copy(tmp_path, fake, monkeypatch):
    arrays, blobs = fake
    debian = tmp_path / "usr-share-datasets-fashion-mnist"
    write_gzipped(debian, blobs)
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (debian,))
    root = tmp_path / "root"

    images, labels = data.load(root=root, download=False)

    raw = root / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(FILES)  # no leftover temp files
    for name in FILES:
        assert (raw / name).read_bytes() == blobs[name]
        assert (raw / name).stat().st_mode & 0o644 == 0o644  # readable in a shared folder
    check_split(images, labels, arrays["train-images-idx3-ubyte"],
                arrays["train-labels-idx1-ubyte"], 0.2860, 0.3530)


def test_download_is_tried_before_the_debian_copy(tmp_path, fake, monkeypatch):
    debian = tmp_path / "debian"
    write_gzipped(debian, fake[1])
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (debian,))
    calls = []

    def offline(info, root):
        calls.append(("download", info.folder, root))
        return "URLError: <urlopen error [Errno -2] Name or service not known>"

    monkeypatch.setattr(data, "_try_download", offline)
    raw = data.ensure_files(root=tmp_path / "root", download=True)
    assert calls == [("download", "FashionMNIST", tmp_path / "root")]
    assert sorted(p.name for p in raw.iterdir()) == sorted(FILES)


def test_debian_copy_fills_only_missing_files(tmp_path, fake, monkeypatch):
    debian = tmp_path / "debian"
    write_gzipped(debian, fake[1])
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (debian,))
    raw = tmp_path / "root" / "FashionMNIST" / "raw"
    write_unpacked(raw, {"train-images-idx3-ubyte": fake[1]["train-images-idx3-ubyte"]})
    before = (raw / "train-images-idx3-ubyte").stat().st_mtime_ns
    data.ensure_files(root=tmp_path / "root", download=False)
    assert (raw / "train-images-idx3-ubyte").stat().st_mtime_ns == before
    assert sorted(p.name for p in raw.iterdir()) == sorted(FILES)


def test_a_packaged_mnist_copy_is_used_the_same_way(tmp_path, fake, monkeypatch):
    debian = tmp_path / "mnist-package"
    write_gzipped(debian, fake[1])
    monkeypatch.setitem(data.DEBIAN_DIRS, "mnist", (tmp_path / "absent", debian))
    images, _ = data.load("mnist", root=tmp_path / "root", download=False)
    assert len(images) == 6
    assert (tmp_path / "root" / "MNIST" / "raw" / "t10k-images-idx3-ubyte").is_file()


# --------------------------------------------------------------------------------------------
# 4. nothing anywhere
# --------------------------------------------------------------------------------------------


def test_nothing_anywhere_names_every_option(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-dir"
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (missing,))
    with pytest.raises(FileNotFoundError) as info:
        data.load(root=tmp_path / "root", download=False)
    message = str(info.value)
    for needle in (
        str(tmp_path / "root" / "FashionMNIST" / "raw"),  # 1. where files were looked for
        "download=False",  # 2. the download was not tried
        str(missing),  # 3. where a packaged copy was looked for
        "apt install dataset-fashion-mnist",
        "python -m gradsync_tutorial.data",  # how to pre-fetch for an offline workshop
        "make data",
        "GRADSYNC_DATA",
    ):
        assert needle in message, needle
    assert not (tmp_path / "root").exists()  # a failed look leaves nothing behind


def test_failed_download_reason_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_try_download", lambda info, root: "URLError: no network")
    with pytest.raises(FileNotFoundError, match="failed: URLError: no network"):
        data.ensure_files("mnist", root=tmp_path, download=True)


def test_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match="fashion-mnist, mnist"):
        data.load("cifar10", root=tmp_path, download=False)


# --------------------------------------------------------------------------------------------
# Where the data lives by default
# --------------------------------------------------------------------------------------------


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADSYNC_DATA", raising=False)
    repo = Path(data.__file__).resolve().parent.parent
    assert data._default_root() == repo / "data"  # the tests run from a checkout
    monkeypatch.setenv("GRADSYNC_DATA", str(tmp_path / "shared"))
    assert data._default_root() == tmp_path / "shared"
    assert data.resolve_root(None) == (tmp_path / "shared").resolve()  # read at call time


# --------------------------------------------------------------------------------------------
# python -m gradsync_tutorial.data
# --------------------------------------------------------------------------------------------


def test_cli_prepares_from_the_debian_copy(tmp_path, fake, monkeypatch, capsys):
    debian = tmp_path / "debian"
    write_gzipped(debian, fake[1])
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (debian,))
    root = tmp_path / "root"

    assert data.main(["--root", str(root), "--no-download"]) == 0

    out = capsys.readouterr().out
    assert f"Fashion-MNIST is ready in {root / 'FashionMNIST' / 'raw'}" in out
    assert "train:      6 images (1, 28, 28)" in out
    assert "test :      4 images (1, 28, 28)" in out
    assert sorted(p.name for p in (root / "FashionMNIST" / "raw").iterdir()) == sorted(FILES)


@pytest.mark.parametrize("damage", ["half of the training images", "labels of another copy"])
def test_cli_never_says_ready_about_damaged_files(tmp_path, fake, capsys, damage):
    raw = tmp_path / "FashionMNIST" / "raw"
    write_unpacked(raw, fake[1])
    _damage(damage, raw, fake[1])
    assert data.main(["--root", str(tmp_path), "--no-download"]) == 1
    out, err = capsys.readouterr()
    assert "ready" not in out
    assert err.startswith(f"error: {raw / DAMAGES[damage][0]}") or DAMAGES[damage][0] in err
    assert "\nfix: " in err and "Traceback" not in err


def test_cli_reports_missing_data(tmp_path, capsys):
    assert data.main(["--dataset", "mnist", "--root", str(tmp_path), "--no-download"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: MNIST was not found")
    assert "python -m gradsync_tutorial.data --dataset mnist" in err


# --------------------------------------------------------------------------------------------
# The real thing, when Debian's package is installed
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not DEBIAN_FASHION.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_from_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.setitem(data.DEBIAN_DIRS, "fashion-mnist", (DEBIAN_FASHION,))
    images, labels = data.load(root=tmp_path, download=False)
    assert images.shape == (60000, 1, 28, 28) and labels.shape == (60000,)
    assert labels.unique().tolist() == list(range(10))
    # The standard constants were computed on this training set: mean ~0, std ~1.
    assert abs(images.mean().item()) < 0.01
    assert abs(images.std().item() - 1) < 0.01
    test_images, test_labels = data.load(train=False, root=tmp_path, download=False)
    assert test_images.shape == (10000, 1, 28, 28) and test_labels.shape == (10000,)
    assert torch.bincount(test_labels).tolist() == [1000] * 10


def test_a_home_folder_of_an_unknown_user_is_named_not_a_crash_at_import(tmp_path):
    """GRADSYNC_DATA='~nosuchuser/x': the import works, and using the folder (the loader, the
    command, the doctor) says which variable names a user this machine does not know."""
    env = {**os.environ, "GRADSYNC_DATA": "~nosuchuser-gradsync/x"}
    code = ("import gradsync_tutorial.data as d\n"
            "from gradsync_tutorial import doctor\n"
            "try:\n    d.load(download=False)\nexcept d.DataError as e:\n    print(e.problem)\n"
            "print(doctor.check_data())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    said = ("GRADSYNC_DATA (~nosuchuser-gradsync/x) starts with ~nosuchuser-gradsync, the home "
            "folder of a user that this machine does not know.")
    assert done.stdout.count(said) == 2, done.stdout
    assert "report this" not in done.stdout and "by its full path" in done.stdout
