# An MMCV 1.x config with the fire drill left on and a batch size the run overrides.
_base_ = './_base_/mmcv1_petr_base.py'
data = dict(samples_per_gpu=4, workers_per_gpu=4)
custom_hooks = [
    dict(type='NanGuardHook'),
    dict(type='FaultInjectionHook', faults=[dict(kind='weights', iters=[30])]),
]
