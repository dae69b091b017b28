_base_ = './_base_/mmcv1_petr_base.py'
optimizer_config = dict(grad_clip=dict(max_norm=0.5, norm_type=2))
