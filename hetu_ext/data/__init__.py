"""Data: pure (no torch.distributed, no host framework): tokenizer, sample assignment to pipelines."""
