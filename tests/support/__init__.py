"""What tests share beyond fixtures: the worker harness, the API stand-in, drivers for multi-step work."""
