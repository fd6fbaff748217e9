"""Speculative decoding: drafters, verification rules and the decode loop."""
