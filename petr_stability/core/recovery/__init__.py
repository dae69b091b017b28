"""Recovery from a confirmed divergence: the incident chain (:mod:`.chain`), the policy that picks remedies by class
(:mod:`.policy`), the restore points of the run (:mod:`.restore`) and the snapshots behind them (:mod:`.snapshot`)."""
