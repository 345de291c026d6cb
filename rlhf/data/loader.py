"""A deterministic, resumable batch loader over a map-style dataset."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

__all__ = ["StatefulPromptLoader"]


class StatefulPromptLoader:
    """Deterministic, resumable batch iterator over a map-style dataset.

    Epoch ``e`` visits ``np.random.default_rng([seed, e]).permutation(len(dataset))`` (or
    ``arange`` without shuffle) in consecutive chunks of ``batch_size``. ``iter(loader)``
    yields the REST of the current epoch and then moves to the next epoch, so
    ``for epoch in range(E): for batch in loader: ...`` works and so does resuming mid-epoch.
    :meth:`next_batch` / :meth:`iter_forever` cross epoch boundaries automatically.

    ``state_dict()`` returns ``{"epoch", "step_in_epoch"}`` counting batches already
    *yielded*; a loader restored with :meth:`load_state_dict` yields exactly the batches
    the original would have yielded next (an epoch-end state is normalized to
    ``{"epoch": e + 1, "step_in_epoch": 0}``).

    Args:
        dataset: supports ``len`` and ``__getitem__``.
        batch_size: items per batch.
        shuffle: seeded permutation per epoch.
        seed: base seed.
        drop_last: drop the final partial batch of each epoch.
        collate_fn: maps a list of items to a batch; default ``dataset.collate`` if the
            dataset has it, else the list itself.

    Raises:
        ValueError: ``batch_size < 1``, empty dataset, or ``drop_last`` with fewer items
            than ``batch_size`` (no batch would ever be produced).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
    ):
        if batch_size < 1:
            raise ValueError(f"StatefulPromptLoader: batch_size={batch_size} must be >= 1.")
        n = len(dataset)
        if n == 0:
            raise ValueError("StatefulPromptLoader: dataset is empty.")
        if drop_last and n < batch_size:
            raise ValueError(
                f"StatefulPromptLoader: dataset has {n} items < batch_size={batch_size} with drop_last=True, "
                "so no batch would be produced; lower batch_size or use drop_last=False."
            )
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        if collate_fn is None:
            collate_fn = getattr(dataset, "collate", None) or (lambda items: items)
        self.collate_fn = collate_fn
        self.epoch = 0
        self.step_in_epoch = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices visited in ``epoch`` (length ``len(dataset)``)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(n)

    def batch_indices(self, epoch: int, step: int) -> List[int]:
        """Dataset indices of batch ``step`` of ``epoch``."""
        order = self.epoch_order(epoch)
        return [int(i) for i in order[step * self.batch_size:(step + 1) * self.batch_size]]

    def _normalize(self) -> None:
        if self.step_in_epoch >= len(self):
            self.epoch += 1
            self.step_in_epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self._normalize()
        epoch = self.epoch
        order = self.epoch_order(epoch)
        nb = len(self)
        while self.epoch == epoch and self.step_in_epoch < nb:
            s = self.step_in_epoch
            idx = order[s * self.batch_size:(s + 1) * self.batch_size]
            self.step_in_epoch = s + 1  # count the batch as consumed once handed out
            yield self.collate_fn([self.dataset[int(i)] for i in idx])
        self._normalize()

    def next_batch(self) -> Any:
        """The next batch, rolling over into the next epoch when needed."""
        self._normalize()
        idx = self.batch_indices(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        return self.collate_fn([self.dataset[i] for i in idx])

    def iter_forever(self) -> Iterator[Any]:
        """Yield batches endlessly across epochs."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch": int, "step_in_epoch": int}`` (batches already yielded in that epoch)."""
        if self.step_in_epoch >= len(self):
            return {"epoch": self.epoch + 1, "step_in_epoch": 0}
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict` (extra keys are ignored).

        Raises:
            KeyError: a required key is missing.
            ValueError: negative values or ``step_in_epoch`` beyond the epoch length.
        """
        missing = [k for k in ("epoch", "step_in_epoch") if k not in state]
        if missing:
            raise KeyError(f"StatefulPromptLoader.load_state_dict: missing keys {missing} in {state!r}.")
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or step < 0 or step > len(self):
            raise ValueError(
                f"StatefulPromptLoader.load_state_dict: invalid state {state!r} for {len(self)} batches per epoch."
            )
        self.epoch, self.step_in_epoch = epoch, step
        self._normalize()
