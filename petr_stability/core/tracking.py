"""Which dataset indices each training iteration consumed, on this rank, whatever the dataset carries.

A loader's index source (its batch sampler, or its sampler where it has none) is wrapped once by a
:class:`~.skiplist.QuarantineSampler` that records every batch of indices it yields; the guard asks at
each iteration which of them is the batch in hand. Every torch ``DataLoader`` iterator counts the batches it
returned (``_num_yielded``), and batches come back in the order their indices were drawn, so the batch in hand
is the ``_num_yielded``-th one drawn in the iterator's pass: prefetching workers (``num_workers > 0``) and an MMEngine
resume that skips batches are counted right. This is the one module that knows torch ``DataLoader`` internals
(``_get_iterator``, ``_sampler_iter``, ``_num_yielded``, ``_send_idx``; all present from torch 1.9 to 2.14); where one
is missing the indices are unknown, never wrong.

An iterator that already started before the wrapper went in (MMEngine's ``IterBasedTrainLoop`` builds its iterator
with the loop; MMCV 1.x's ``IterBasedRunner`` draws its first batch before any hook) is *adopted*: its live index
stream is wrapped where it stands, and the batches it drew before that are unknown.
"""
from collections import deque
from typing import Any, Deque, List, Optional

from torch.utils.data import IterableDataset

from .samples import key
from .skiplist import QuarantineSampler

__all__ = ["SampleTracker"]

_MARK = "_petr_stability_tracked"


class SampleTracker:
    """The dataset indices of the batch in hand, and the quarantine applied to the indices a loader draws.

    Args:
        skip: the quarantined indices (a :class:`~.skiplist.SkipList`, or an empty set where the
            quarantine is off: the indices are still recorded).
        window: how many recent batches of indices are kept (enough for any prefetch depth). Defaults to 4096.
    """

    def __init__(self, skip: Any, window: int = 4096) -> None:
        self.skip = skip
        self._batches: Deque[List[int]] = deque(maxlen=window)
        self._first = 0  # the pass's sequence number of self._batches[0]
        self._iterator: Any = None  # the DataLoader iterator training consumes
        #: Why indices cannot be known for this loader (an iterable dataset), or None.
        self.unknowable: Optional[str] = None
        self.installed = False

    # ------------------------------------------------------------------ where the indices come from
    def install(self, loader: Any) -> bool:
        """Wraps ``loader``'s index source (idempotent); True when indices can be tracked from now on."""
        if isinstance(getattr(loader, "dataset", None), IterableDataset):
            self.unknowable = ("the training dataset is an IterableDataset: its samples have no dataset indices, so "
                               "only the ids the data carries can name them")
            return False
        attr = "batch_sampler" if getattr(loader, "batch_sampler", None) is not None else "sampler"
        current = getattr(loader, attr, None)
        if current is None:
            self.unknowable = f"the training loader has no {attr} to track"
            return False
        if not isinstance(current, QuarantineSampler):
            wrapper = QuarantineSampler(current, self.skip, on_pass=self._new_pass, on_yield=self._record)
            # DataLoader refuses to set sampler/batch_sampler after construction (a guard against user mistakes); the
            # wrapper yields the same batches, which is what that guard protects.
            object.__setattr__(loader, attr, wrapper)
        get_iterator = getattr(loader, "_get_iterator", None)
        if get_iterator is not None and not getattr(get_iterator, _MARK, False):
            def tracked() -> Any:
                self._iterator = get_iterator()
                return self._iterator

            setattr(tracked, _MARK, True)
            loader._get_iterator = tracked  # DataLoader.__iter__ makes each new (non-persistent) iterator here
        persistent = getattr(loader, "_iterator", None)
        if persistent is not None:  # persistent workers: DataLoader.__iter__ resets this one each epoch
            self._iterator = persistent
        self.installed = True
        return True

    def adopt(self, iterator: Any) -> None:
        """An iterator that drew indices before :meth:`install`: its live stream is tracked (and quarantined) from
        here; the batches it drew before are unknown."""
        stream = getattr(iterator, "_sampler_iter", None)
        if iterator is None or stream is None or getattr(iterator, _MARK, False) or iterator is self._iterator:
            return
        drawn = getattr(iterator, "_send_idx", getattr(iterator, "_num_yielded", None))
        if drawn is None:
            return
        self._new_pass(first=int(drawn))
        iterator._sampler_iter = iter(QuarantineSampler(stream, self.skip, on_yield=self._record))
        setattr(iterator, _MARK, True)
        self._iterator = iterator

    # ------------------------------------------------------------------ what the batch in hand is
    def current(self) -> Optional[List[int]]:
        """The dataset indices of the batch the running iteration trains on, or None where unknown. Host only."""
        yielded = getattr(self._iterator, "_num_yielded", None)
        if not isinstance(yielded, int) or yielded < 1:
            return None
        position = yielded - 1 - self._first
        if 0 <= position < len(self._batches):
            return list(self._batches[position])
        return None

    def _new_pass(self, first: int = 0) -> None:
        self._batches.clear()
        self._first = first

    def _record(self, item: Any) -> None:
        if len(self._batches) == self._batches.maxlen:
            self._first += 1  # the oldest batch falls out of the window
        self._batches.append([key(i) for i in item] if isinstance(item, (list, tuple)) else [key(item)])
