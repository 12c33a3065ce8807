"""megatron_muon.cli."""
