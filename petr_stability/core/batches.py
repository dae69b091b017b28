"""The batch of each iteration on this rank: which dataset samples it holds, the last one known good, and which of
its samples hold bad values of their own.

Healthy steps pay host work only: a list lookup for the batch's indices (:class:`~.tracking.SampleTracker`) and a
reference to the batch and its RNG state, kept one iteration longer as *the last good batch*, the counterfactual
of a diagnosis (a batch known to be good, replayed on the same healthy weights, tells a bug from bad data).
"""
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import distributed
from .diagnosis import diagnose
from .port import GuardIO
from .samples import named_samples, suspect_rows
from .tracking import SampleTracker

__all__ = ["BatchWatch"]


class BatchWatch:
    """The batches of one run on this rank.

    Args:
        io: the runner adapter.
    """

    def __init__(self, io: GuardIO) -> None:
        self.io = io
        self.tracker = SampleTracker(skip=set())
        #: The running iteration's batch (a reference), its RNG state (a host copy) and dataset indices.
        self.batch: Any = None
        self.rng: Optional[Dict[str, Any]] = None
        self.indices: Optional[List[int]] = None
        #: The newest batch whose step was healthy, with its RNG state and 1-based iteration.
        self.good_batch: Any = None
        self.good_rng: Optional[Dict[str, Any]] = None
        self.good_iteration: Optional[int] = None
        #: Iterations this process trained before any step was healthy (all of them broke: skipped or overflowed).
        self.untrained = 0
        self.attached = False
        #: (iteration, dataset indices or None) of the iterations trained on the current path, newest last: the window
        #: a state poisoned since a snapshot is traced through (:mod:`.diagnosis.window`).
        self.served: Deque[Tuple[int, Optional[List[int]]]] = deque(maxlen=4096)
        #: The first iteration of the running accumulation window (gradients summed since then, stepped at its end).
        self.window_start = 1
        self._rewound: Optional[int] = None
        #: (batch, RNG state, indices) of the iteration whose verdict is still being agreed across ranks (one iteration
        #: later under a process group), set aside by :meth:`hold` until :meth:`take_held` brings it back in hand to be
        #: acted on and ended.
        self.held: Optional[Tuple[Any, Optional[Dict[str, Any]], Optional[List[int]]]] = None

    def attach(self, skip: Any, log: Callable[..., None]) -> None:
        """Tracks the training loader's indices (and applies ``skip`` to them) once the loader exists."""
        if self.attached:
            return
        loader = self.io.train_loader()
        if loader is None:
            return
        self.attached = True
        self.tracker.skip = skip
        if self.tracker.install(loader):
            self.tracker.adopt(self.io.live_loader_iterator())
        else:
            log(f"NanGuard: samples are named by the ids the data carries only: {self.tracker.unknowable}",
                "warning")

    def begin(self, batch: Any, rng: Optional[Dict[str, Any]]) -> None:
        """As an iteration starts (host work only)."""
        self.batch, self.rng = batch, rng
        self.indices = self.tracker.current()

    def end(self, iteration: int, healthy: bool, stepped: bool = True) -> None:
        """As the iteration's verdict is known: a healthy step's batch becomes the last good batch; an iteration that
        stepped closes the accumulation window (the next one starts after it)."""
        if self._rewound is not None and iteration > self._rewound:  # this very iteration was rolled back
            self._rewound = None
            self.untrained += self.good_batch is None
            self.batch = self.rng = self.indices = None
            return
        self._rewound = None
        while self.served and self.served[-1][0] >= iteration:  # after a rollback: the abandoned path's
            self.served.pop()
        self.served.append((iteration, self.indices))
        if stepped:
            self.window_start = iteration + 1
        if healthy and self.batch is not None:
            self.good_batch, self.good_rng, self.good_iteration = self.batch, self.rng, iteration
        elif self.good_batch is None:
            self.untrained += 1
        self.batch = self.rng = self.indices = None

    # -- issue 35 (agreement one iteration later): the batch in hand waits for its verdict one iteration longer
    def hold(self) -> None:
        """The batch in hand (with its RNG state and indices) waits for its verdict, agreed one iteration later: it
        is set aside, neither the last good batch nor served yet."""
        self.held = (self.batch, self.rng, self.indices)
        self.batch = self.rng = self.indices = None

    def take_held(self) -> Tuple[Any, Optional[Dict[str, Any]], Optional[List[int]]]:
        """Brings the held batch back in hand, its verdict come (a diagnosis replays it, :meth:`end` ends it); returns
        the running iteration's batch, set aside meanwhile: :meth:`put_back` it after, unless a rollback abandoned
        it."""
        running = (self.batch, self.rng, self.indices)
        self.batch, self.rng, self.indices = self.held or (None, None, None)
        self.held = None
        return running

    def put_back(self, running: Tuple[Any, Optional[Dict[str, Any]], Optional[List[int]]]) -> None:
        """The running iteration's batch back in hand (after :meth:`take_held`)."""
        self.batch, self.rng, self.indices = running

    def served_through(self, iteration: int) -> List[Tuple[int, Optional[List[int]]]]:
        """The iterations trained on the current path up to ``iteration``, the running one (the batch in hand)
        included."""
        return [(i, idx) for i, idx in self.served if i < iteration] + [(iteration, self.indices)]

    def window(self) -> List[Tuple[int, List[int]]]:
        """The earlier iterations of the running accumulation window, with their dataset indices (empty without
        accumulation: every iteration steps): the batches whose gradients the step in hand also applies."""
        return [(i, list(idx)) for i, idx in self.served if i >= self.window_start and idx]

    def rewind(self, iteration: int) -> None:
        """A rollback to the state at ``iteration``: the abandoned path's batches are forgotten and the next window
        starts after it (restore points are taken where a window closed)."""
        while self.served and self.served[-1][0] > iteration:
            self.served.pop()
        self.window_start = iteration + 1
        self._rewound = iteration

    def good_indices(self) -> Optional[List[int]]:
        """The dataset indices of the batch known to be good (the last healthy iteration's), or None."""
        return next((idx for i, idx in reversed(self.served) if i == self.good_iteration), None)

    def epoch_of(self, iteration: int) -> int:
        """The pass over the data an iteration belongs to: every ``len(dataset)`` samples (all ranks) is one, so
        iteration-based loops count too; the runner's epoch where that cannot be worked out."""
        size = self.io.dataset_size()
        per_iteration = len(self.samples()) * distributed.get_world_size()
        if size and per_iteration:
            return (iteration - 1) * per_iteration // size
        return self.io.counter()[1]

    # ------------------------------------------------------------------ naming samples
    def samples(self) -> List[Dict[str, Any]]:
        """The samples of the batch in hand: dataset ``index`` where known, and the ids the data (or the dataset's
        info at that index) carries."""
        return named_samples(self.indices, self.batch, self.io.dataset())

    def suspects(self, fp16: bool) -> List[Dict[str, Any]]:
        """The samples of the batch in hand to blame: those whose own values are non-finite (or out of fp16's range
        under fp16) where only some are, else all of them."""
        samples = self.samples()
        rows = suspect_rows(self.batch, len(samples), fp16) if samples else []
        return [samples[r] for r in rows] if rows else samples

    def flagged(self, fp16: bool) -> List[Dict[str, Any]]:
        """Only the samples whose own values are non-finite or out of fp16's range (a batch of one sample included):
        what an fp16 overflow, ordinary as most are, can be blamed on."""
        samples = self.samples()
        rows = suspect_rows(self.batch, len(samples), fp16) if samples else []
        return [samples[r] for r in rows]

    def replays_broken(self) -> bool:
        """This rank's batch re-run alone (forward and backward, rank-local) on the live weights is non-finite: its own
        batch broke, not only the all-reduced gradient it received. False where it cannot be re-run."""
        forward = self.io.rerun_forward(self.batch) if self.batch is not None else None
        if forward is None:
            return False
        try:
            return bool(diagnose(self.io.model(), forward, rng_state=self.rng, fp32_check=False)["reproduced"])
        except Exception:  # evidence only: a failed re-run blames nobody
            return False
