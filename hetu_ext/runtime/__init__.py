"""Runtime: torch.distributed pieces of a plan (groups, gradient sync), free of any host framework."""
