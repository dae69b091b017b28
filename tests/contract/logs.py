"""Reads back what a run showed its user: TensorBoard event files (in file order) and JSON-lines logs (strictly)."""
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple


def _no_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def strict_json_lines(path: str) -> List[Dict[str, Any]]:
    """Every line of a JSON-lines file, parsed strictly: ``NaN``, ``Infinity`` and ``-Infinity`` fail (Python's
    ``json.loads`` takes them by default; JSON has no such values)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line, parse_constant=_no_constant))
                except ValueError as exc:
                    raise AssertionError(f"{path}:{number}: {exc}: {line.strip()[:300]}") from exc
    return out


@dataclass
class Board:
    """One TensorBoard log dir, as written: scalars and texts in file order."""

    scalars: List[Tuple[str, int, float]] = field(default_factory=list)
    texts: List[Tuple[str, int, str]] = field(default_factory=list)

    def of(self, tag: str) -> List[Tuple[int, float]]:
        """(step, value) of one scalar tag, in the order written."""
        return [(step, value) for t, step, value in self.scalars if t == tag]


def read_board(log_dir: str) -> Tuple[Board, List[int]]:
    """The scalars and texts of every event file under ``log_dir``, and the steps of all events in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    board, order = Board(), []
    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True))
    assert files, f"no TensorBoard event file under {log_dir}"
    for path in files:
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                array = tensor_util.make_ndarray(value.tensor)
                if plugin == "text":  # torch's SummaryWriter.add_text names it '<tag>/text_summary'
                    tag = value.tag[:-len("/text_summary")] if value.tag.endswith("/text_summary") else value.tag
                    board.texts.append((tag, int(event.step), b"\n".join(array.flatten()).decode()))
                else:
                    board.scalars.append((value.tag, int(event.step), float(array)))
                order.append(int(event.step))
    return board, order
