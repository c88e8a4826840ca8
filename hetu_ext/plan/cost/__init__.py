"""What a plan costs: per-stage time and memory from the inventory, the step model, device profiles, predict."""
