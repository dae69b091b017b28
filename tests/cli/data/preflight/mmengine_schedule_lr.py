# An MMEngine config that trains at the schedule file's own lr: that file's auto_scale_lr is the lr's batch.
_base_ = ['./_base_/mmengine_nus_3d.py', './_base_/mmengine_runtime.py', './_base_/mmengine_cyclic_20e.py']
model = dict(type='PETR', pts_bbox_head=dict(type='PETRHead', num_query=900))
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3))
