"""megatron_muon.layers."""
