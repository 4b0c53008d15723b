"""The rendezvous daemon: decides which nodes form each round."""
