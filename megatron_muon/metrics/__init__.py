"""megatron_muon.metrics."""
