"""megatron_muon.optimizer."""
