"""A BalancedLoader as a torch ``IterableDataset`` (torch is imported only when one is asked for)."""

from __future__ import annotations

from typing import Any

_VIEW: list[type] = []  # the IterableDataset view class, made on first use (torch is imported only then)


def iterable_view(loader: Any) -> Any:
    """A BalancedLoader as a torch ``IterableDataset`` (torch is imported only when one is asked for)."""
    if not _VIEW:
        from torch.utils.data import IterableDataset  # torch only when a DataLoader view is asked for

        class LoaderView(IterableDataset):
            """A BalancedLoader as a torch IterableDataset: iteration continues the loader."""

            def __init__(self, loader: Any) -> None:
                self.loader = loader

            def __iter__(self) -> Any:
                return iter(self.loader)

            def __len__(self) -> int:
                return len(self.loader) - self.loader.step

        _VIEW.append(LoaderView)
    return _VIEW[0](loader)
