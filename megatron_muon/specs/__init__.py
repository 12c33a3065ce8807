"""megatron_muon.specs."""
