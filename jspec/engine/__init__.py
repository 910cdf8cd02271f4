"""Serving a stream of requests: continuous batching with speculation (:class:`Engine`),
the spec chosen per occupancy (:mod:`jspec.engine.policy`), streamed output, and a
resumable dataset runner (:mod:`jspec.engine.runner`)."""

from jspec.engine.engine import Completion, Delta, Engine, Request, default_slots
from jspec.engine.policy import Policy

__all__ = ["Completion", "Delta", "Engine", "Policy", "Request", "default_slots"]
