"""megatron_muon.training."""
