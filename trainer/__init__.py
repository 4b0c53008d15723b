"""The DeepSpeed integration that training scripts import."""
