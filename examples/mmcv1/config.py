"""A minimal MMCV 1.x config with NanGuardHook: a toy detector that trains on the CPU in a few seconds.

Run it (from the repository root):  python examples/mmcv1/train.py examples/mmcv1/config.py
The two lines under "NanGuardHook" below are the README's; everything else is an ordinary mmdet 2.x / mmdet3d 0.x
config (model, data, optimizer, schedule, runtime), as PETR's and StreamPETR's are.
"""
import sys

# The toy model is a file next to this config, not an installed package: put this folder on sys.path so that
# custom_imports finds 'toy_detector' whoever reads the config. A real project's model is importable already
# (mmdet3d installed; PETR and StreamPETR import their plugin folder from the repository root) and needs no such line.
# Appended, not inserted first: MMCV 1.x imports the config with its temp dir put first on sys.path and pops
# sys.path[0] afterwards, which would take this entry away instead.
if '{{ fileDirname }}' not in sys.path:
    sys.path.append('{{ fileDirname }}')

# ---- NanGuardHook: the README's two lines. 'toy_detector' (this example's model) sits next to 'petr_stability'
# as your project's own module would.
custom_imports = dict(imports=['petr_stability', 'toy_detector'], allow_failed_imports=False)
custom_hooks = [dict(type='NanGuardHook')]

# ---- model and data
model = dict(type='ToyDetector', num_classes=3, embed_dims=32, num_queries=8, dropout=0.1)
data = dict(
    # One sample per GPU, as PETR trains. It also lets the guard quarantine exactly the sample that broke a step:
    # it can only name a whole batch, and at most 0.1% of the dataset (at least 1 sample).
    samples_per_gpu=1,
    workers_per_gpu=0,  # the samples are made in memory; worker processes would only add start-up time
    # bad_sample=I makes sample I a corrupt image (NaN pixels); train.py --bad-sample I sets it.
    train=dict(type='ToyDetDataset', num_samples=32, bad_sample=None))

# ---- optimizer and schedule
optimizer = dict(type='AdamW', lr=2e-3, weight_decay=0.01)
# fp32: MMCV's Fp16OptimizerHook builds torch.cuda.amp.GradScaler, which disables itself without a GPU, so the CPU
# run trains in fp32 (the guard then skips a step with a non-finite gradient before it is applied). On a GPU, fp16
# as PETR trains is one more line; train.py then builds Fp16OptimizerHook(**optimizer_config, **fp16), as
# mmdet's train_detector does:
#   fp16 = dict(loss_scale='dynamic')      (PETR: loss_scale=512.; or --cfg-options fp16.loss_scale=dynamic)
optimizer_config = dict(grad_clip=dict(max_norm=35, norm_type=2))  # PETR's clip; the guard tightens it only on need
lr_config = dict(policy='CosineAnnealing', warmup='linear', warmup_iters=16, warmup_ratio=1.0 / 3, min_lr_ratio=1e-3)
runner = dict(type='EpochBasedRunner', max_epochs=3)

# ---- runtime
checkpoint_config = dict(interval=1, max_keep_ckpts=2)
log_config = dict(interval=8, hooks=[dict(type='TextLoggerHook')])
workflow = [('train', 1)]
log_level = 'INFO'
seed = 0
load_from = None
resume_from = None
