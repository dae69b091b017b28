"""The MMCV 1.x runner family: :class:`~.hook.NanGuardHook` over :class:`~.io.MMCV1IO` and the fire drill. Imported only
where MMCV 1.x is installed (:mod:`petr_stability.registry`)."""
