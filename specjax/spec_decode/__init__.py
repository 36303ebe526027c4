"""Proposers: who guesses the K draft tokens the target verifies."""
