"""torch.distributed without Lightning: engine, profiler, placement, migration, gradients."""
