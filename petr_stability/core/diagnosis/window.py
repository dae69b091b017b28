"""State poisoned by a sample, traced to the sample: the window since a healthy snapshot replayed from it.

A sample with huge but finite values can make BatchNorm's ``running_var`` (or a StreamPETR-style memory kept as a
plain attribute) non-finite while every weight stays finite: the train-mode forward uses the batch's own statistics,
so nothing breaks until a health check reads the buffer, iterations later and on another batch, whose replay is
finite. :func:`trace_window` loads the healthy snapshot's model state, re-runs the forwards of the batches served
since then in train mode (no backward, no optimizer step: the weights stay the snapshot's, which is enough, as what
is looked for is a sample poisoning the state, not a trajectory), and stops at the first batch after which a buffer
or a plain-attribute tensor is non-finite. That batch's samples are then re-run one at a time from the state just
before it, each beside samples shown clean there (the last batch replayed clean, else the next one: a sample of huge
constant values alone has no variance to overflow, beside ordinary ones it does), else alone: a row is blamed only
when it poisons that state so, and the rows left must not (else the narrowing is ``ambiguous`` and the whole batch
is returned with that flag; where the next batch poisons the same state too, ``every_batch``, nobody is blamed).
The model, its modes, gradients, buffers, plain attributes and the RNG are put back exactly afterwards
(:class:`~.sandbox.ModelState`).

:func:`trace_incident` is the guard's call: it works out the window (the indices :class:`~..batches.BatchWatch`
recorded per iteration) and how to rebuild a batch from indices (the training loader's own ``collate_fn`` over its
dataset), and calls :func:`trace_window` only where the weights are finite and buffers or attributes are not.
"""
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..samples import named_samples
from ..watch.health import nonfinite_attributes, nonfinite_buffers
from .recorder import nonfinite_params
from .replay import total_loss
from .sandbox import ModelState, capture_rng, rank_local, restore_rng, unwrap

__all__ = ["poisoned_state", "trace_window", "trace_incident", "isolate_rows", "rebuilder", "window_samples",
           "window_evidence"]

#: How many iterations back a window may reach (the newest confirmed snapshot is normally a few hundred back).
MAX_WINDOW = 2048

Window = Sequence[Tuple[int, Optional[Sequence[int]]]]


def poisoned_state(model: nn.Module) -> List[str]:
    """Names of the floating buffers and plain-attribute tensors of ``model`` holding NaN/Inf (empty: clean), but for
    those non-finite by design (:mod:`~..watch.health`)."""
    return nonfinite_buffers(model) + nonfinite_attributes(model)


class _Replayer:
    """Runs one batch (train mode, rank-local) and reads what went non-finite: the state a forward poisoned
    (``test='poisons'``: no grad, no step), or the loss and gradients a forward and backward produced
    (``test='breaks'``)."""

    def __init__(self, model: nn.Module, rebuild: Callable[[Sequence[int]], Any],
                 forward_for: Callable[[Any], Optional[Callable[[], Any]]], test: str = "poisons") -> None:
        self.model, self.rebuild, self.forward_for, self.test = model, rebuild, forward_for, test
        self.forwards = 0

    def poisons(self, indices: Sequence[int]) -> List[str]:
        forward = self.forward_for(self.rebuild(list(indices)))
        if forward is None:
            raise RuntimeError("the adapter cannot re-run a batch")
        self.model.train()
        self.forwards += 1
        if self.test == "breaks":
            return self._breaks(forward)
        with torch.no_grad(), rank_local():
            forward()
        return poisoned_state(self.model)

    def _breaks(self, forward: Callable[[], Any]) -> List[str]:
        for p in self.model.parameters():
            p.grad = None
        with rank_local():
            loss = total_loss(forward())
            if loss is None:
                raise RuntimeError("the re-run gives no loss")
            if not bool(torch.isfinite(loss.detach()).all()):
                return ["loss"]
            if loss.requires_grad:
                loss.backward()
        return [n for n, p in self.model.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())][:4]


def _try(rep: _Replayer, indices: Sequence[int]) -> Tuple[Optional[bool], List[str]]:
    """Whether ``indices`` poison the state (None where they cannot be re-run, with the error)."""
    try:
        bad = rep.poisons(indices)
    except Exception as exc:  # a batch of one may be refused (BatchNorm wants >1 value per channel): unknown
        return None, [f"{type(exc).__name__}: {exc}"]
    return bool(bad), bad[:4]


def _reference(rep: _Replayer, before: ModelState, candidates: Sequence[Optional[Sequence[int]]]
               ) -> Tuple[Optional[List[int]], List[Optional[bool]]]:
    """Samples shown not to poison the state just before the culprit (the first candidate that stays clean from
    there), and what each candidate tried did."""
    tried: List[Optional[bool]] = []
    for candidate in candidates:
        if candidate:
            before.restore()
            poisons, _ = _try(rep, candidate)
            tried.append(poisons)
            if poisons is False:
                return list(candidate), tried
    return None, tried


def _narrow(rep: _Replayer, before: ModelState, indices: Sequence[int], clean: Optional[Sequence[int]],
            control: Optional[Sequence[int]]) -> Dict[str, Any]:
    """The rows of the culprit batch that poison the state from just before it, each re-run with samples shown
    clean there (a huge sample alone may have no variance to overflow: with ordinary ones it does), else alone."""
    reference, tried = _reference(rep, before, (clean, control))
    if reference is None and not clean and tried and tried[-1]:
        # No batch before it was clean, and the next one poisons the same state too: every batch does.
        return {"rows": [], "ambiguous": True, "every_batch": True, "row_evidence": [], "reference": None,
                "why": "the next batch poisons the state just before it too: every batch does, not one sample"}
    evidence: List[Dict[str, Any]] = []
    for row, index in enumerate(indices):
        before.restore()
        poisons, bad = _try(rep, [index] + (reference or []))
        evidence.append({"row": row, "index": int(index), "poisons": poisons,
                         **({"error": bad[0]} if poisons is None else {"poisoned": bad})})
    rows = [e["row"] for e in evidence if e["poisons"]]
    rest = [int(i) for r, i in enumerate(indices) if r not in rows]
    why = ""
    if not rows:
        why = "no sample of the batch poisons the state alone" + (" with samples shown clean" if reference else "")
    elif rest:
        before.restore()
        if _try(rep, rest)[0] is not False:
            why = "the samples left without those still poison the state (or cannot be re-run)"
    ambiguous = bool(why)
    return {"rows": list(range(len(indices))) if ambiguous else rows, "ambiguous": ambiguous, "every_batch": False,
            "row_evidence": evidence, "reference": reference, "why": why}


def _scan(rep: _Replayer, window: Window, report: Dict[str, Any]) -> Optional[Tuple[int, ModelState, List[str]]]:
    """Replays the window in order; the position of the first batch after which the state is poisoned, the state
    just before it and what it poisoned (None: no batch of the window did)."""
    for position, (_, indices) in enumerate(window):
        if not indices:
            report["unknown_batches"] += 1
            continue
        before = ModelState(rep.model)
        bad = rep.poisons(indices)
        report["replayed"].append([int(i) for i in indices])
        if bad:
            return position, before, bad
    return None


def trace_window(model: nn.Module, state: Mapping[str, torch.Tensor], window: Window,
                 rebuild: Callable[[Sequence[int]], Any], forward_for: Callable[[Any], Optional[Callable[[], Any]]],
                 reset: Optional[Callable[[nn.Module], Any]] = None) -> Dict[str, Any]:
    """Finds the batch (and within it the samples) that poisoned buffers or plain-attribute state.

    Args:
        model: the unwrapped model.
        state: the healthy snapshot's model state dict (buffers included).
        window: ``(iteration, dataset indices)`` of every batch trained since that snapshot, in order (indices None
            where unknown: skipped and counted).
        rebuild: the batch for a list of dataset indices, as the loader would collate it.
        forward_for: a zero-argument callable re-running a batch's training forward (the adapters'
            ``rerun_forward``), or None where it cannot.
        reset: called on the model after the state is loaded (temporal state started afresh: a snapshot holds no
            plain attributes, and a rollback resets them). Defaults to None.

    Returns:
        A JSON-ready report: ``found``, ``iteration`` / ``position`` (in ``window``) / ``indices`` of the culprit
        batch, ``rows`` blamed and their ``blamed`` indices, ``ambiguous`` (then ``rows`` is the whole batch) with
        ``why``, ``every_batch`` (the next batch poisons too: not one sample), ``poisoned`` (what went non-finite),
        ``row_evidence``, ``replayed`` (the batches re-run), ``unknown_batches``, ``forwards``, ``seconds``.
        ``error`` where the replay failed. The model and the RNG are as before, also on error.
    """
    t0 = time.perf_counter()
    model = unwrap(model)
    report: Dict[str, Any] = {"found": False, "window": [int(window[0][0]), int(window[-1][0])] if window else [],
                              "replayed": [], "unknown_batches": 0}
    saved, rng = ModelState(model, params=True), capture_rng()
    rep = _Replayer(model, rebuild, forward_for)
    try:
        model.load_state_dict(dict(state), strict=False)
        if reset is not None:
            reset(model)
        start = poisoned_state(model) + nonfinite_params(model)
        if start:
            report["why"] = f"the snapshot's own state is not finite ({', '.join(start[:3])})"
        else:
            hit = _scan(rep, window, report)
            if hit is None:
                report["why"] = "no batch of the window poisons the snapshot's state"
            else:
                position, before, bad = hit
                iteration, indices = window[position]
                control = next((list(i) for _, i in window[position + 1:] if i), None)
                clean = report["replayed"][-2] if len(report["replayed"]) > 1 else None
                narrowed = _narrow(rep, before, list(indices), clean, control)
                report.update(narrowed, found=not narrowed["every_batch"], iteration=int(iteration),
                              position=position, indices=[int(i) for i in indices], poisoned=bad[:8],
                              blamed=[int(indices[r]) for r in narrowed["rows"]])
    except Exception as exc:  # evidence only: a failed trace blames nobody
        report.update(found=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        saved.restore()
        restore_rng(rng)
    report["forwards"] = rep.forwards
    report["seconds"] = round(time.perf_counter() - t0, 4)
    return report


def trace_incident(model: nn.Module, loader: Any, state: Optional[Mapping[str, torch.Tensor]], since: int,
                   served: Window, forward_for: Callable[[Any], Optional[Callable[[], Any]]],
                   reset: Optional[Callable[[nn.Module], Any]] = None) -> Optional[Dict[str, Any]]:
    """The guard's call: :func:`trace_window` over the batches served after iteration ``since`` (the healthy
    snapshot's), where the live weights are finite and buffers or plain attributes are not; None where it does not
    apply (nothing poisoned, poisoned weights, no snapshot state, no loader to rebuild batches from).

    Args:
        model: the unwrapped model.
        loader: the training loader (its ``dataset`` and ``collate_fn`` rebuild a batch from indices).
        state: the healthy snapshot's model state dict, or None.
        since: the snapshot's iteration (1-based numbering: the state after that many iterations).
        served: ``(iteration, indices)`` per iteration trained, the one in hand included.
        forward_for: as for :func:`trace_window`.
        reset: as for :func:`trace_window`. Defaults to None.
    """
    model = unwrap(model)
    if state is None or getattr(loader, "dataset", None) is None or nonfinite_params(model):
        return None
    bad = poisoned_state(model)
    if not bad:
        return None
    window = [(int(it), idx) for it, idx in served if since < it][-MAX_WINDOW:]
    report = trace_window(model, state, window, rebuilder(loader), forward_for, reset)
    report["live_poisoned"] = bad[:8]
    report["since"] = int(since)
    return report


def rebuilder(loader: Any) -> Callable[[Sequence[int]], Any]:
    """A batch for a list of dataset indices, as the training loader collates it (its ``dataset`` and
    ``collate_fn``)."""
    collate = getattr(loader, "collate_fn", None) or (lambda samples: samples)
    dataset = loader.dataset

    def rebuild(indices: Sequence[int]) -> Any:
        return collate([dataset[i] for i in indices])

    return rebuild


def isolate_rows(model: nn.Module, state: Mapping[str, torch.Tensor], indices: Sequence[int],
                 rebuild: Callable[[Sequence[int]], Any], forward_for: Callable[[Any], Optional[Callable[[], Any]]],
                 clean: Optional[Sequence[int]] = None, reset: Optional[Callable[[nn.Module], Any]] = None
                 ) -> Dict[str, Any]:
    """The samples of a batch that break the healthy state by themselves: the evidence that names a sample of a batch
    that broke (never having been in it).

    From ``state`` (the healthy snapshot's model state), each row is re-run, forward and backward, rank-local, beside
    ``clean`` samples where those are shown not to break it there (the batch known to be good), else alone; a row is
    blamed when it breaks (a non-finite loss or gradient) and the rows left do not. Every row breaking with no sample
    shown clean is ``ambiguous``: nobody is blamed (a state that breaks every batch is no evidence about one sample).
    The model and the RNG are put back exactly afterwards.

    Args:
        model: the unwrapped model.
        state: the healthy state dict (buffers included).
        indices: the batch's dataset indices, one per row.
        rebuild: the batch for a list of indices (:func:`rebuilder`).
        forward_for: as for :func:`trace_window`.
        clean: indices of samples expected to train fine there (the last healthy iteration's). Defaults to None.
        reset: as for :func:`trace_window`. Defaults to None.

    Returns:
        A JSON-ready report: ``blamed`` (indices), ``rows``, ``ambiguous`` with ``why``, ``row_evidence``,
        ``reference``, ``forwards``, ``seconds``; ``error`` where the re-run failed (nobody blamed then).
    """
    t0 = time.perf_counter()
    model = unwrap(model)
    saved, rng = ModelState(model, params=True), capture_rng()
    rep = _Replayer(model, rebuild, forward_for, test="breaks")
    report: Dict[str, Any] = {"blamed": [], "rows": [], "ambiguous": False}
    try:
        model.load_state_dict(dict(state), strict=False)
        if reset is not None:
            reset(model)
        before = ModelState(model)
        narrowed = _narrow(rep, before, list(indices), clean, None)
        if narrowed["rows"] and not narrowed["ambiguous"] and narrowed["reference"] is None and \
                len(narrowed["rows"]) == len(indices) > 1:
            narrowed.update(ambiguous=True, why="every sample breaks the healthy state alone and none was shown "
                                                "to train fine there")
        if narrowed["ambiguous"]:
            narrowed["rows"] = []
        report.update(narrowed, blamed=[int(indices[r]) for r in narrowed["rows"]])
    except Exception as exc:  # evidence only: a failed re-run blames nobody
        report.update(blamed=[], rows=[], error=f"{type(exc).__name__}: {exc}")
    finally:
        saved.restore()
        restore_rng(rng)
    report["forwards"] = rep.forwards
    report["seconds"] = round(time.perf_counter() - t0, 4)
    return report


def window_samples(report: Optional[Mapping[str, Any]], dataset: Any = None) -> List[Dict[str, Any]]:
    """The samples a diagnosis report's window trace blames (dataset ``index`` and the ids the dataset's infos give),
    or [] where it found none."""
    window = (report or {}).get("window") or {}
    if not window.get("found"):
        return []
    return named_samples([int(i) for i in window.get("blamed") or []], None, dataset)


def window_evidence(window: Mapping[str, Any]) -> str:
    """The evidence sentence for a found window trace: the buffer, the batch, the samples."""
    live = ", ".join((window.get("live_poisoned") or [])[:3])
    what = ", ".join((window.get("poisoned") or [])[:3])
    rows = ("the whole batch (not narrowed: " + str(window.get("why")) + ")" if window.get("ambiguous")
            else f"sample(s) {window.get('blamed')} (each poisons it beside samples shown clean, the others do not)")
    return (f"the weights are finite but the state is not ({live}); replayed from the state of iter "
            f"{window.get('since')}, the batch of iter {window.get('iteration')} (dataset indices "
            f"{window.get('indices')}) is the first to make {what} non-finite: {rows}")
