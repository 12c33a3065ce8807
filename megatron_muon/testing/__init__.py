"""megatron_muon.testing."""
