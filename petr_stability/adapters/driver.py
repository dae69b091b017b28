"""The one driver: the order of the guard's work over a training run, for every runner family.

Each runner family's hook builds a :class:`~petr_stability.core.port.GuardIO` for its runner and calls the driver
at its lifecycle points; the driver decides what happens there and in which order:

============================  =========================================================================
driver call                   what happens, in order
============================  =========================================================================
``bind(io)``                  the guard is built (a resumed state can be loaded from here on)
``load_state(state)``         a checkpoint's guard state (``resume``): counters, remedies, run id
``start()``                   the work dir checked (rank 0), clip probes installed, resumed remedies
                              re-applied, start state kept, pre-flight findings logged
``before_epoch()``            the sample tracker (and quarantine) into the training loader, once it exists
``before_iter(batch)``        the batch (a reference), its dataset indices and the RNG state (a host copy) kept
``after_iter()``              verdict, snapshot or recovery; state stored for the next save; on giving up
                              the runner's files are left pointing at finite ones, then the error; writes
                              that failed are tried again
``after_epoch(healthy)``      an agreed health check outside a step (a save the step did not see)
``before_save(ckpt)``         the checkpoint is finite (else recovered first, single process) and carries
                              the guard's state
``after_load(ckpt, resume)``  a non-finite checkpoint is refused; ``resume`` restores the guard's state
``finish()``                  the run's end: a replica check still in flight read; writes that failed are
                              tried a last time
============================  =========================================================================

After every incident (and on giving up) rank 0 writes ``<work_dir>/nan_guard_patched_config.py``. A write that
fails (the incident log, the patched config) never ends a run the guard saved: it is held in memory, one warning
names the path, and it is tried again after every iteration (the patched config once the work dir takes a new file
again: a cheap check) and at the run's end, where the records that still cannot be written go into the runner's log
in full.
"""
import os
import tempfile
from typing import Any, Callable, Dict, Optional, Sequence

from ..configfix import ConfigFix, check_runner_config, log_findings, read_config, write_patched_config
from ..core.config import GuardConfig
from ..core.diagnosis.sandbox import capture_rng
from ..core.distributed import get_rank, get_world_size, is_distributed
from ..core.errors import NanGuardError, UnsafeCheckpointError, UnwritableWorkDirError
from ..core.guard import NanGuard
from ..core.port import GuardIO, RunConfig
from ..core.records import INCIDENT_EVENTS, INCIDENT_FILE, Event
from ..core.recovery.restore import check_checkpoint, checkpoint_finite
from ..core.watch.health import by_design

__all__ = ["PATCHED_CONFIG_FILE", "STATE_KEY", "GuardDriver", "DrivenHook", "write_config_fix", "unwritable",
           "check_work_dir"]

#: File the driver writes into the work dir after an incident, so that the next run starts stable.
PATCHED_CONFIG_FILE = "nan_guard_patched_config.py"
#: Key of the guard's state in a checkpoint (MMEngine) or in ``runner.meta`` (MMCV 1.x).
STATE_KEY = "nan_guard"


class GuardDriver:
    """Runs the guard over one training run; the runner hooks only forward their lifecycle points to it.

    Args:
        config: the guard's settings (the hook's arguments).
    """

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.io: Optional[GuardIO] = None
        self.guard: Optional[NanGuard] = None
        #: True between an iteration's start and the end of its epoch (the loop's own counter increment follows
        #: the iteration's last hook): decides how the runner's counter converts to completed iterations.
        self.inside = False
        #: The run's effective config, read once at the start for every patched config the run writes.
        self._run_config: Optional[RunConfig] = None
        #: A patched config the work dir did not take: written as soon as it does.
        self._config_held = False

    def bind(self, io: GuardIO) -> NanGuard:
        """Builds the guard over ``io`` (at the run's start, before any checkpoint is loaded)."""
        self.io = io
        self.guard = NanGuard(self.config, io)
        self.guard.incidents.log = io.log  # a write that fails is reported in the runner's log
        return self.guard

    def load_state(self, state: Optional[Dict[str, Any]]) -> None:
        """Restores the guard's state saved in a checkpoint (a resumed run keeps remedies, counters, run id)."""
        if state:
            self.guard.load_state_dict(state)

    def start(self) -> None:
        """Before the first iteration: the work dir, probes, resumed remedies, the start state, pre-flight findings.

        Raises:
            UnwritableWorkDirError: rank 0 cannot write the incident log or the patched config into the work dir.
        """
        if get_rank() == 0 and self.io.work_dir:
            configs = [PATCHED_CONFIG_FILE] if self.config.write_patched_config else []
            check_work_dir(self.io.work_dir, [INCIDENT_FILE] + configs)
        self.io.install_probes(self.config.skip_nonfinite_fp32)
        self.guard.setup()
        self.guard.capture_start()
        self.guard.attach_data()  # before the loader's first batch where the runner has built it by now
        self.io.store_state(self.state_dict())
        for notice in self.config.notices if get_rank() == 0 else ():
            self.io.log(f"NanGuard: {notice}", "warning")
        self._log_preflight()
        self._run_config = self._read_run_config()

    def before_epoch(self) -> None:
        """As an epoch starts, before its loader's iterator exists: the sample tracker goes in."""
        self.guard.attach_data()

    def before_iter(self, batch: Any = None) -> None:
        """As an iteration starts: what a diagnosis of it would need (a reference and a host RNG copy)."""
        self.inside = True
        self.guard.begin(batch, capture_rng() if self.config.diagnose else None)

    def after_iter(self) -> None:
        """After the iteration's optimizer step (and, in MMCV 1.x, its checkpoint save)."""
        self._guarded(self.guard.after_iter)
        self.io.store_state(self.state_dict())
        self.io.after_step()
        if self.guard.incidents.held:  # records a failed write kept: a cheap try after every iteration
            self.guard.incidents.flush()
        if self._config_held:
            self._write_config()

    def after_epoch(self, healthy_here: Optional[bool] = None) -> None:
        """The epoch's last iteration was counted (also the end of an iteration-based run); with ``healthy_here``, an
        agreed health check outside a step (MMCV 1.x: the epoch's checkpoint was written before this point)."""
        self.inside = False
        if self.guard.agreement.pending or self.guard.replicas.pending is not None:
            # issue 35: the last step's verdict, still being agreed under a process group, is acted on first (and a
            # replica check still in flight read, issue 41); a rollback there restored a healthy state, which a
            # reading taken before it no longer describes.
            if self._guarded(lambda: self.guard.settle(inside=False)):
                healthy_here = None
        elif healthy_here is None:
            return
        if healthy_here is not None and not self.guard.all_ranks_healthy(healthy_here):
            self._guarded(lambda: self.guard.recover_now("non-finite state at the end of the epoch", inside=False))
        self.io.store_state(self.state_dict())
        self.io.after_step()

    def before_save(self, checkpoint: Dict[str, Any], refill: Callable[[Dict[str, Any], int], None]) -> None:
        """A checkpoint about to be written: finite, and carrying the guard's state.

        Args:
            checkpoint: the dict being saved (edited in place).
            refill: rewrites ``checkpoint`` from the live state after a recovery, given the completed iterations.
        """
        if not checkpoint_finite(checkpoint, by_design(self.io.model())):
            if is_distributed():
                # Saves run on rank 0 alone, where no collective may run; after_iter already checked this state
                # on every rank, so this save comes from outside the train loop: refuse it.
                raise UnsafeCheckpointError("NanGuard: refusing to save a checkpoint with non-finite values")
            self._guarded(lambda: self.guard.recover_now("non-finite state found while saving a checkpoint",
                                                         inside=self.inside), give_up=False)
            refill(checkpoint, self.io.completed(self.inside)[0])
        checkpoint[STATE_KEY] = self.state_dict()

    def after_load(self, checkpoint: Dict[str, Any], resuming: bool, state: Optional[Dict[str, Any]]) -> None:
        """A checkpoint was loaded: refuse a non-finite one; on ``resume`` take the guard's state from it."""
        try:
            check_checkpoint(checkpoint, "the checkpoint being loaded", by_design(self.io.model()))
        except UnsafeCheckpointError:
            self.io.log("NanGuard: refusing a non-finite checkpoint", "error")
            raise
        if resuming:
            self.load_state(state)

    def finish(self) -> None:
        """The run's end: a held patched config and held records are written a last time; records that still cannot
        be written go into the runner's log in full."""
        if self.guard.replicas.pending is not None:  # a check of the run's last iterations, read by every rank here
            self._guarded(lambda: self.guard.settle(inside=False))
        if self._config_held:
            self._write_config()
        self.guard.incidents.close()

    def state_dict(self) -> Dict[str, Any]:
        """The guard's state, as checkpoints carry it."""
        return self.guard.state_dict()

    # ------------------------------------------------------------------ internals
    def _guarded(self, step: Callable[[], Any], give_up: bool = True) -> Any:
        try:
            result = step()
        except NanGuardError:
            self._after_records()
            if give_up:
                self.io.before_give_up()
                self.guard.incidents.close()  # the give-up record too: on disk, or in the log
            raise
        self._after_records()
        return result

    def _after_records(self) -> None:
        # After every incident (and on giving up) the patched config follows the guard's records.
        records = self.guard.take_records()
        if not any(r.get("event") in INCIDENT_EVENTS + (Event.GAVE_UP, Event.RECURRING_SAMPLE) for r in records):
            return
        if self.config.write_patched_config and get_rank() == 0 and self.io.work_dir:
            self._write_config()

    def _read_run_config(self) -> Optional[RunConfig]:
        """The run's config, read into plain dicts once (rank 0, where patched configs are written); the runner's
        own object where it cannot be read (the write says why, then)."""
        run_config = self.io.run_config()
        if run_config is None or run_config.config is None or get_rank() != 0 or not self.config.write_patched_config:
            return run_config
        try:
            return RunConfig(read_config(run_config.config, self.io.work_dir), run_config.filename)
        except Exception:  # noqa: BLE001 (the write after an incident reads it again, and logs why it cannot)
            return run_config

    def _write_config(self) -> None:
        # Written from the remedies' entries, so a later try writes every setting in force by then. The work dir is
        # checked first (cheap): a config held there is tried again after every iteration at that cost only.
        problem = unwritable(os.path.join(self.io.work_dir, PATCHED_CONFIG_FILE))
        if problem:
            if not self._config_held:
                self.io.log(f"NanGuard: could not write the patched config: {problem}; the run goes on, and the "
                            "settings are written there as soon as it takes writes again", "warning")
            self._config_held = True
            return
        if self._config_held:
            self.io.log("NanGuard: the work dir takes writes again: writing the held patched config")
        self._config_held = False
        write_config_fix(self._run_config or self.io.run_config(), self.io.work_dir, self.guard.config_fix(),
                         self.io.log)

    def _log_preflight(self) -> None:
        # The same checks as `petr-stability check`, on the run's effective config and its real world size;
        # rank 0 alone, so that an 8-GPU job does not log every finding 8 times. Never fails the run.
        run_config = self.io.run_config()
        if run_config is None or get_rank() != 0:
            return
        try:
            findings = check_runner_config(run_config.config, get_world_size(), log=self.io.log)
            log_findings(findings, self.io.log)
        except Exception as exc:
            self.io.log(f"NanGuard: pre-flight check failed ({type(exc).__name__}: {exc}); training goes on",
                        "warning")


class DrivenHook:
    """What every runner family's ``NanGuardHook`` shares: a :class:`GuardDriver` and read access to its guard."""

    driver: GuardDriver

    @property
    def config(self) -> GuardConfig:
        """The hook's validated arguments."""
        return self.driver.config

    @property
    def guard(self) -> Optional[NanGuard]:
        """The guard of the running run (None before ``before_run``)."""
        return self.driver.guard


def write_config_fix(run_config: Optional[RunConfig], work_dir: str, fix: ConfigFix,
                     log: Callable[..., None]) -> Optional[str]:
    """Writes ``<work_dir>/nan_guard_patched_config.py``: the run's effective config with ``fix`` applied.

    Args:
        run_config: the run's effective config and the file it came from, or None.
        work_dir: the run's work dir.
        fix: the settings the guard put in force (:meth:`~petr_stability.core.guard.NanGuard.config_fix`).
        log: the adapter's logger.

    Returns:
        The path written, or None (no config, or one the patcher cannot read: logged, never raised, because a
        failure here must not end a recovered run).
    """
    if run_config is None or run_config.config is None:
        log("NanGuard: the runner holds no config; skipped writing a patched config", "warning")
        return None
    out = os.path.join(work_dir, PATCHED_CONFIG_FILE)
    original = run_config.filename if run_config.filename and os.path.isfile(run_config.filename) else None
    try:
        result = write_patched_config(run_config.config, out, fix, original_path=original, base_dir=work_dir)
    except Exception as exc:  # a config the patcher cannot read must not end a recovered run
        log(f"NanGuard: could not write a patched config ({type(exc).__name__}: {exc})", "warning")
        return None
    log(f"NanGuard: {result.summary}: start the next run from it to keep these settings (docs/troubleshooting.md)")
    for note in result.notes:
        log(f"NanGuard:   note: {note}", "warning")
    return out


def unwritable(path: str) -> Optional[str]:
    """Why ``path`` cannot be written, naming the path, or None where it can.

    Tried, not read from mode bits (root ignores a read-only mode; a read-only file system or a full quota does
    not): a file is created and removed beside ``path``, and an existing ``path`` is opened for appending (nothing
    is written to it).
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".nan_guard_write_check_", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        return f"cannot create a file in {directory} ({exc.strerror or exc})"
    if os.path.isdir(path):
        return f"{path} is a directory"
    if os.path.exists(path):
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return f"cannot append to {path} ({exc.strerror or exc})"
    return None


def check_work_dir(work_dir: str, files: Sequence[str]) -> None:
    """Raises :class:`~petr_stability.core.errors.UnwritableWorkDirError` naming the path where one of ``files``
    (names in ``work_dir``) cannot be written.

    Args:
        work_dir: the run's work dir.
        files: the names of the files the guard writes there.
    """
    for name in files:
        problem = unwritable(os.path.join(work_dir, name))
        if problem:
            raise UnwritableWorkDirError(
                f"NanGuard: the work dir does not take the guard's records: {problem}. The guard writes "
                f"{', '.join(files)} there as it saves a run; make {work_dir} writable (or give the run another "
                "work_dir) and start again")
