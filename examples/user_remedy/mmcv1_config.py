"""examples/mmcv1/config.py with two remedies of your own switched on, and a fire drill that makes it act.

Run it (from the repository root):
    python examples/mmcv1/train.py examples/user_remedy/mmcv1_config.py --work-dir work_dirs/beta2
The drill puts NaN into the weights at iteration 12: a divergence the replay classes as training dynamics, so the
ladder's first rung acts (the known manual fix (transformer dropout 0, max_norm 1)) and, beside it, these remedies
(Adam's beta2 to 0.95, an absolute target; the weight decay x 0.5, a relative one). docs/remedies.md says what to
look for in the log, the incident log and the patched config.
"""
import sys

if '{{ fileDirname }}' not in sys.path:
    sys.path.append('{{ fileDirname }}')  # the remedies are files next to this config (your package, in a project)

_base_ = ['../mmcv1/config.py']

custom_imports = dict(imports=['petr_stability', 'toy_detector', 'beta2_remedy', 'decay_remedy'],
                      allow_failed_imports=False)
custom_hooks = [
    # remedies= entries add to the defaults: beta2 and decay switched on, beside the built-ins, with their settings.
    dict(type='NanGuardHook', remedies=[dict(type='beta2', beta2_target=0.95), dict(type='decay', decay_factor=0.5)]),
    # The fire drill: NaN written into the weights twice. The first divergence is rolled back alone (no step put
    # the NaN there, nothing was unstable before it); the second climbs the ladder, and these remedies act.
    dict(type='FaultInjectionHook', faults=[dict(kind='weights', iters=[12, 14], value='nan')]),
]
