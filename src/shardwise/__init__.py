"""shardwise: train a PyTorch model on many processes as simply as on one."""

__version__ = "0.1.0"
