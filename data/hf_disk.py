"""Hugging Face `datasets` saved on disk (`save_to_disk`) as a text corpus; never downloads.

Public names:
    HFTextColumn: a random-access sequence of documents (str): one text column of a `Dataset`.
    hf_text_from_disk: opens a dataset directory with `datasets.load_from_disk` and picks the
        split and the text column.

`datasets` is imported only when a dataset is opened; it is an optional dependency.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HFTextColumn", "hf_text_from_disk"]

_MSG_NO_DATASETS = (
    "reading Hugging Face datasets needs the `datasets` package, which is not installed; "
    "run `pip install datasets` (no download happens: load_from_disk reads local files)."
)


class HFTextColumn(Sequence[str]):
    """One string column of a Hugging Face `Dataset`, as a sequence of documents.

    Args:
        dataset: a `datasets.Dataset`.
        field: the name of a string column.

    Raises:
        ValueError: if `field` is not a column (the message lists the columns).
    """

    def __init__(self, dataset: Any, *, field: str = "text") -> None:
        columns = list(dataset.column_names)
        if field not in columns:
            close = difflib.get_close_matches(field, columns, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"field={field!r} is not a column of the dataset; columns: {columns}.{hint}")
        self.dataset = dataset
        self.field = field

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        if isinstance(index, slice):
            raise TypeError("HFTextColumn supports integer indexing only; use .dataset.select(...) to subset.")
        value = self.dataset[int(index)][self.field]
        if not isinstance(value, str):
            raise TypeError(
                f"column {self.field!r} holds {type(value).__name__} values, expected str; "
                f"pick a text column with field=..."
            )
        return value

    def __iter__(self) -> Iterator[str]:
        for batch in self.dataset.iter(batch_size=1024):
            yield from batch[self.field]

    def __repr__(self) -> str:
        return f"HFTextColumn({len(self)} rows, field={self.field!r})"


def hf_text_from_disk(path: str | os.PathLike, *, split: str | None = None, field: str = "text") -> HFTextColumn:
    """Opens a dataset written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`.

    Args:
        path: the directory given to `save_to_disk`.
        split: for a `DatasetDict`, which split to read (required when it has more than one).
        field: the text column.

    Returns:
        An `HFTextColumn` over that column.

    Raises:
        FileNotFoundError: if `path` is not a directory.
        ValueError: for a missing / unknown split or an unknown column.
        ImportError: if `datasets` is not installed.

    Example:
        >>> docs = hf_text_from_disk("data/my_dataset", split="train")  # doctest: +SKIP
    """
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"Hugging Face dataset path {str(path)!r} does not exist or is not a directory; expected the "
            f"directory written by Dataset.save_to_disk (load_from_disk never downloads)."
        )
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(_MSG_NO_DATASETS) from e
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        if split is None:
            if len(names) != 1:
                raise ValueError(f"{str(path)!r} holds a DatasetDict with splits {names}; pass split=... to pick one.")
            split = names[0]
        if split not in ds:
            raise ValueError(f"split={split!r} is not in the DatasetDict at {str(path)!r}; splits: {names}.")
        ds = ds[split]
    elif split is not None:
        raise ValueError(
            f"{str(path)!r} holds a single Dataset (no splits), but split={split!r} was given; "
            f"pass split=None."
        )
    return HFTextColumn(ds, field=field)
