"""NVIDIA knowledge, pure: names, MIG geometry, the GPU catalog and the GPU Operator renderings."""
