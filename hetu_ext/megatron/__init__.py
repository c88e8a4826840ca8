"""The Megatron-core adapter: the only package that imports megatron."""
