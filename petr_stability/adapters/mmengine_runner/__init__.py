"""The MMEngine runner family: :class:`~.hook.NanGuardHook` over :class:`~.io.MMEngineIO`, the fire drill and MMEngine's
checkpoint allowlist. Imported only where mmengine is installed (:mod:`petr_stability.registry`)."""
