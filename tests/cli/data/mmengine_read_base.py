# MMEngine pure-Python style (lazy import): inheritance through `with read_base()`.
from mmengine.config import read_base

with read_base():
    from ._base_.petr_model import *  # noqa: F403
    from ._base_.schedule import *  # noqa: F403

optim_wrapper.update(dict(optimizer=dict(lr=4e-4)))  # noqa: F405
