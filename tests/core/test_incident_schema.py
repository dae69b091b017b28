"""The incident record as docs/incidents.md documents it: each event type is produced by a small guarded run (a
plain-torch loop behind the driver) and every field the doc's table lists for it is read back from the file, and
every field found in the file is in the table (the doc and the code cannot drift apart)."""
import math
import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import pytest
import torch
from torch import nn

from petr_stability import read_incidents
from petr_stability.adapters.driver import GuardDriver
from petr_stability.adapters.torch_loop import TorchLoopIO
from petr_stability.core.config import GuardConfig
from petr_stability.core.errors import NanGuardGaveUp
from petr_stability.core.faults import arm_grad_fault, poison_weights
from petr_stability.core.recovery.chain import OWN_VALUES
from petr_stability.core.remedies import Change

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "incidents.md")
COMMON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "distributed", "common")
EVENTS = ("divergence", "stalled", "gave_up", "skip", "nonfinite_loss", "recurring_sample", "replica_drift")
#: Fields whose value is an object (or a list of objects) that the table documents key by key.
NESTED = ("signals", "restored_from", "actions", "cause", "tensors")


# ------------------------------------------------------------------ the doc's table
def documented() -> Dict[str, Tuple[Set[str], Set[str]]]:
    """field -> (events that always carry it, events that carry it only under a stated condition)."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Fields", 1)[1].split("\n## ", 1)[0]
    rows: Dict[str, Tuple[Set[str], Set[str]]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        field = re.match(r"`([^`]+)`", cells[0]).group(1)
        always: Set[str] = set()
        sometimes: Set[str] = set()
        for part in re.split(r",\s*(?![^()]*\))", cells[1]):
            name = part.split("(")[0].strip()
            names = set(EVENTS) if name == "all" else {name}
            assert names <= set(EVENTS), f"docs/incidents.md: unknown event {name!r} for field {field!r}"
            (sometimes if "(" in part else always).update(names)
        rows[field] = (always, sometimes)
    return rows


def paths(record: Dict[str, Any]) -> Set[str]:
    """The record's fields as the table names them: ``signals.loss``, ``actions[].target``."""
    out = set()
    for key, value in record.items():
        out.add(key)
        if key in NESTED and isinstance(value, dict):
            out.update(f"{key}.{k}" for k in value)
        elif key in NESTED and isinstance(value, list):
            out.update(f"{key}[].{k}" for item in value for k in item)
    return out


def present(record: Dict[str, Any], field: str) -> bool:
    """Whether ``field`` is in ``record``; a nested field under a null parent (or an empty list) counts as present."""
    if "." not in field:
        return field in record
    parent, key = field.split(".", 1)
    if parent.endswith("[]"):
        items = record.get(parent[:-2])
        return isinstance(items, list) and all(key in item for item in items)
    value = record.get(parent)
    return value is None or key in value


# ------------------------------------------------------------------ a small guarded run
class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(x)).mean()


class LoopIO(TorchLoopIO):
    """TorchLoopIO with a scale mode to choose (``'none'`` fp32, or a static scale of 512 that the stall remedy
    turns dynamic) and a forward to re-run for the diagnosis."""

    def __init__(self, work_dir: str, mode: str = "none") -> None:
        self.lines: List[str] = []
        net = TinyTransformer()
        super().__init__(net, torch.optim.SGD(net.parameters(), lr=0.01), None, {"max_norm": 35.0, "norm_type": 2},
                         work_dir, log_fn=self.lines.append, config={"model": {"type": "TinyTransformer"}})
        self.mode = mode

    def install_probes(self, skip_nonfinite_fp32: bool) -> None:
        self.probe.skip_nonfinite = skip_nonfinite_fp32 and self.mode == "none"

    def scale_mode(self) -> str:
        return self.mode

    def loss_scale(self) -> Optional[float]:
        return None if self.mode == "none" else 512.0

    def make_scale_dynamic(self) -> Optional[Change]:
        if self.mode != "static":
            return None
        self.mode = "dynamic"
        return Change("loss_scale", "static 512", "dynamic")

    def rerun_forward(self, batch: Any) -> Optional[Callable[[], Any]]:
        return None if batch is None else (lambda: {"loss": self.net(batch["x"])})


Plant = Callable[..., Optional[float]]  # plants a fault (given the io and the batch); may return the loss to report


def run(work_dir: str, iters: int, plan: Dict[int, Plant], mode: str = "none", **guard: Any) -> LoopIO:
    """Trains ``iters`` iterations under the driver; ``plan[n]`` runs as iteration n (1-based) starts."""
    io = LoopIO(work_dir, mode)
    driver = GuardDriver(GuardConfig(**dict(dict(snapshot_interval=2, confirm_steps=2, check_interval=50), **guard)))
    driver.bind(io)
    driver.start()
    torch.manual_seed(1)
    # Batches carrying the dataset index of their one sample, as a collated dict does: the loop has no loader.
    data = [{"x": torch.randn(4, 2, 8), "index": torch.tensor([i])} for i in range(8)]
    step = 0
    while io.iter < iters:
        batch = dict(data[step % len(data)])
        io.epoch = step // len(data)
        step += 1
        plant = plan.pop(io.iter + 1, None)  # once: a rollback brings the number round again
        reported = plant(io, batch) if plant else None
        driver.before_iter(batch)
        loss = io.net(batch["x"])
        io.opt.zero_grad()
        loss.backward()
        norm = io.clip(io.net.parameters())
        if io.mode == "none" or math.isfinite(float(norm)):  # a loss scaler skips a non-finite step
            io.opt.step()
        io.last_loss = float(loss.detach()) if reported is None else reported
        driver.after_iter()
        io.iter += 1
    return io


def nan_weights(io: LoopIO, batch: Dict[str, Any]) -> None:
    poison_weights(io.net, math.nan, "out.weight")


def inf_grads(io: LoopIO, batch: Dict[str, Any]) -> None:
    arm_grad_fault(io.net, math.inf, "out.bias")


def nan_input(io: LoopIO, batch: Dict[str, Any]) -> None:
    batch["x"] = batch["x"].clone()
    batch["x"][0, 0, 0] = math.nan  # the sample's own values: the evidence that names it


def nan_logged_loss(io: LoopIO, batch: Dict[str, Any]) -> float:
    return math.nan  # a loss term that is logged but not backpropagated


def produce(event: str, work_dir: str) -> List[Dict[str, Any]]:
    """Runs the smallest guarded run that writes ``event``; returns every record of its incident log."""
    if event == "skip":
        run(work_dir, 5, {3: inf_grads})
    elif event == "nonfinite_loss":
        run(work_dir, 5, {3: nan_logged_loss})
    elif event == "stalled":
        run(work_dir, 8, {n: inf_grads for n in range(2, 7)}, mode="static", static_patience=5)
    elif event == "divergence":
        run(work_dir, 9, {1: nan_weights, 7: nan_weights})  # from the start state, then from a snapshot
    elif event == "recurring_sample":
        run(work_dir, 12, {3: nan_input, 11: nan_input})  # the sample of index 2, in epochs 0 and 1
    elif event == "gave_up":
        with pytest.raises(NanGuardGaveUp):
            run(work_dir, 6, {4: nan_weights}, max_recoveries=0)
    elif event == "replica_drift":  # two gloo ranks (a plain-torch loop under DDP); rank 1's weight drifts
        sys.path.insert(0, COMMON)
        try:
            from launch import run_workers
        finally:
            sys.path.remove(COMMON)
        run_workers(os.path.join(COMMON, "loop_worker.py"), "drift", work_dir)
        work_dir = os.path.join(work_dir, "work")
    return read_incidents(work_dir)


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Dict[str, List[Dict[str, Any]]]:
    return {e: produce(e, str(tmp_path_factory.mktemp(e))) for e in EVENTS}


# ------------------------------------------------------------------ the checks
def test_the_doc_lists_every_event_and_the_fields_every_record_has():
    rows = documented()
    for field in ("event", "iteration", "reason", "verdict", "time", "signals.iteration", "actions[].target"):
        assert rows[field][0] == set(EVENTS), field
    assert {"restored_from.source", "restored_from.iteration", "iterations_lost", "epoch"} <= set(rows)


@pytest.mark.parametrize("event", EVENTS)
def test_each_event_carries_every_field_the_doc_lists_for_it_and_no_other(records, event):
    rows = documented()
    mine = [r for r in records[event] if r["event"] == event]
    assert mine, f"the run meant to produce {event!r} wrote {[r['event'] for r in records[event]]}"
    for record in mine:
        for field, (always, _) in rows.items():
            if event in always:
                assert present(record, field), f"{event} record lacks {field!r}: {record}"
        undocumented = {p for p in paths(record) if p not in rows or event not in rows[p][0] | rows[p][1]}
        assert not undocumented, f"{event} record: docs/incidents.md does not list {sorted(undocumented)}"


def test_iterations_follow_the_one_convention(records):
    # 1-based iteration numbers; a state "at N" is the state after N iterations.
    skip, = [r for r in records["skip"] if r["event"] == "skip"]
    assert skip["iteration"] == skip["signals"]["iteration"] == 3
    assert skip["signals"]["step_applied"] is False and skip["signals"]["grad_norm"] == "inf"
    loss, = records["nonfinite_loss"]
    assert (loss["iteration"], loss["signals"]["loss"], loss["signals"]["step_applied"]) == (3, "nan", None)
    stalled, = [r for r in records["stalled"] if r["event"] == "stalled"]
    assert stalled["iteration"] == 6 and stalled["actions"] == [
        {"target": "loss_scale", "old": "static 512", "new": "dynamic"}]
    first, second = records["divergence"]
    # A fault in iteration 1: no snapshot exists yet, the run's start state (the state at 0) is the restore point.
    assert first["iteration"] == first["signals"]["iteration"] == 1 and first["epoch"] == 0
    assert first["restored_from"] == {"source": "start", "iteration": 0} and first["iterations_lost"] == 1
    assert first["recoveries"] == 1 and first["max_recoveries"] == 5 and first["world_size"] == 1  # this one counted
    # NaN written between two steps (the guard's fp32 skip dropped the failing one), the run's first divergence: a
    # rollback alone (issue 43); the second climbs the ladder to the known manual fix.
    assert first["cause"]["signals"]["rollback_alone"] is True and first["actions"] == []
    assert {"clip.max_norm", "layer.dropout.p"} <= {a["target"] for a in second["actions"]}
    assert {"target": "clip.max_norm", "old": 35.0, "new": 1.0} in second["actions"]
    # Iteration 7: snapshots every 2 iterations, confirmed after 2 clean steps: the one after iteration 4 is.
    assert second["iteration"] == 7 and second["restored_from"] == {"source": "memory", "iteration": 4}
    assert second["iterations_lost"] == 3 and second["recoveries"] == 2
    assert second["diagnosis"]["first"]["where"] == "parameter" and second["cause"]["cause"] == "dynamics"
    gave_up, = records["gave_up"]
    assert gave_up["iteration"] == 4 and gave_up["recoveries"] == 0 and "max_recoveries=0" in gave_up["why"]


def test_a_recurring_sample_is_named_once_by_its_index(records):
    skips = [r for r in records["recurring_sample"] if r["event"] == "skip"]
    assert [r["batch"] for r in skips] == [[{"index": 2}], [{"index": 2}]]
    assert all(s["samples"] == [{"index": 2, "evidence": OWN_VALUES}] for s in skips)
    (rec,) = [r for r in records["recurring_sample"] if r["event"] == "recurring_sample"]
    assert rec["iteration"] == 11 and rec["batch"] == [{"index": 2}]
    assert rec["quarantined"] is False and rec["reason"].startswith("made steps go wrong in epochs [0, 1]")
    assert "no training loader" in rec["reason"]  # a loop without a loader


def test_a_skipped_step_names_no_sample_without_evidence_about_it(records):
    # A gradient made Inf by the model (not by the sample's own values), in a loop without a loader to replay rows
    # from: the skip lists its batch, blames nobody, and nothing recurs however often it comes.
    (skip,) = [r for r in records["skip"] if r["event"] == "skip"]
    assert skip["batch"] == [{"index": 2}] and skip["samples"] == [] and skip["cause"] is None

