"""The node agent: supervises a node's workers and GPUs."""
