"""Plain text files as a corpus: one document per file, read lazily.

Public names:
    TextFiles: a random-access sequence of documents (str), one per file, in a fixed order.
    text_files: builds `TextFiles` from a file, a directory (with a glob pattern) or a glob.

With `max_bytes`, at most that many bytes are read: whole files in order while they fit, then the
start of the file that crosses the cap (cut at a character boundary); later files are left out.
"""

from __future__ import annotations

import codecs
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
        max_bytes: read at most this many bytes in all (None: every byte of every file).

    Attributes:
        paths: absolute `Path`s, in order.
        names: each file's path relative to `root`, with "/" separators (stable across machines,
            used for hash-based splits).
        limits: per file, how many bytes are read (None: all of it).
        unread_bytes: bytes on disk that `max_bytes` leaves out (0 when nothing is cut).

    Example:
        >>> docs = TextFiles([])
        >>> len(docs)
        0
    """

    def __init__(self, paths: Sequence[str | os.PathLike], *, root: str | os.PathLike | None = None,
                 max_bytes: int | None = None) -> None:
        self.paths: list[Path] = [Path(p).absolute() for p in paths]
        if root is None:
            root = os.path.commonpath([str(p.parent) for p in self.paths]) if self.paths else "."
        self.root = Path(root).absolute()
        self.limits: list[int | None] = [None] * len(self.paths)
        self.unread_bytes = 0
        if max_bytes is not None:
            self._cap(max_bytes)
        self.names: list[str] = [_relative_name(p, self.root) for p in self.paths]

    def _cap(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive byte count or None, got {max_bytes}.")
        sizes = [p.stat().st_size for p in self.paths]
        left, kept = max_bytes, 0
        while kept < len(sizes) and left > 0:
            self.limits[kept] = None if sizes[kept] <= left else left
            left -= min(sizes[kept], left)
            kept += 1
        self.unread_bytes = sum(sizes) - (max_bytes - left)
        self.paths, self.limits = self.paths[:kept], self.limits[:kept]

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> TextFiles: ...
    def __getitem__(self, index: int | slice) -> str | TextFiles:
        if isinstance(index, slice):
            part = TextFiles(self.paths[index], root=self.root)
            part.limits = self.limits[index]
            return part
        limit = self.limits[index]
        if limit is None:
            return self.paths[index].read_bytes().decode("utf-8", errors="replace")
        with open(self.paths[index], "rb") as f:  # the first `limit` bytes, less a character cut in half
            return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(f.read(limit), final=False)

    def read_utf8(self, index: int, *, chunk_bytes: int = 1 << 20) -> bytes:
        """Document `index` as UTF-8 bytes, equal to `self[index].encode()`, decoded in chunks: a str
        of the whole file would take 4 bytes per character once it holds one emoji."""
        limit = self.limits[index]
        left = self.paths[index].stat().st_size if limit is None else limit
        decoder, pieces = codecs.getincrementaldecoder("utf-8")(errors="replace"), []
        with open(self.paths[index], "rb") as f:
            while left > 0 and (data := f.read(min(chunk_bytes, left))):
                left -= len(data)
                pieces.append(decoder.decode(data, final=False).encode("utf-8"))
        if limit is None:  # a whole file: a character cut off at its end shows as U+FFFD, as in `self[index]`
            pieces.append(decoder.decode(b"", final=True).encode("utf-8"))
        return b"".join(pieces)

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        capped = f", {self.unread_bytes} bytes over max_bytes left unread" if self.unread_bytes else ""
        return f"TextFiles({len(self)} files under {str(self.root)!r}{capped})"

    def total_bytes(self) -> int:
        """Returns the bytes that are read: the files' summed size, within `max_bytes` (nothing read)."""
        return sum(p.stat().st_size if n is None else n for p, n in zip(self.paths, self.limits))

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


def text_files(path: str | os.PathLike, *, pattern: str = "**/*.txt", max_bytes: int | None = None) -> TextFiles:
    """Collects text files from a file, a directory or a glob pattern, sorted by path.

    Args:
        path: a file (one document), a directory (searched with `pattern`), or a glob such as
            `"data/*.md"`.
        pattern: the glob used inside a directory (`**` recurses).
        max_bytes: read at most this many bytes in all (see `TextFiles`); None reads everything.

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
        return TextFiles([p], root=p.parent, max_bytes=max_bytes)
    if p.is_dir():
        matches = sorted(q for q in p.glob(pattern) if q.is_file())
        if not matches:
            raise FileNotFoundError(
                f"directory {str(p)!r} has no files matching pattern={pattern!r}; expected text files "
                f"(pass pattern='**/*' for every file, or point at one file)."
            )
        return TextFiles(matches, root=p, max_bytes=max_bytes)
    if _glob.has_magic(str(path)):
        matches = sorted(Path(q) for q in _glob.glob(str(path), recursive=True) if os.path.isfile(q))
        if not matches:
            raise FileNotFoundError(f"glob {str(path)!r} matches no files; expected at least one text file.")
        return TextFiles(matches, max_bytes=max_bytes)
    raise FileNotFoundError(
        f"text path {str(path)!r} does not exist; expected a text file, a directory of text files, "
        f"or a glob pattern such as 'corpus/**/*.txt'."
    )
