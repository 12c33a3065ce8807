"""`python -m megatron_muon.cli ...` is the same as the `megatron-muon` command."""

import sys

from megatron_muon.cli.main import main

sys.exit(main())
