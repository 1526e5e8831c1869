"""Shared plumbing: the mask contract, shape caches, the CPU worker pool, log-once, argument checks, transformers
version differences. Imports nothing else of the package."""
