_base_ = ['./_base_/petr_model.py', './_base_/schedule.py']
custom_imports = dict(imports=['projects.PETR.petr', 'no_such_package.plugin'], allow_failed_imports=False)
default_scope = 'mmdet3d'
# A child override with {{_base_.x}} and a merged dict.
embed = {{_base_.train_cfg.max_epochs}}
model = dict(pts_bbox_head=dict(num_query=600))
optim_wrapper = dict(optimizer=dict(lr=1e-4))
