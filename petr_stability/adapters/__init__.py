"""Thin runner adapters: one per runner family, each translating runner internals for the core guard."""
