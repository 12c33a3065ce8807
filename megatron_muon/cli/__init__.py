"""The `megatron-muon` command line (see `megatron_muon.cli.main`)."""
