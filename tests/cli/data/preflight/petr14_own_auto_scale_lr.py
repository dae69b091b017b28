# A child of the PETR config above that says which batch its lr is for: auto_scale_lr written after the lr.
_base_ = './petr14_on_unrelated_schedule.py'
auto_scale_lr = dict(enable=False, base_batch_size=8)
