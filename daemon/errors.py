"""Errors of the rendezvous daemon.

The round state machine itself never raises for bad input (unknown nodes, duplicate or malformed
events are logged and ignored); these errors are for bad configuration and for bugs.
"""

from __future__ import annotations


class DaemonError(Exception):
    """Base of every error raised by ``stalwart.daemon``."""


class PolicyError(DaemonError, ValueError):
    """A round policy is invalid: a field has the wrong type or value, fields contradict each
    other, or a mapping names an unknown key. The message names the field and echoes the value."""


class TransitionError(DaemonError, RuntimeError):
    """A node state change that the transition table forbids. Raised only on a bug in the state
    machine, never because of an event's content."""
