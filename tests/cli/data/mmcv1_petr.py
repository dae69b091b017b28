_base_ = './_base_/mmcv1_petr_base.py'
custom_imports = dict(imports=['projects.mmdet3d_plugin'])
total_epochs = 24
