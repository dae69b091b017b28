"""Synthetic nuScenes scenes written exactly as the projects' own data converters write them.

The seed-stack suite trains the real detectors through their real datasets and pipelines, so the data has to
come from disk in the converters' formats: camera JPEGs under ``samples/CAM_*`` and one info pickle
(``{'infos': [...], 'metadata': {'version': ...}}``):

- ``streampetr``: StreamPETR's ``tools/data_converter/nuscenes_converter.py`` (``nuscenes2d_temporal_infos``):
  per sample ``token``, ``prev`` / ``next``, ``scene_token``, ``frame_idx``, lidar ``sweeps`` (empty on a scene's
  first frame: that is how ``CustomNuScenesDataset._set_sequence_group_flag`` finds sequences), ``cams`` with
  ``sensor2lidar_*`` and ``cam_intrinsic``, ego poses, 3D boxes, and the per-camera 2D labels (``bboxes2d``,
  ``labels2d``, ``centers2d``, ``depths``, ``bboxes_ignore``) its ``FocalHead`` trains on.
- ``petr``: megvii PETR's ``mmdet3d_nuscenes_30f_infos`` (``tools/generate_sweep_pkl.py``): camera ``sweeps`` of
  previous key frames, each camera with its own ``lidar2img`` / ``intrinsics`` / ``extrinsics`` relative to the
  current lidar frame.

Geometry is nuScenes-like (six cameras around the ego vehicle, 16:9 images, an ego vehicle driving forward at
2 Hz key frames, objects of the ten detection classes moving at constant velocity), scaled to a small image
size. Tokens are 32-hex-digit strings, as nuScenes tokens are. Everything is seeded: the same call writes the
same files.
"""
import hashlib
import math
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CAMERAS", "CLASSES", "CBGS_TABLE_CLASSES", "write_scenes", "token"]

#: Camera order of both converters (``camera_types`` in nuscenes_converter.py; PETR's sweep loader reads its own
#: ``sensors`` list by name, so the order of ``cams`` is what the key frame uses).
CAMERAS: Tuple[str, ...] = ("CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_FRONT_LEFT", "CAM_BACK", "CAM_BACK_LEFT",
                            "CAM_BACK_RIGHT")
#: Yaw of each camera's optical axis in the lidar frame (x forward, y left, z up), degrees; roughly nuScenes'.
_YAW = {"CAM_FRONT": 0.0, "CAM_FRONT_RIGHT": -55.0, "CAM_FRONT_LEFT": 55.0, "CAM_BACK": 180.0,
        "CAM_BACK_LEFT": 110.0, "CAM_BACK_RIGHT": -110.0}
#: The ten nuScenes detection classes, in the configs' ``class_names`` order.
CLASSES: Tuple[str, ...] = ("car", "truck", "construction_vehicle", "bus", "trailer", "barrier", "motorcycle",
                            "bicycle", "pedestrian", "traffic_cone")
#: Four frames' classes for a small, random ``CBGSDataset`` table: 17 (frame, class) pairs, so that CBGS draws
#: ``int(17 / 10) = 1`` frame per class (a table of 10); classes 0-6 are each in frame 0 and one other frame (drawn
#: at random under the run's seed), 7-9 each in one frame only.
CBGS_TABLE_CLASSES: Tuple[Tuple[str, ...], ...] = (CLASSES[:7], (CLASSES[0], CLASSES[1], CLASSES[7]),
                                                  (CLASSES[2], CLASSES[3], CLASSES[8]),
                                                  (CLASSES[4], CLASSES[5], CLASSES[6], CLASSES[9]))
#: StreamPETR's converter numbers 2D labels by this tuple (``nus_categories``), not by ``CLASSES``.
_NUS_CATEGORIES = ("car", "truck", "trailer", "bus", "construction_vehicle", "bicycle", "motorcycle",
                   "pedestrian", "traffic_cone", "barrier")
#: (l, w, h) in metres, the mmdet3d LiDAR box convention the converters write (x_size = length).
_SIZE = {"car": (4.6, 1.9, 1.7), "truck": (7.0, 2.5, 3.0), "construction_vehicle": (6.5, 2.8, 3.2),
         "bus": (11.0, 2.9, 3.5), "trailer": (10.0, 2.8, 3.8), "barrier": (0.5, 2.5, 1.0),
         "motorcycle": (2.1, 0.8, 1.5), "bicycle": (1.8, 0.6, 1.3), "pedestrian": (0.7, 0.7, 1.75),
         "traffic_cone": (0.4, 0.4, 1.0)}
_T0_US = 1533151603547590  # a nuScenes-era timestamp (microseconds), as the infos store them


def token(*parts: Any) -> str:
    """A deterministic nuScenes-style token (32 hex digits) for ``parts``."""
    return hashlib.md5("/".join(str(p) for p in parts).encode()).hexdigest()


def _rot_z(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _quat_z(yaw: float) -> List[float]:
    # nuScenes stores rotations as [w, x, y, z] quaternions (pyquaternion's order).
    return [math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)]


def _pose(rotation: np.ndarray, translation: Sequence[float]) -> np.ndarray:
    m = np.eye(4)
    m[:3, :3] = rotation
    m[:3, 3] = translation
    return m


def _camera(name: str, width: int, height: int) -> Dict[str, np.ndarray]:
    """Camera-to-lidar rotation/translation and intrinsics of one camera (camera axes: x right, y down, z ahead)."""
    yaw = math.radians(_YAW[name])
    forward = np.array([math.cos(yaw), math.sin(yaw), 0.0])
    right = np.array([math.sin(yaw), -math.cos(yaw), 0.0])
    down = np.array([0.0, 0.0, -1.0])
    rotation = np.stack([right, down, forward], axis=1)  # columns: the camera axes in the lidar frame
    translation = np.array([0.9 * math.cos(yaw), 0.9 * math.sin(yaw), -0.3])
    focal = 0.79 * width  # nuScenes: ~1266 px focal length on 1600 px wide images
    intrinsic = np.array([[focal, 0.0, width / 2.0], [0.0, focal, height / 2.0], [0.0, 0.0, 1.0]])
    return {"rotation": rotation, "translation": translation, "intrinsic": intrinsic}


def _corners(box: np.ndarray) -> np.ndarray:
    x, y, z, length, width, height, yaw = box[:7]
    dx, dy, dz = length / 2, width / 2, height / 2
    local = np.array([[sx * dx, sy * dy, sz * dz] for sx in (-1, 1) for sy in (-1, 1) for sz in (-1, 1)])
    return local @ _rot_z(yaw).T + np.array([x, y, z])


def _project(points: np.ndarray, cam: Dict[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    """Lidar points -> (pixel coordinates, depths) in ``cam``."""
    in_cam = (points - cam["translation"]) @ cam["rotation"]  # inverse of R @ p + t, R orthonormal
    depth = in_cam[:, 2]
    pixels = in_cam @ cam["intrinsic"].T
    return pixels[:, :2] / np.maximum(depth[:, None], 1e-6), depth


def _petr_sweep_geometry(cam: Dict[str, np.ndarray], to_current: np.ndarray) -> Dict[str, np.ndarray]:
    """A previous frame's camera as PETR's ``generate_sweep_pkl.add_frame`` stores it, relative to the current
    lidar frame (``to_current``: previous lidar frame -> current lidar frame)."""
    c2l = to_current @ _pose(cam["rotation"], cam["translation"])
    s2l_r, s2l_t = c2l[:3, :3], c2l[:3, 3]
    # Exactly add_frame's arithmetic (its transposed extrinsics convention included).
    lidar2cam_r = np.linalg.inv(s2l_r)
    lidar2cam_t = s2l_t @ lidar2cam_r.T
    lidar2cam_rt = np.eye(4)
    lidar2cam_rt[:3, :3] = lidar2cam_r.T
    lidar2cam_rt[3, :3] = -lidar2cam_t
    viewpad = np.eye(4)
    viewpad[:3, :3] = cam["intrinsic"]
    return {"sensor2lidar_rotation": s2l_r, "sensor2lidar_translation": s2l_t,
            "intrinsics": viewpad.astype(np.float32), "extrinsics": lidar2cam_rt.astype(np.float32),
            "lidar2img": (viewpad @ lidar2cam_rt.T).astype(np.float32)}


def _image(rng: np.random.RandomState, height: int, width: int, boxes2d: np.ndarray,
           labels: np.ndarray) -> np.ndarray:
    """A camera frame: a smooth road-like background, noise, and one filled rectangle per visible object."""
    rows = np.linspace(0, 1, height)[:, None, None]
    img = (70 + 80 * rows + rng.randint(0, 40, size=(height, width, 3))).astype(np.float32)
    for (x1, y1, x2, y2), label in zip(boxes2d, labels):
        color = np.array([(37 * (label + 1)) % 256, (91 * (label + 3)) % 256, (53 * (label + 5)) % 256])
        img[int(y1):int(math.ceil(y2)), int(x1):int(math.ceil(x2))] = color
    return np.clip(img, 0, 255).astype(np.uint8)


def write_scenes(root: str, fmt: str, num_scenes: int, frames: int, width: int = 400, height: int = 225,
                 objects: int = 6, seed: int = 0, info_name: Optional[str] = None,
                 scene_classes: Optional[Sequence[Sequence[str]]] = None) -> str:
    """Writes ``num_scenes`` scenes of ``frames`` key frames under ``root``; returns the info pickle's path.

    Args:
        root: the data root (``samples/CAM_*/<token>.jpg`` and the pickle go there).
        fmt: ``'streampetr'`` or ``'petr'`` (the module docstring says what each holds).
        num_scenes: scenes to write (each its own ``scene_token``).
        frames: key frames per scene (0.5 s apart, as nuScenes key frames are).
        width, height: camera image size in pixels (nuScenes: 1600 x 900; keep 16:9).
        objects: annotated objects per scene (moving at constant velocity; those outside the range or behind
            every camera still count as 3D boxes, as in nuScenes).
        seed: everything random derives from it.
        info_name: the pickle's file name. Defaults to the converter's name for ``fmt``.
        scene_classes: the classes of each scene's objects (scene ``s`` takes ``scene_classes[s]``, its objects
            cycling through them), for data whose class counts a test sets (mmdet3d's ``CBGSDataset`` draws its
            table from them). Defaults to None: classes drawn at random.

    Returns:
        The path of the info pickle (``ann_file`` of the dataset config).
    """
    if fmt not in ("streampetr", "petr"):
        raise ValueError(f"fmt must be 'streampetr' or 'petr', got {fmt!r}")
    if scene_classes is not None and (len(scene_classes) != num_scenes or not all(
            classes and set(classes) <= set(CLASSES) for classes in scene_classes)):
        raise ValueError(f"scene_classes must give {num_scenes} non-empty lists of {CLASSES}, got {scene_classes!r}")
    import cv2  # opencv-python-headless: in every environment that has mmcv

    rng = np.random.RandomState(seed)
    cams = {name: _camera(name, width, height) for name in CAMERAS}
    for name in CAMERAS:
        os.makedirs(os.path.join(root, "samples", name), exist_ok=True)
    infos: List[Dict[str, Any]] = []
    for s in range(num_scenes):
        scene = token("scene", seed, s)
        start = np.array([600.0 + 150 * s, 1600.0 - 40 * s, 0.0])
        heading = rng.uniform(-math.pi, math.pi)
        speed = rng.uniform(3.0, 8.0)
        names = [CLASSES[i] for i in rng.randint(0, len(CLASSES), size=objects)]
        if scene_classes is not None:
            names = [scene_classes[s][k % len(scene_classes[s])] for k in range(objects)]
        # Objects in the global frame at the scene's first key frame, with their velocities.
        offsets = np.stack([rng.uniform(-30, 30, objects), rng.uniform(-30, 30, objects)], axis=1)
        obj_xy = start[:2] + offsets
        obj_yaw = rng.uniform(-math.pi, math.pi, objects)
        obj_v = rng.uniform(-3, 3, size=(objects, 2)) * np.array([n not in ("barrier", "traffic_cone") for n in
                                                                  names])[:, None]
        tokens = [token("sample", seed, s, f) for f in range(frames)]
        prev_pose: Optional[np.ndarray] = None
        prev_paths: Dict[str, str] = {}
        for f in range(frames):
            t_us = _T0_US + int(3600e6) * s + 500000 * f
            ego_xyz = start + speed * 0.5 * f * np.array([math.cos(heading), math.sin(heading), 0.0])
            ego_pose = _pose(_rot_z(heading), ego_xyz)  # lidar == ego (identity lidar2ego, as below)
            world_to_lidar = np.linalg.inv(ego_pose)
            xy = obj_xy + obj_v * 0.5 * f
            centers = np.concatenate([xy, np.full((objects, 1), 0.9)], axis=1)
            local = np.concatenate([centers, np.ones((objects, 1))], axis=1) @ world_to_lidar.T
            dims = np.array([_SIZE[n] for n in names])
            local_yaw = obj_yaw - heading
            boxes = np.concatenate([local[:, :3], dims, local_yaw[:, None]], axis=1)
            velo = obj_v @ _rot_z(-heading)[:2, :2].T
            info: Dict[str, Any] = {
                "lidar_path": os.path.join(root, "samples", "LIDAR_TOP", tokens[f] + ".pcd.bin"),
                "token": tokens[f], "prev": tokens[f - 1] if f else "", "next": tokens[f + 1] if f + 1 < frames else "",
                "frame_idx": f, "scene_token": scene, "cams": {},
                "lidar2ego_translation": [0.0, 0.0, 0.0], "lidar2ego_rotation": [1.0, 0.0, 0.0, 0.0],
                "ego2global_translation": ego_xyz.tolist(), "ego2global_rotation": _quat_z(heading),
                "timestamp": t_us,
                "gt_boxes": boxes, "gt_names": np.array(names), "gt_velocity": velo,
                "num_lidar_pts": np.full(objects, 40), "num_radar_pts": np.full(objects, 2),
                "valid_flag": np.ones(objects, dtype=bool),
            }
            bboxes2d, labels2d, centers2d, depths, ignore = [], [], [], [], []
            for name in CAMERAS:
                cam = cams[name]
                boxes_cam, labels_cam, centers_cam, depths_cam = [], [], [], []
                for k in range(objects):
                    pix, depth = _project(_corners(boxes[k]), cam)
                    center, center_depth = _project(boxes[k:k + 1, :3], cam)
                    if (depth < 0.5).any() or center_depth[0] > 60:
                        continue
                    x1, y1 = np.clip(pix.min(0), 0, [width, height])
                    x2, y2 = np.clip(pix.max(0), 0, [width, height])
                    if x2 - x1 < 1 or y2 - y1 < 1:
                        continue
                    boxes_cam.append([x1, y1, x2, y2])
                    labels_cam.append(_NUS_CATEGORIES.index(names[k]))
                    centers_cam.append(center[0])
                    depths_cam.append(center_depth[0])
                bboxes2d.append(np.array(boxes_cam, dtype=np.float32).reshape(-1, 4))
                labels2d.append(np.array(labels_cam, dtype=np.int64))
                centers2d.append(np.array(centers_cam, dtype=np.float32).reshape(-1, 2))
                depths.append(np.array(depths_cam, dtype=np.float32))
                ignore.append(np.zeros((0, 4), dtype=np.float32))
                path = os.path.join(root, "samples", name, f"{tokens[f]}.jpg")
                cv2.imwrite(path, _image(rng, height, width, bboxes2d[-1], labels2d[-1]))
                info["cams"][name] = {
                    "data_path": path, "type": name, "sample_data_token": token("sd", tokens[f], name),
                    "sensor2ego_translation": cam["translation"].tolist(), "sensor2ego_rotation": [1.0, 0, 0, 0],
                    "ego2global_translation": ego_xyz.tolist(), "ego2global_rotation": _quat_z(heading),
                    "timestamp": t_us + 12000 * CAMERAS.index(name),
                    "sensor2lidar_rotation": cam["rotation"], "sensor2lidar_translation": cam["translation"],
                    "cam_intrinsic": cam["intrinsic"],
                }
            if fmt == "streampetr":
                info.update(bboxes2d=bboxes2d, labels2d=labels2d, centers2d=centers2d, depths=depths,
                            bboxes_ignore=ignore, bboxes3d_cams=[np.zeros((len(b), 7), np.float32) for b in bboxes2d],
                            visibilities=[["4"] * len(b) for b in bboxes2d])
                # Lidar sweeps: none on a scene's first key frame (how the dataset tells sequences apart).
                info["sweeps"] = [] if f == 0 else [{
                    "data_path": info["lidar_path"], "type": "lidar", "sample_data_token": token("sweep", tokens[f]),
                    "sensor2lidar_rotation": np.eye(3), "sensor2lidar_translation": np.zeros(3),
                    "timestamp": t_us - 50000}]
            else:
                sweeps = []
                if f > 0 and prev_pose is not None:
                    to_current = world_to_lidar @ prev_pose
                    sweeps.append({name: dict(_petr_sweep_geometry(cams[name], to_current), is_key_frame=True,
                                              data_path=prev_paths[name], type="camera",
                                              timestamp=t_us - 500000 + 12000 * CAMERAS.index(name),
                                              sample_data_token=tokens[f - 1])
                                   for name in CAMERAS})
                info["sweeps"] = sweeps
            prev_pose = ego_pose
            prev_paths = {name: info["cams"][name]["data_path"] for name in CAMERAS}
            infos.append(info)
    name = info_name or ("nuscenes2d_temporal_infos_train.pkl" if fmt == "streampetr"
                         else "mmdet3d_nuscenes_30f_infos_train.pkl")
    path = os.path.join(root, name)
    with open(path, "wb") as fh:
        pickle.dump({"infos": infos, "metadata": {"version": "v1.0-trainval"}}, fh)
    return path
