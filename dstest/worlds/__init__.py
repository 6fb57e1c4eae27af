"""Worlds run a function on every rank of a simulated or real process group (see protocol.World)."""
