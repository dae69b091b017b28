"""The incident log: one JSON object per line in the run's work dir, written by rank 0 only."""
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional

__all__ = ["INCIDENT_FILE", "IncidentLog", "read_incidents", "iter_json_lines"]

#: File name of the incident log inside the work dir.
INCIDENT_FILE = "nan_guard_incidents.jsonl"


class IncidentLog:
    """Appends incident records as JSON lines.

    Args:
        work_dir: the run's work dir; the log is ``<work_dir>/nan_guard_incidents.jsonl``.
        enabled: False on every rank but 0, so that exactly one file exists per run.
    """

    def __init__(self, work_dir: Optional[str], enabled: bool = True) -> None:
        self.path = os.path.join(work_dir, INCIDENT_FILE) if work_dir else None
        self.enabled = enabled and self.path is not None

    def write(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = dict(record)
        record.setdefault("time", time.strftime("%Y-%m-%d %H:%M:%S"))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_incidents(path: str) -> List[Dict[str, Any]]:
    """Reads the incident records of a run.

    Args:
        path: the log file, or a work dir holding ``nan_guard_incidents.jsonl``.

    Returns:
        The records in order; an absent file gives an empty list. A torn last line (a process killed while
        writing) is ignored.
    """
    if os.path.isdir(path):
        path = os.path.join(path, INCIDENT_FILE)
    if not os.path.exists(path):
        return []
    return list(iter_json_lines(path))


def iter_json_lines(path: str) -> Iterator[Dict[str, Any]]:
    """Yields the JSON object of each line of ``path``; blank and torn lines (a killed writer) are skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
