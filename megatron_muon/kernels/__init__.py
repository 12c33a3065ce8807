"""megatron_muon.kernels."""
