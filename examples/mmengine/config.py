"""A minimal MMEngine config with NanGuardHook: a toy detector that trains on the CPU in a few seconds.

Run it (from the repository root):  python examples/mmengine/train.py examples/mmengine/config.py
The two lines under "NanGuardHook" below are the README's; everything else is an ordinary MMEngine config, laid
out as mmdet3d 1.x's (model, data, optimizer, schedule, runtime).
"""
import sys

# The toy model is a file next to this config, not an installed package: put this folder on sys.path so that
# custom_imports finds 'toy_detector' whichever train script reads the config. A real project's model is
# importable already (mmdet3d installed, or its projects/ folder on PYTHONPATH) and needs no such line.
# Appended, not inserted first: MMCV 1.x imports the config with its temp dir put first on sys.path and pops
# sys.path[0] afterwards, which would take this entry away instead.
if '{{ fileDirname }}' not in sys.path:
    sys.path.append('{{ fileDirname }}')

# ---- NanGuardHook: the README's two lines. 'toy_detector' (this example's model) sits next to 'petr_stability'
# as your project's own module does (mmdet3d 1.x PETR: imports=['projects.PETR.petr', 'petr_stability']).
custom_imports = dict(imports=['petr_stability', 'toy_detector'], allow_failed_imports=False)
custom_hooks = [dict(type='NanGuardHook')]

# ---- model and data
model = dict(type='ToyDetector', num_classes=3, embed_dims=32, num_queries=8, dropout=0.1)
train_dataloader = dict(
    # One sample per GPU, as PETR trains (samples_per_gpu=1). It also lets the guard quarantine exactly the sample
    # that broke a step: it can only name a whole batch, and at most 0.1% of the dataset (at least 1 sample).
    batch_size=1,
    num_workers=0,  # the samples are made in memory; worker processes would only add start-up time
    sampler=dict(type='DefaultSampler', shuffle=True),
    collate_fn=dict(type='default_collate'),
    # bad_sample=I makes sample I a corrupt image (NaN pixels); train.py --bad-sample I sets it.
    dataset=dict(type='ToyDetDataset', num_samples=32, bad_sample=None))

# ---- optimizer and schedule
# fp32: MMEngine's AmpOptimWrapper asserts a GPU, so the CPU run trains in fp32 (the guard then skips a step
# with a non-finite gradient before it is applied). On a GPU, fp16 as PETR trains is:
#   optim_wrapper = dict(type='AmpOptimWrapper', loss_scale='dynamic', optimizer=..., clip_grad=...)
# (or --cfg-options optim_wrapper.type=AmpOptimWrapper optim_wrapper.loss_scale=dynamic).
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-3, weight_decay=0.01),
    clip_grad=dict(max_norm=35, norm_type=2))  # PETR's clip; the guard tightens it to 1 only if training diverges
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=16)]
train_cfg = dict(by_epoch=True, max_epochs=3)

# ---- runtime
default_scope = 'mmengine'  # mmdet3d 1.x configs say 'mmdet3d'; the guard registers with MMEngine's root HOOKS
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=8),
    checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=2))
log_processor = dict(by_epoch=True)
randomness = dict(seed=0)
log_level = 'INFO'
