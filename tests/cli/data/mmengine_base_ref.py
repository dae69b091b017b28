# mmdet 3.x style: a value computed from a _base_ value (`_base_.x` reference, not `{{_base_.x}}`).
_base_ = ['./_base_/petr_model.py', './_base_/schedule.py']
optim_wrapper = dict(optimizer=dict(lr=_base_.optim_wrapper.optimizer.lr * 2))
train_cfg = dict(max_epochs=_base_.train_cfg.max_epochs // 2)
