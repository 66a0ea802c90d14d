"""Plain text files as a corpus: one document per file, read lazily.

Public names:
    TextFiles: a random-access sequence of documents (str), one per file, in a fixed order.
    text_files: builds `TextFiles` from a file, a directory (with a glob pattern) or a glob.
"""

from __future__ import annotations

import glob as _glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

__all__ = ["TextFiles", "text_files"]


class TextFiles(Sequence[str]):
    """Text files as documents, read on access (UTF-8, invalid bytes replaced with U+FFFD).

    Args:
        paths: the files, in the order documents are yielded.
        root: the directory that `names` are relative to (default: the common parent).

    Attributes:
        paths: absolute `Path`s, in order.
        names: each file's path relative to `root`, with "/" separators (stable across machines,
            used for hash-based splits).

    Example:
        >>> docs = TextFiles([])
        >>> len(docs)
        0
    """

    def __init__(self, paths: Sequence[str | os.PathLike], *, root: str | os.PathLike | None = None) -> None:
        self.paths: list[Path] = [Path(p).absolute() for p in paths]
        if root is None:
            root = os.path.commonpath([str(p.parent) for p in self.paths]) if self.paths else "."
        self.root = Path(root).absolute()
        self.names: list[str] = [_relative_name(p, self.root) for p in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> TextFiles: ...
    def __getitem__(self, index: int | slice) -> str | TextFiles:
        if isinstance(index, slice):
            return TextFiles(self.paths[index], root=self.root)
        return self.paths[index].read_bytes().decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"TextFiles({len(self)} files under {str(self.root)!r})"

    def total_bytes(self) -> int:
        """Returns the summed size of all files in bytes (from the file system, nothing read)."""
        return sum(p.stat().st_size for p in self.paths)

    def check_text(self, sniff_bytes: int = 8192) -> None:
        """Raise ValueError if the files hold no bytes at all, or one looks binary (a NUL byte in its
        first `sniff_bytes`): training on either would silently learn nothing useful."""
        if self.paths and self.total_bytes() == 0:
            where = self.paths[0] if len(self.paths) == 1 else f"{self.root} ({len(self.paths)} files)"
            raise ValueError(f"the corpus {where} is empty (0 bytes); point --data.path at text files with content.")
        for path in self.paths:
            with open(path, "rb") as f:
                if b"\0" in f.read(sniff_bytes):
                    raise ValueError(
                        f"{path} is not text (it has NUL bytes in its first {sniff_bytes} bytes); for a token file "
                        f"written by numpy use --data.source bin with a .bin name, else point --data.path at text."
                    )


def _relative_name(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def text_files(path: str | os.PathLike, *, pattern: str = "**/*.txt") -> TextFiles:
    """Collects text files from a file, a directory or a glob pattern, sorted by path.

    Args:
        path: a file (one document), a directory (searched with `pattern`), or a glob such as
            `"data/*.md"`.
        pattern: the glob used inside a directory (`**` recurses).

    Returns:
        `TextFiles` over the matches in sorted order.

    Raises:
        FileNotFoundError: if `path` does not exist, or nothing matches.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("hi")
        >>> list(text_files(d))
        ['hi']
    """
    p = Path(path)
    if p.is_file():
        return TextFiles([p], root=p.parent)
    if p.is_dir():
        matches = sorted(q for q in p.glob(pattern) if q.is_file())
        if not matches:
            raise FileNotFoundError(
                f"directory {str(p)!r} has no files matching pattern={pattern!r}; expected text files "
                f"(pass pattern='**/*' for every file, or point at one file)."
            )
        return TextFiles(matches, root=p)
    if _glob.has_magic(str(path)):
        matches = sorted(Path(q) for q in _glob.glob(str(path), recursive=True) if os.path.isfile(q))
        if not matches:
            raise FileNotFoundError(f"glob {str(path)!r} matches no files; expected at least one text file.")
        return TextFiles(matches)
    raise FileNotFoundError(
        f"text path {str(path)!r} does not exist; expected a text file, a directory of text files, "
        f"or a glob pattern such as 'corpus/**/*.txt'."
    )
