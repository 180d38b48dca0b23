"""GPU support (CuPy glue); filled in by the nccl backend work."""
