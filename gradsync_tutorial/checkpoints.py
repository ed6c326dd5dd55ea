"""Where the torchrun scripts may save their checkpoints: asked before training, not after it.

``scripts/train_ddp.py`` and ``scripts/train_manual.py`` save a checkpoint after every epoch.
A path they cannot write to would fail only then, a whole epoch late. Their ``parse_args``
asks :func:`unwritable` first and refuses the command line with its answer.

    >>> import tempfile
    >>> from pathlib import Path
    >>> from gradsync_tutorial.checkpoints import unwritable
    >>> folder = Path(tempfile.mkdtemp())
    >>> print(unwritable(folder / "new" / "ckpt.pt"))   # the folder "new" is created
    None
    >>> (folder / "new").is_dir()
    True
    >>> print(unwritable(folder))                        # a folder, not a file
    it is a folder: give a file in it, such as .../checkpoint.pt
    >>> (folder / "notes").write_text("")
    0
    >>> print(unwritable(folder / "notes" / "ckpt.pt"))  # "notes" is a file, not a folder
    a file cannot be written in .../notes (File exists): give a path in a folder you may
    write to

Introduced in ``notebooks/06_from_notebook_to_torchrun.ipynb``, which runs the scripts.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["unwritable"]


def unwritable(path: str | os.PathLike[str]) -> str | None:
    """Why a checkpoint cannot be saved to ``path`` (its folder is created if missing), else
    None: checked before training, so that a whole epoch is not lost to it."""
    if Path(path).is_dir():
        return f"it is a folder: give a file in it, such as {Path(path) / 'checkpoint.pt'}"
    folder = Path(path).absolute().parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # what rank 0's torch.save will need
    except OSError as e:
        return (
            f"a file cannot be written in {folder} ({e.strerror or e}): give a path in a "
            "folder you may write to"
        )
    return None
