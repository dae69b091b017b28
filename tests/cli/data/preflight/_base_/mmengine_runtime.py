# mmdet3d 1.x configs/_base_/default_runtime.py, shortened.
default_scope = 'mmdet3d'
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(type='CheckpointHook', interval=-1))
log_level = 'INFO'
load_from = None
resume = False
