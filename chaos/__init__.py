"""Fault injection against a real run, and the survival report."""
