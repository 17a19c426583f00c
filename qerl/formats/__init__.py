"""Number formats: NVFP4 (E2M1 values, FP8-E4M3 block scales, FP32 global scale), and the
compressed-tensors checkpoint files that hold it (nvfp4_checkpoint)."""
