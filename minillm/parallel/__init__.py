"""Past one process: replicas of the engine core (data parallelism) and the ranks of one core (tensor
parallelism, on torch.distributed). docs/parallel.md has the picture."""
