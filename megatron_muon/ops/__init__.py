"""megatron_muon.ops."""
