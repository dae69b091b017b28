"""One training run of a real detector from the user's clone (StreamPETR or megvii PETRv2), on CPU, guarded.

Run as ``python tests_seed/seed_run.py SPEC.json`` (the tests do, one process per run): the two projects both
name their package ``projects`` and register the same names (``Petr3D``, ``CustomNuScenesDataset``, ...) in
mmdet's registries, so they cannot share a process; a fresh process also gives every run fresh registries, RNG
and memory. The run goes through the projects' own entry points, as their ``tools/train.py`` calls them:

- StreamPETR: ``projects.mmdet3d_plugin.core.apis.train.custom_train_model`` (its ``build_dataloader`` with the
  config's ``InfiniteGroupEachSampleInBatchSampler`` under ``IterBasedRunner``, ``MMDataParallel``, the hooks);
- PETRv2: ``mmdet3d.apis.train_model`` (mmdet3d 1.0.0rc6's ``train_detector``, ``EpochBasedRunner``).

The model comes from the project's real config file (``mmcv.Config.fromfile``, its ``_base_`` files from the
clone's ``mmdetection3d``), built with ``mmdet3d.models.build_model``; the data from the project's own dataset
class and train pipeline, reading files written by :mod:`nusc_synth`. What the CPU size changes, and nothing
else, is listed in :func:`streampetr_config` / :func:`petrv2_config`. The CPU stand-ins are
:mod:`stand_ins`'s, applied around the whole run and undone after it.

Probe hooks (``SeedProbeHook``, priorities around the guard's) record, per iteration: the dataset indices and
tokens served, ``prev_exists``, StreamPETR's memory before the iteration and around the guard's
``after_train_iter`` (equal, finite, reset), loss, grad_norm, loss scale, the iteration's time and the guard's
own time, and the guard's host reads on healthy steps (``petr_stability.testing.reads.watch_healthy_steps``).
Everything goes into the JSON result file named by the spec; the incidents stay in the work dir.
"""
import contextlib
import importlib
import json
import math
import os
import random
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from stand_ins import cpu_stand_ins  # noqa: E402

#: StreamPETR's memory queue (``StreamPETRHead.reset_memory`` sets exactly these).
MEMORY_ATTRS = ("memory_embedding", "memory_reference_point", "memory_timestamp", "memory_egopose", "memory_velo")
STREAMPETR_CONFIG = "projects/configs/StreamPETR/stream_petr_r50_flash_704_bs2_seq_428q_nui_60e.py"
PETRV2_CONFIG = "projects/configs/petrv2/petrv2_vovnet_gridmask_p4_800x320.py"


# ---------------------------------------------------------------------------------------------- the configs
def _scale_aug(pipeline: List[Dict[str, Any]], transform: str, scale: float) -> Dict[str, Any]:
    """Scales the resize-crop step's image sizes (``H``, ``W``, ``final_dim``) by ``scale``; ``resize_lim`` is
    a ratio of ``W`` and stays as the config has it."""
    for step in pipeline:
        if step["type"] == transform:
            conf = dict(step["data_aug_conf"])
            conf["H"], conf["W"] = int(round(conf["H"] * scale)), int(round(conf["W"] * scale))
            conf["final_dim"] = tuple(int(round(d * scale)) for d in conf["final_dim"])
            step["data_aug_conf"] = conf
            return conf
    raise LookupError(f"no {transform} in the train pipeline")


def _insert_before(pipeline: List[Dict[str, Any]], before: str, step: Dict[str, Any]) -> None:
    for i, s in enumerate(pipeline):
        if s["type"] == before:
            pipeline.insert(i, step)
            return
    raise LookupError(f"no {before} in the train pipeline")


def _train_data(cfg: Any, spec: Dict[str, Any], resize: str, bundle: str, scale: float, batch_size: int) -> None:
    """The synthetic scenes as the train data: images scaled through the project's ``resize`` step (by
    ``spec['image_scale']``, else ``scale``), a corrupt frame injected before its ``bundle`` step where the spec asks
    for one, ``spec['batch_size']`` (else ``batch_size``) per GPU."""
    train = cfg.data.train
    train.data_root = spec["data_root"]
    train.ann_file = spec["ann_file"]
    _scale_aug(train.pipeline, resize, spec.get("image_scale", scale))
    if spec.get("corrupt"):
        _insert_before(train.pipeline, bundle, dict(type="InjectRawFrame", **spec["corrupt"]))
    cfg.data.samples_per_gpu = spec.get("batch_size", batch_size)


def _common(cfg: Any, spec: Dict[str, Any]) -> None:
    """Settings of every run: work dir, hooks, logging, checkpoints, the CPU GradScaler, seeds."""
    cfg.work_dir = spec["work_dir"]
    cfg.gpu_ids = [0]
    cfg.seed = spec.get("seed", 0)
    cfg.device = "cpu"
    cfg.resume_from = spec.get("resume_from")
    cfg.load_from = None
    cfg.data.workers_per_gpu = 0  # the loader in this process: the probes see which indices it served
    opt = dict(cfg.optimizer_config)
    opt["type"] = "CPUFp16OptimizerHook"  # MMCV's Fp16OptimizerHook with a CPU GradScaler (see stand_ins)
    if "loss_scale" in spec:
        # 'dynamic' starts MMCV's GradScaler at 2**16; a dict such as dict(init_scale=512.) starts it lower, so
        # that the scale's calibration (one skipped step per halving) takes 1-2 iterations instead of 7.
        opt["loss_scale"] = spec["loss_scale"]
    cfg.optimizer_config = opt
    # No checkpoint unless the run needs one (each holds ~0.5 GB of weights and optimizer state).
    cfg.checkpoint_config = dict(interval=spec.get("checkpoint_interval", 10 ** 6), max_keep_ckpts=3,
                                 save_last=bool(spec.get("checkpoint_interval")))
    cfg.log_config = dict(interval=1, hooks=[dict(type="TextLoggerHook")])
    hooks: List[Dict[str, Any]] = [dict(type="SeedProbeHook", role="first", priority=0)]
    if spec.get("faults"):
        hooks.append(dict(type="FaultInjectionHook", faults=spec["faults"]))
    hooks.append(dict(type="SeedProbeHook", role="pre_guard", priority=45))
    if spec.get("guard") is not None:
        hooks.append(dict(type="NanGuardHook", **spec["guard"]))
    hooks += [dict(type="SeedProbeHook", role="post_guard", priority=55),
              dict(type="SeedProbeHook", role="last", priority=100)]
    cfg.custom_hooks = hooks


def streampetr_config(spec: Dict[str, Any]) -> Any:
    """StreamPETR's ResNet-50 config at CPU size. Changes, each for a CPU machine or a short run only:

    - ``img_backbone.init_cfg`` dropped (its COCO/nuImages checkpoint is not on a test machine: random init);
    - ``pts_bbox_head.num_query`` 300 -> ``spec['num_query']`` (100);
    - the cross-attention ``PETRMultiheadFlashAttention`` (flash-attn, CUDA only) -> the plugin's own
      ``PETRMultiheadAttention(fp16=True)``, same ``embed_dims``, ``num_heads``, ``dropout`` (StreamPETR's 2080Ti
      config uses it); the 6-layer decoder, ``dropout=0.1``, ``ffn_dropout=0.1`` and ``with_cp=True`` stay;
    - images: ``H``, ``W``, ``final_dim`` of ``ResizeCropFlipRotImage`` x ``spec['image_scale']``;
    - data root / ann file -> the synthetic scenes; batch size ``spec['batch_size']``; ``workers_per_gpu=0``;
    - ``runner.max_iters`` -> ``spec['max_iters']``; checkpoints, logging, custom hooks as the run needs.
    """
    from mmcv import Config

    cfg = Config.fromfile(os.path.join(spec["root"], STREAMPETR_CONFIG))
    cfg.model.img_backbone.pop("init_cfg", None)
    head = cfg.model.pts_bbox_head
    head.num_query = spec.get("num_query", 100)
    attn = head.transformer.decoder.transformerlayers.attn_cfgs
    for i, a in enumerate(attn):
        if a["type"] == "PETRMultiheadFlashAttention":
            attn[i] = dict(type="PETRMultiheadAttention", embed_dims=a["embed_dims"], num_heads=a["num_heads"],
                           dropout=a["dropout"], fp16=True)
    _train_data(cfg, spec, "ResizeCropFlipRotImage", "PETRFormatBundle3D", scale=0.25, batch_size=2)
    cfg.runner = dict(type="IterBasedRunner", max_iters=spec["max_iters"])
    _common(cfg, spec)
    return cfg


def petrv2_config(spec: Dict[str, Any]) -> Any:
    """megvii PETRv2's VoVNet-99 config (``petrv2_vovnet_gridmask_p4_800x320.py``) at CPU size. Changes:

    - ``load_from`` (its FCOS3D VoVNet checkpoint) dropped: random init;
    - ``pts_bbox_head.num_query`` 900 -> ``spec['num_query']``;
    - images: ``H``, ``W``, ``final_dim`` of ``ResizeCropFlipImage`` x ``spec['image_scale']``;
    - data root / ann file -> the synthetic scenes; ``workers_per_gpu=0``;
    - ``runner.max_epochs`` (and ``total_epochs``) -> ``spec['max_epochs']``; checkpoints, logging, hooks.
    The decoder (6 ``PETRTransformerDecoderLayer``, ``PETRMultiheadAttention``, ``dropout=0.1``, ``with_cp=True``),
    VoVNetCP-99, the static loss scale 512 and ``max_norm=35`` stay.
    """
    from mmcv import Config

    cfg = Config.fromfile(os.path.join(spec["root"], PETRV2_CONFIG))
    cfg.model.pts_bbox_head.num_query = spec.get("num_query", 100)
    _train_data(cfg, spec, "ResizeCropFlipImage", "DefaultFormatBundle3D", scale=0.2, batch_size=1)
    cfg.runner = dict(type="EpochBasedRunner", max_epochs=spec["max_epochs"])
    cfg.total_epochs = spec["max_epochs"]
    if spec.get("cbgs"):  # as PETR's and PETRv2's trainval configs train: through mmdet3d's CBGSDataset
        cfg.data.train = dict(type="CBGSDataset", dataset=cfg.data.train)
    _common(cfg, spec)
    return cfg


# ---------------------------------------------------------------------------------------------- recording
def _finite(t: Any) -> bool:
    import torch

    return bool(torch.isfinite(t).all()) if isinstance(t, torch.Tensor) and t.is_floating_point() else True


class Recorder:
    """What the probes see, for the JSON result."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.spec = spec
        self.runner: Any = None
        self.dataset: Any = None
        self.guard: Any = None
        self.iterations: List[Dict[str, Any]] = []
        self.served: List[int] = []
        #: Indices the guard's replays fetched (a batch rebuilt from its indices), kept apart from ``served``.
        self.replayed: List[int] = []
        self.reads: Optional[List[List[str]]] = None
        self.read_iterations: List[int] = []
        self.with_cp: List[bool] = []
        self.current: Dict[str, Any] = {}
        self._clones: Optional[Dict[str, Any]] = None

    # -- the model's parts
    def model(self) -> Any:
        from mmcv.parallel import is_module_wrapper

        model = self.runner.model
        return model.module if is_module_wrapper(model) else model

    def head(self) -> Any:
        return getattr(self.model(), "pts_bbox_head", None)

    def memory(self) -> Optional[Dict[str, Any]]:
        """StreamPETR's memory attributes (None for a head without them)."""
        head = self.head()
        if head is None or not hasattr(head, "memory_embedding"):
            return None
        return {name: getattr(head, name, None) for name in MEMORY_ATTRS}

    def memory_equal(self, clones: Optional[Dict[str, Any]]) -> Optional[bool]:
        """Whether the memory attributes hold exactly ``clones`` (both None counts as equal)."""
        import torch

        memory = self.memory()
        if memory is None or clones is None:
            return None
        return all((a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                                  and torch.equal(a, b))
                   for a, b in ((memory[k], clones[k]) for k in MEMORY_ATTRS))

    def memory_state(self) -> Optional[str]:
        memory = self.memory()
        if memory is None:
            return None
        if all(v is None for v in memory.values()):
            return "reset"
        return "finite" if all(_finite(v) for v in memory.values()) else "nonfinite"

    # -- the guard's time, wrapped around its hook methods (inside any host-read watch)
    def time_guard(self, hook: Any) -> None:
        for name in ("before_train_iter", "after_train_iter"):
            original = getattr(hook, name)

            def timed(runner: Any, _original: Any = original, _name: str = name) -> Any:
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    return _original(runner)
                finally:
                    # Wall and CPU time: other jobs on the machine stretch the first, far less the second.
                    self.current[f"guard_{_name}_s"] = time.perf_counter() - t0
                    self.current[f"guard_{_name}_cpu_s"] = time.process_time() - c0

            setattr(hook, name, timed)

    # -- the probes
    def before_run(self, runner: Any) -> None:
        self.runner = runner
        self.guard = next((h for h in runner.hooks if type(h).__name__ == "NanGuardHook"), None)
        if self.guard is not None:
            self.time_guard(self.guard)
            watch = self.spec.get("watch_reads")
            if watch:
                self.watch_reads(watch["snapshot_interval"], watch["warmup"])
        head = self.head()
        if head is not None and hasattr(head, "reset_memory"):
            reset = head.reset_memory

            def reset_memory() -> None:
                # A reset inside the guard's after_train_iter (its temporal reset after a rollback) sees what the
                # diagnosis replay left in the memory: it should be what training left there.
                if self._clones is not None and "memory_at_reset_unchanged" not in self.current:
                    self.current["memory_at_reset_unchanged"] = self.memory_equal(self._clones)
                reset()

            head.reset_memory = reset_memory
        self.with_cp = [bool(getattr(layer, "use_checkpoint", False))
                        for layer in getattr(getattr(getattr(head, "transformer", None), "decoder", None),
                                             "layers", [])]

    def watch_reads(self, snapshot_interval: int, warmup: int) -> None:
        """``watch_healthy_steps``'s watch (past ``warmup`` iterations, not on snapshot iterations), with the
        iteration of every watched call kept, so that the test can keep the healthy steps' calls only."""
        from petr_stability.testing.reads import count_host_reads, watch_methods

        def when(runner: Any) -> bool:
            due = runner.iter >= warmup and (runner.iter + 1) % snapshot_interval != 0
            if due:
                self.read_iterations.append(runner.iter + 1)
            return due

        self.reads = watch_methods(self.guard, ["before_train_iter", "after_train_iter"], when=when,
                                   recorder=count_host_reads)

    def first(self, runner: Any) -> None:
        indices, self.served = self.served, []
        infos = self.dataset.data_infos
        batch = getattr(runner, "data_batch", None) or {}
        scene_tokens: List[Any] = []
        metas = batch.get("img_metas")
        for sample in (metas.data[0] if metas is not None else []):
            last = sample[-1] if isinstance(sample, list) else sample  # StreamPETR: the queue of one frame
            scene_tokens.append(last.get("scene_token"))
        prev = batch.get("prev_exists")
        self.current = {
            "iteration": runner.iter + 1, "indices": indices,
            "tokens": [infos[i]["token"] for i in indices],
            "scene_tokens": scene_tokens,
            "prev_exists": prev.data[0].flatten().tolist() if prev is not None else None,
            "memory_at_start": self.memory_state(),
            "t0": time.perf_counter(), "c0": time.process_time(),
        }

    def pre_guard(self, runner: Any) -> None:
        memory = self.memory()
        self._clones = None if memory is None else {
            k: (v.detach().clone() if v is not None else None) for k, v in memory.items()}
        log_vars = (getattr(runner, "outputs", None) or {}).get("log_vars") or {}
        history = runner.log_buffer.val_history.get("grad_norm") or []
        opt = next((h for h in runner.hooks if hasattr(h, "loss_scaler")), None)
        # The guard's state as the checkpoint of this iteration saves it (stored after the previous iteration).
        state = (runner.meta or {}).get("nan_guard") or {}
        self.current.update(guard_run_id=state.get("run_id"), guard_recoveries=state.get("recoveries"))
        self.current.update(loss=log_vars.get("loss"), grad_norm=history[-1] if history else None,
                            loss_scale=float(opt.loss_scaler.get_scale()) if opt is not None else None,
                            iter_before_guard=runner.iter)

    def post_guard(self, runner: Any) -> None:
        if self._clones is not None:
            self.current.update(memory_unchanged_by_guard=self.memory_equal(self._clones),
                                memory_after_guard=self.memory_state())
        self._clones = None
        self.current["iter_after_guard"] = runner.iter

    def last(self, runner: Any) -> None:
        self.current["seconds"] = time.perf_counter() - self.current.pop("t0", time.perf_counter())
        self.current["cpu_seconds"] = time.process_time() - self.current.pop("c0", time.process_time())
        self.iterations.append(self.current)
        self.current = {}

    def samplers(self) -> Dict[str, Optional[str]]:
        """Which sampler objects the training loader holds, and which one drives the iterator it is reading
        (an ``IterBasedRunner`` makes that iterator once, before the first iteration, and keeps it)."""
        try:
            loader = getattr(self.runner, "data_loader", None)
            torch_loader = getattr(loader, "_dataloader", loader)
            live = getattr(getattr(loader, "iter_loader", None), "_sampler_iter", None)
            frame = getattr(live, "gi_frame", None)
            driver = frame.f_locals.get("self") if frame is not None else None
            return {"batch_sampler": type(getattr(torch_loader, "batch_sampler", None)).__name__,
                    "sampler": type(getattr(torch_loader, "sampler", None)).__name__,
                    "live_iterator": type(driver).__name__ if driver is not None else None}
        except Exception as exc:  # a diagnostic only: never the reason a run fails
            return {"error": repr(exc)}

    def final(self) -> Dict[str, Any]:
        import torch

        if self.runner is None:
            return {}
        model = self.model()
        params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        dropouts = {}
        head = self.head()
        for name, module in (head.named_modules() if head is not None else []):
            if isinstance(module, torch.nn.Dropout):
                dropouts[name] = module.p
            if isinstance(module, torch.nn.MultiheadAttention):
                dropouts[name + ".dropout"] = module.dropout
        opt = next((h for h in self.runner.hooks if hasattr(h, "clip_grads")), None)
        clip = getattr(opt, "grad_clip", None)
        return {"iter": self.runner.iter, "epoch": self.runner.epoch, "params_finite": params_finite,
                "samplers": self.samplers(),
                "memory": self.memory_state(), "head_dropouts": dropouts, "decoder_with_cp": self.with_cp,
                "max_norm": clip.get("max_norm") if isinstance(clip, dict) else None,
                "guard_state": (self.runner.meta or {}).get("nan_guard")}


REC: Optional[Recorder] = None


def register_test_modules() -> None:
    """``SeedProbeHook`` into MMCV's HOOKS and ``InjectRawFrame`` into mmdet's PIPELINES (this process only)."""
    from mmcv.runner import HOOKS, Hook
    from mmdet.datasets.builder import PIPELINES

    @HOOKS.register_module(force=True)
    class SeedProbeHook(Hook):
        """Records what the run does; ``role`` says where it sits (see the module docstring)."""

        def __init__(self, role: str) -> None:
            self.role = role

        def before_run(self, runner: Any) -> None:
            if self.role == "first":
                REC.before_run(runner)

        def before_train_iter(self, runner: Any) -> None:
            if self.role == "first":
                REC.first(runner)

        def after_train_iter(self, runner: Any) -> None:
            getattr(REC, self.role)(runner) if self.role != "first" else None

    @PIPELINES.register_module(force=True)
    class InjectRawFrame:
        """Camera ``camera`` of the samples whose token is in ``tokens`` becomes a raw 16-bit frame (every pixel
        ``value``, 65535 by default): what reaches the model when a 16-bit image skips the conversion to 8 bits
        and the normalization. (The projects' own resize steps cast every frame with ``np.uint8``, which wraps a
        16-bit file to 0..255 before it gets here: the raw frame has to be planted after them.)"""

        def __init__(self, tokens: List[str], camera: int = 0, value: float = 65535.0) -> None:
            self.tokens, self.camera, self.value = set(tokens), camera, float(value)

        def __call__(self, results: Dict[str, Any]) -> Dict[str, Any]:
            if results.get("sample_idx") in self.tokens:
                img = results["img"][self.camera]
                results["img"][self.camera] = np.full_like(img, self.value, dtype=np.float32)
            return results


def choose_corrupt(dataset: Any, cfg: Any, where: Dict[str, int]) -> Dict[str, Any]:
    """Picks the sample StreamPETR's sampler serves at ``where['iteration']`` (1-based) in batch slot
    ``where['slot']`` and makes the pipeline's ``InjectRawFrame`` corrupt camera ``where['camera']`` of it; returns
    it with the iterations the sampler would serve it at in ``runner.max_iters`` iterations.

    The batch sampler is built exactly as StreamPETR's ``build_dataloader`` builds it (same dataset, batch size,
    one replica, seed), so its twin yields the same batches.
    """
    from projects.mmdet3d_plugin.datasets.samplers.group_sampler import InfiniteGroupEachSampleInBatchSampler

    twin = iter(InfiniteGroupEachSampleInBatchSampler(dataset, cfg.data.samples_per_gpu, 1, 0, seed=cfg.seed))
    batches = [[int(i) for i in next(twin)] for _ in range(cfg.runner.max_iters)]
    batch = batches[where["iteration"] - 1]
    index = batch[where["slot"]]
    token = dataset.data_infos[index]["token"]
    inject = [t for t in dataset.pipeline.transforms if type(t).__name__ == "InjectRawFrame"]
    if len(inject) != 1:
        raise LookupError("corrupt_at needs corrupt=dict(tokens=[]) in the spec (InjectRawFrame in the pipeline)")
    inject[0].tokens = {token}
    inject[0].camera = where.get("camera", 0)
    return {"index": index, "token": token, "scene_token": dataset.data_infos[index]["scene_token"],
            "iteration": where["iteration"], "slot": where["slot"], "batch": batch,
            # Where the sampler would serve it in this run with nothing quarantined (data is never replayed, so a
            # rollback does not change this order).
            "planned": [k + 1 for k, b in enumerate(batches) if index in b]}


def choose_corrupt_copies(wrapper: Any, dataset: Any) -> Dict[str, Any]:
    """The sample ``CBGSDataset`` serves under the most indices: the pipeline's ``InjectRawFrame`` makes camera 0
    of it NaN; returns it with every outer index it is served under."""
    copies: Dict[int, List[int]] = {}
    for outer, inner in enumerate(wrapper.sample_indices):
        copies.setdefault(int(inner), []).append(outer)
    index = max(sorted(copies), key=lambda i: len(copies[i]))
    token = dataset.data_infos[index]["token"]
    inject = [t for t in dataset.pipeline.transforms if type(t).__name__ == "InjectRawFrame"]
    if len(inject) != 1:
        raise LookupError("corrupt_cbgs needs corrupt=dict(tokens=[]) in the spec (InjectRawFrame in the pipeline)")
    inject[0].tokens, inject[0].camera = {token}, 0
    return {"index": index, "token": token, "outer": copies[index], "outer_size": len(wrapper)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: written as strings, as the incident log does."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def run(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Trains as the spec says; returns the result dict (also on a raised error, which it records)."""
    global REC
    REC = Recorder(spec)
    root = spec["root"]
    sys.path.insert(0, root)
    out: Dict[str, Any] = {"spec": spec, "error": None}
    t_start = time.perf_counter()
    with cpu_stand_ins(root, islands=spec.get("islands", True)) as stand_ins:
        import torch
        from mmdet.apis import set_random_seed
        from mmdet.models import DETECTORS
        from mmdet3d.datasets import build_dataset
        from mmdet3d.models import build_model

        import petr_stability  # noqa: F401  (registers NanGuardHook / FaultInjectionHook in MMCV's HOOKS)

        # The plugin first: petr_stability.testing registers a stand-in named PETRMultiheadAttention in MMCV's
        # ATTENTION registry unless that name is taken, and the plugin's own registration raises on a taken name.
        importlib.import_module("projects.mmdet3d_plugin")
        import petr_stability.testing.mmcv1_cpu  # noqa: F401  (registers CPUFp16OptimizerHook)
        register_test_modules()
        torch.set_num_threads(spec.get("threads", 2))
        project = spec["project"]
        cfg = streampetr_config(spec) if project == "streampetr" else petrv2_config(spec)
        set_random_seed(cfg.seed, deterministic=False)
        random.seed(cfg.seed)
        stand_ins.whole_forward(DETECTORS.get("Petr3D"))
        model = build_model(cfg.model, train_cfg=cfg.get("train_cfg"), test_cfg=cfg.get("test_cfg"))
        model.init_weights()
        dataset = build_dataset(cfg.data.train)
        wrapper, dataset = (dataset, dataset.dataset) if spec.get("cbgs") else (None, dataset)
        REC.dataset = dataset
        original = dataset.prepare_train_data
        from petr_stability.testing.fetches import guard_replay

        def prepare(index: int) -> Any:
            # What the loader fetches for training, apart from the guard's replays of a batch from its indices.
            (REC.replayed if guard_replay() else REC.served).append(int(index))
            return original(index)

        dataset.prepare_train_data = prepare  # the index each batch was built from, as the loader asks for it
        if spec.get("corrupt_at"):
            out["corrupt"] = choose_corrupt(dataset, cfg, spec["corrupt_at"])
        if spec.get("corrupt_cbgs"):
            out["corrupt"] = choose_corrupt_copies(wrapper, dataset)
        os.makedirs(cfg.work_dir, exist_ok=True)
        config_file = STREAMPETR_CONFIG if project == "streampetr" else PETRV2_CONFIG
        cfg.dump(os.path.join(cfg.work_dir, os.path.basename(config_file)))
        meta = dict(config=cfg.pretty_text, exp_name=os.path.basename(config_file), seed=cfg.seed, env_info="")
        timestamp = time.strftime("%Y%m%d_%H%M%S", time.localtime())
        out["build_seconds"] = time.perf_counter() - t_start
        from mmdet3d.utils import get_root_logger

        # As both tools/train.py do: the 'mmdet' root logger (the runner's) also writes the work dir's log file.
        get_root_logger(log_file=os.path.join(cfg.work_dir, f"{timestamp}.log"), log_level=cfg.log_level,
                        name="mmdet")
        t_train = time.perf_counter()
        try:
            if project == "streampetr":
                from projects.mmdet3d_plugin.core.apis.train import custom_train_model

                custom_train_model(model, [dataset], cfg, distributed=False, validate=False, timestamp=timestamp,
                                   meta=meta)
            else:
                from mmdet3d.apis import train_model

                train_model(model, [wrapper or dataset], cfg, distributed=False, validate=False,
                            timestamp=timestamp, meta=meta)
        except Exception as exc:  # the guard's NanGuardGaveUp / StructuralDivergence are results, not crashes
            out["error"] = {"type": type(exc).__name__, "message": str(exc),
                            "traceback": traceback.format_exc()[-4000:]}
        out["train_seconds"] = time.perf_counter() - t_train
        if REC.current:  # an iteration cut short by a raised error
            REC.current.pop("t0", None)
            REC.current.pop("c0", None)
            REC.iterations.append(dict(REC.current, unfinished=True))
        out.update(iterations=REC.iterations, reads=REC.reads, read_iterations=REC.read_iterations,
                   final=REC.final(), replayed=REC.replayed,
                   cbgs_table=[int(i) for i in wrapper.sample_indices] if wrapper is not None else None,
                   dataset=[{"index": i, "token": info["token"], "scene_token": info["scene_token"],
                             "flag": int(dataset.flag[i])} for i, info in enumerate(dataset.data_infos)])
    out["wall_seconds"] = time.perf_counter() - t_start
    return _clean(out)


def main(argv: List[str]) -> int:
    """``seed_run.py SPEC.json``: runs the spec, writes ``spec['result']``; exit status 0 unless it crashed."""
    with open(argv[1]) as fh:
        spec = json.load(fh)
    with contextlib.ExitStack():
        result = run(spec)
    with open(spec["result"], "w") as fh:
        json.dump(result, fh, default=_jsonable, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
