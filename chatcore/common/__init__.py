"""What every layer shares: domain errors, session ids, server frame shapes and the sender.

A leaf: it imports nothing of the project, so models, services and selectors can use it
without importing the engine (STYLE 15; the contract is in pyproject.toml).
"""
