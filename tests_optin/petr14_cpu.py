"""mmdet3d 1.4's real ``projects/PETR`` detector at a CPU size, trained by a real MMEngine ``Runner``.

Test-side helpers for ``test_mmdet3d_petr_amp.py`` (opt-in: ``MMDET3D_ROOT`` must point at an mmdetection3d v1.4.0
clone; nothing of it is copied here). The config is the project's own
``projects/PETR/configs/petr_vovnet_gridmask_p4_800x320.py`` read with ``Config.fromfile``; what changes for the CPU
is listed in :func:`petr_config` and nowhere else.

The data are synthetic samples in exactly the form mmdet3d 1.4's ``NuScenesDataset`` hands its pipeline after
``LoadMultiViewImageFromFiles`` and ``LoadAnnotations3D`` (six nuScenes-like cameras at 900x1600, their ``cam2img`` /
``lidar2cam``, ``images`` per camera, LiDAR boxes with velocities), then the rest of the project's own
``train_pipeline`` from the config (``ObjectRangeFilter``, ``ObjectNameFilter``, ``ResizeCropFlipImage``,
``GlobalRotScaleTransImage``, ``Pack3DDetInputs`` with its keys), collated by MMEngine's ``pseudo_collate`` and
preprocessed by the config's ``Det3DDataPreprocessor``: the model sees ``inputs={'imgs': ...}`` and
``Det3DDataSample`` s as a nuScenes run would give them.
"""
import contextlib
import copy
import math
import os
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

CONFIG = "projects/PETR/configs/petr_vovnet_gridmask_p4_800x320.py"
HOW_TO_RUN = ("mmdet3d 1.4 projects/PETR suite: set MMDET3D_ROOT to an mmdetection3d v1.4.0 clone "
              "(git clone -b v1.4.0 https://github.com/open-mmlab/mmdetection3d) and run "
              "`MMDET3D_ROOT=... make test-mmdet3d-scope`")

# The CPU size. The image keeps the config's 800x320 aspect class (both sides multiples of 32, the data
# preprocessor's pad divisor, so nothing is padded, as at 320x800): 64x192, i.e. every augmentation bound of the
# config's ida_aug_conf scaled by 192/800.
FINAL_DIM = (64, 192)
ORIGINAL = (900, 1600)  # nuScenes' camera resolution, as the loader hands it over

CLASSES = ('car', 'truck', 'construction_vehicle', 'bus', 'trailer', 'barrier', 'motorcycle', 'bicycle',
           'pedestrian', 'traffic_cone')
# (l, w, h) per class, roughly nuScenes' mean sizes: boxes the assigner and the L1 loss see as real ones.
SIZES = {0: (4.6, 1.95, 1.73), 1: (6.9, 2.5, 2.8), 2: (6.4, 2.8, 3.2), 3: (11.0, 2.9, 3.5), 4: (12.3, 2.9, 3.9),
         5: (0.5, 2.5, 1.0), 6: (2.1, 0.8, 1.5), 7: (1.7, 0.6, 1.3), 8: (0.7, 0.7, 1.8), 9: (0.4, 0.4, 1.1)}
# nuScenes' camera order in its infos, yaw of the optical axis in the LiDAR frame (x forward, y left) and the
# intrinsics' focal length / principal point (the back camera has a wider lens).
CAMERAS = (("CAM_FRONT", 0.0, 1266.4, (816.3, 491.5)), ("CAM_FRONT_RIGHT", -55.0, 1260.8, (807.9, 495.3)),
           ("CAM_FRONT_LEFT", 55.0, 1272.6, (826.6, 479.8)), ("CAM_BACK", 180.0, 809.2, (829.2, 481.8)),
           ("CAM_BACK_LEFT", 110.0, 1256.7, (792.1, 492.8)), ("CAM_BACK_RIGHT", -110.0, 1259.5, (807.3, 501.2)))


def petr_root() -> Optional[str]:
    """The mmdetection3d clone named by ``MMDET3D_ROOT``, or None when it is unset.

    Raises:
        RuntimeError: it is set but holds no ``projects/PETR`` config.
    """
    root = os.environ.get("MMDET3D_ROOT")
    if not root:
        return None
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isfile(os.path.join(root, CONFIG)):
        raise RuntimeError(f"MMDET3D_ROOT={root} has no {CONFIG}: it must be an mmdetection3d v1.4.0 clone")
    return root


def import_petr(root: str) -> None:
    """Imports ``projects.PETR.petr`` from the clone (its config's ``custom_imports``) and this side's registrations."""
    if root not in sys.path:
        sys.path.insert(0, root)  # `projects` is a namespace package of the clone, as mmdet3d's tools/train.py sees it
    import mmdet3d.models  # noqa: F401  (mmdet3d's own registrations: Det3DDataPreprocessor, losses, ...)
    import projects.PETR.petr  # noqa: F401

    import petr_stability  # noqa: F401  (NanGuardHook, FaultInjectionHook)
    import petr_stability.testing.mmengine_cpu  # noqa: F401  (CPUAmpOptimWrapper)
    _register()


# ---------------------------------------------------------------------------------------------- synthetic samples
def _lidar2cam(yaw_deg: float) -> np.ndarray:
    """A camera looking along ``yaw_deg`` from 1.5 m off the LiDAR, 0.3 m below it (nuScenes' rig, roughly)."""
    yaw = math.radians(yaw_deg)
    forward = np.array([math.cos(yaw), math.sin(yaw), 0.0])
    right = np.array([math.sin(yaw), -math.cos(yaw), 0.0])
    down = np.array([0.0, 0.0, -1.0])
    cam2lidar_rot = np.stack([right, down, forward], axis=1)  # columns: the camera's x (right), y (down), z (ahead)
    position = np.array([1.5 * math.cos(yaw), 1.5 * math.sin(yaw), -0.3])
    lidar2cam = np.eye(4)
    lidar2cam[:3, :3] = cam2lidar_rot.T
    lidar2cam[:3, 3] = -cam2lidar_rot.T @ position
    return lidar2cam


def _intrinsics(focal: float, centre: Tuple[float, float]) -> np.ndarray:
    return np.array([[focal, 0.0, centre[0]], [0.0, focal, centre[1]], [0.0, 0.0, 1.0]])


def loaded_sample(index: int, seed: int = 0) -> Dict[str, Any]:
    """What ``NuScenesDataset.get_data_info`` + ``LoadMultiViewImageFromFiles(to_float32=True)`` +
    ``LoadAnnotations3D(with_bbox_3d, with_label_3d)`` hand the next transform, for one synthetic sample.

    Deterministic per ``(seed, index)`` (its own generator: the pipeline's augmentations keep drawing from the global
    numpy RNG, as in a real run).
    """
    from mmdet3d.structures import Box3DMode, LiDARInstance3DBoxes

    rng = np.random.default_rng(seed * 100003 + index)
    images: Dict[str, Dict[str, Any]] = {}
    imgs, cam2img, lidar2cam, paths = [], [], [], []
    for k, (name, yaw, focal, centre) in enumerate(CAMERAS):
        intrinsic, extrinsic = _intrinsics(focal, centre), _lidar2cam(yaw)
        viewpad = np.eye(4)
        viewpad[:3, :3] = intrinsic
        path = f"data/nuscenes/samples/{name}/synthetic_{index:05d}_{name}.jpg"
        images[name] = dict(img_path=path, cam2img=intrinsic.tolist(), lidar2cam=extrinsic.tolist(),
                            lidar2img=(viewpad @ extrinsic).tolist(), sample_data_token=f"sd{index:05d}{k}",
                            timestamp=1.5e9 + index * 0.5, cam2ego=np.eye(4).tolist())
        # Smooth content (a coarse random field, upsampled) rather than per-pixel noise: image statistics closer to
        # a photograph's, what the backbone's activations are sized for. uint8 values as decoded JPEGs give.
        coarse = rng.integers(0, 256, size=(ORIGINAL[0] // 50, ORIGINAL[1] // 50, 3)).astype(np.uint8)
        img = np.kron(coarse, np.ones((50, 50, 1), np.uint8)).astype(np.float32)
        img += rng.normal(0.0, 8.0, size=img.shape).astype(np.float32)
        imgs.append(np.clip(img, 0, 255))
        cam2img.append(intrinsic.tolist())
        lidar2cam.append(extrinsic.tolist())
        paths.append(path)
    n = int(rng.integers(4, 11))
    labels = rng.integers(0, len(CLASSES), size=n).astype(np.int64)
    boxes = np.zeros((n, 9), np.float32)
    for i, label in enumerate(labels):
        radius, angle = rng.uniform(5.0, 45.0), rng.uniform(-math.pi, math.pi)
        length, width, height = SIZES[int(label)]
        boxes[i] = (radius * math.cos(angle), radius * math.sin(angle), -1.8 + height / 2, width, length, height,
                    rng.uniform(-math.pi, math.pi), rng.normal(0.0, 2.0), rng.normal(0.0, 2.0))
    # NuScenesDataset: gravity centres in the infos, origin (0.5, 0.5, 0.5), converted to the LiDAR box mode.
    gt_bboxes_3d = LiDARInstance3DBoxes(boxes, box_dim=9, origin=(0.5, 0.5, 0.5)).convert_to(Box3DMode.LIDAR)
    return dict(
        sample_idx=index, token=f"synthetic{index:05d}", timestamp=1.5e9 + index * 0.5,
        ego2global=np.eye(4).tolist(), lidar_points=dict(lidar_path=f"synthetic_{index:05d}.pcd.bin", num_pts_feats=5),
        lidar_path=f"data/nuscenes/samples/LIDAR_TOP/synthetic_{index:05d}.pcd.bin", num_pts_feats=5,
        images=images, box_type_3d=LiDARInstance3DBoxes, box_mode_3d=Box3DMode.LIDAR,
        filename=paths, cam2img=cam2img, lidar2cam=lidar2cam, ori_cam2img=copy.deepcopy(cam2img),
        img=imgs, img_shape=ORIGINAL, ori_shape=ORIGINAL, pad_shape=ORIGINAL, scale_factor=1.0,
        img_norm_cfg=dict(mean=np.zeros(3, np.float32), std=np.ones(3, np.float32), to_rgb=False),
        num_views=6, num_ref_frames=-1,
        gt_bboxes_3d=gt_bboxes_3d, gt_labels_3d=labels,
        ann_info=dict(gt_bboxes_3d=gt_bboxes_3d, gt_labels_3d=labels))


class SyntheticNuScenesCameras(torch.utils.data.Dataset):
    """``length`` synthetic nuScenes camera samples through the project's train pipeline (after its two loaders).

    Args:
        pipeline: the transforms after ``LoadMultiViewImageFromFiles`` / ``LoadAnnotations3D``, as config dicts.
        length: samples.
        seed: the content's seed. Defaults to 0.
        metainfo: the dataset's metainfo (``classes``). Defaults to None (the config's ten classes).
    """

    def __init__(self, pipeline: Sequence[dict], length: int, seed: int = 0, metainfo: Optional[dict] = None) -> None:
        from mmdet3d.registry import TRANSFORMS
        from mmengine.dataset import Compose

        self.pipeline = Compose([TRANSFORMS.build(copy.deepcopy(t)) for t in pipeline])
        self.length = int(length)
        self.seed = int(seed)
        self.metainfo = dict(metainfo or dict(classes=CLASSES))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return self.pipeline(loaded_sample(index, self.seed))


# ---------------------------------------------------------------------------------------------- measuring
class StepRecorder:
    """Per iteration (after every other hook, the guard's rollback included): wall time, loss, loss scale before
    and after the step, and whether the step was skipped (the dynamic scale halved)."""

    priority = "LOWEST"

    def __init__(self) -> None:
        self.records: List[Dict[str, Any]] = []
        self._t0 = 0.0
        self._scale0: Optional[float] = None

    @staticmethod
    def _scale(runner: Any) -> Optional[float]:
        scaler = getattr(runner.optim_wrapper, "loss_scaler", None)
        return None if scaler is None else float(scaler.get_scale())

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._scale0 = self._scale(runner)
        self._t0 = time.perf_counter()

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        scale = self._scale(runner)
        loss = None
        if isinstance(outputs, dict) and "loss" in outputs:
            loss = float(outputs["loss"])
        self.records.append(dict(iteration=runner.iter + 1, seconds=time.perf_counter() - self._t0, loss=loss,
                                 scale_before=self._scale0, scale=scale,
                                 skipped=(scale is not None and self._scale0 is not None and scale < self._scale0)))


class GridMaskLog:
    """Every GridMask call's numpy draws, with the training iteration it ran in: GridMask draws its masks from
    ``np.random`` inside the model's forward, so a replay that does not restore numpy's RNG applies another mask."""

    def __init__(self) -> None:
        self.calls: List[Dict[str, Any]] = []
        self.iteration = 0


def _register() -> None:
    """Registers the dataset and the recorder hook in mmdet3d's registries (the runner's default scope)."""
    from mmdet3d.registry import DATASETS, HOOKS
    from mmengine.hooks import Hook

    DATASETS.register_module(name="SyntheticNuScenesCameras", module=SyntheticNuScenesCameras, force=True)

    class StepRecorderHook(StepRecorder, Hook):
        priority = "LOWEST"

        def __init__(self) -> None:
            StepRecorder.__init__(self)

    HOOKS.register_module(name="StepRecorderHook", module=StepRecorderHook, force=True)


@contextlib.contextmanager
def cpu_cuda_calls(log: Optional[GridMaskLog] = None) -> Iterator[None]:
    """``Tensor.cuda()`` as the identity while PETR trains on the CPU: its GridMask moves each mask with
    ``.cuda()`` (a GPU is assumed there, nothing else). With ``log``, GridMask's numpy draws are recorded too."""
    from projects.PETR.petr.grid_mask import GridMask

    original_cuda, original_forward = torch.Tensor.cuda, GridMask.forward

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if log is not None and self.training:
            state = np.random.get_state()
            applies = not np.random.rand() > self.prob
            d = int(np.random.randint(2, x.size(2))) if applies else None
            np.random.set_state(state)  # the real forward below draws exactly these again
            log.calls.append(dict(iteration=log.iteration, applies=applies, d=d, state_pos=int(state[2])))
        return original_forward(self, x)

    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    GridMask.forward = forward
    try:
        yield
    finally:
        torch.Tensor.cuda = original_cuda  # type: ignore[method-assign]
        GridMask.forward = original_forward


# ---------------------------------------------------------------------------------------------- the config
def petr_config(root: str, work_dir: str, *, amp: bool, samples: int, epochs: int = 1,
                guard: Optional[dict] = None, faults: Optional[List[dict]] = None, seed: int = 0,
                num_query: Optional[int] = None, num_layers: Optional[int] = None) -> Any:
    """The project's config, read as mmdet3d's ``tools/train.py`` reads it, at the CPU size.

    Changed from the shipped file, and nothing else: the images (64x192 instead of 320x800: the
    ``ida_aug_conf`` bounds scaled by 192/800), the data (``samples`` synthetic samples, batch 1, no workers, no
    validation or test loop, which need nuScenes on disk), ``max_epochs`` (``epochs``), ``load_from`` (the FCOS3D
    VoVNet weights it names are not here: the weights are the model's own initialisation), the logger interval (every
    iteration), and the hooks (``NanGuardHook`` with ``guard``, ``FaultInjectionHook`` with ``faults``, the test's
    recorder). With ``amp`` the optimizer wrapper is ``CPUAmpOptimWrapper(loss_scale='dynamic')`` (the config's
    commented-out ``AmpOptimWrapper``), otherwise the shipped fp32 ``OptimWrapper``. ``num_query`` /
    ``num_layers``: fewer queries or decoder layers (None: the config's 900 and 6).
    """
    from mmengine.config import Config

    cfg = Config.fromfile(os.path.join(root, CONFIG))
    cfg.work_dir = work_dir
    cfg.experiment_name = f"petr14_{uuid.uuid4().hex[:8]}"
    cfg.load_from = None
    cfg.visualizer.name = f"vis_{cfg.experiment_name}"  # one visualizer instance per runner in this process
    head = cfg.model.pts_bbox_head
    if num_query is not None:
        head.num_query = num_query
    if num_layers is not None:
        head.transformer.decoder.num_layers = num_layers
    pipeline = copy.deepcopy(cfg.train_dataloader.dataset.pipeline)
    assert [t["type"] for t in pipeline[:2]] == ["LoadMultiViewImageFromFiles", "LoadAnnotations3D"], pipeline
    scale = FINAL_DIM[1] / 800
    for t in pipeline:
        if t["type"] == "ResizeCropFlipImage":
            conf = t["data_aug_conf"]
            conf["resize_lim"] = tuple(r * scale for r in conf["resize_lim"])
            conf["final_dim"] = FINAL_DIM
    cfg.train_dataloader = dict(
        batch_size=1, num_workers=0, persistent_workers=False,
        sampler=dict(type="DefaultSampler", shuffle=True),
        dataset=dict(type="SyntheticNuScenesCameras", pipeline=pipeline[2:], length=samples, seed=seed,
                     metainfo=dict(cfg.metainfo)))
    for key in ("val_dataloader", "val_cfg", "val_evaluator", "test_dataloader", "test_cfg", "test_evaluator"):
        cfg[key] = None
    cfg.train_cfg = dict(by_epoch=True, max_epochs=epochs)
    cfg.default_hooks.logger.interval = 1
    cfg.log_processor = dict(type="LogProcessor", window_size=1, by_epoch=True)
    if amp:
        cfg.optim_wrapper.type = "CPUAmpOptimWrapper"
        cfg.optim_wrapper.loss_scale = "dynamic"
    else:
        cfg.optim_wrapper.type = "OptimWrapper"
    hooks: List[dict] = []
    if faults:
        hooks.append(dict(type="FaultInjectionHook", faults=faults))
    if guard is not None:
        hooks.append(dict(type="NanGuardHook", **guard))
    hooks.append(dict(type="StepRecorderHook"))
    cfg.custom_hooks = hooks
    return cfg


def hook_of(runner: Any, name: str) -> Any:
    """The runner's hook of class ``name``."""
    for hook in runner.hooks:
        if type(hook).__name__ == name:
            return hook
    raise LookupError(name)


def train(cfg: Any, gridmask: Optional[GridMaskLog] = None) -> Dict[str, Any]:
    """Builds the runner from ``cfg`` (``Runner.from_cfg``) and trains; returns what the tests read.

    Keys: ``runner``, ``records`` (the recorder's, per iteration), ``incidents`` (the incident log), ``summary`` (the
    guard's), ``error`` (the exception training raised, or None), ``seconds``, ``weights_finite``, ``fp32``
    (modules run in fp32 at the end).
    """
    from mmengine.runner import Runner

    from petr_stability import read_incidents
    from petr_stability.core.remedies.fp32 import fp32_modules
    from petr_stability.testing.fp16_conv import fp16_conv_backward_in_fp32

    torch.manual_seed(0)
    runner = Runner.from_cfg(cfg)
    recorder = hook_of(runner, "StepRecorderHook")
    if gridmask is not None:  # GridMask's log learns the iteration from a hook that runs before every other
        from mmengine.hooks import Hook

        def before_iter(_runner: Any, batch_idx: int, data_batch: Any = None) -> None:
            gridmask.iteration = _runner.iter + 1

        marker = Hook()
        marker.before_train_iter = before_iter  # type: ignore[method-assign]
        runner.register_hook(marker, priority="HIGHEST")
    t0 = time.perf_counter()
    error = None
    with cpu_cuda_calls(gridmask), fp16_conv_backward_in_fp32():
        try:
            runner.train()
        except Exception as exc:  # the tests assert on it: a guard that gives up raises by design
            error = exc
    model = runner.model.module if hasattr(runner.model, "module") else runner.model
    guard = None
    try:
        guard = hook_of(runner, "NanGuardHook").driver.guard
    except LookupError:
        pass
    return dict(runner=runner, records=list(recorder.records), incidents=read_incidents(cfg.work_dir),
                summary=None if guard is None else guard.summary(), error=error,
                seconds=time.perf_counter() - t0,
                weights_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                fp32=fp32_modules(model))
