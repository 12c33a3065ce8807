"""megatron_muon.distributed."""
