"""The reference engine split over ranks (torch.distributed: NCCL on GPUs, gloo on a CPU).

topology: where each rank sits and what it holds; groups: the process groups a rank talks
through; shard: one rank's part of the model and the engine that runs it. The processes that
run the ranks, and the handle a test drives them with, are handles.rank and handles.parallel.
"""
