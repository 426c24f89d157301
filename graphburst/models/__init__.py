"""Models that speak the burst protocol: the stub pair, the torch adapter, Llama and its checkpoints."""
