"""Chaos engineering against a running phalanx: find rank processes through Ray's state
and kill them from outside (`ranks`). Imports Ray, never the serving code."""
