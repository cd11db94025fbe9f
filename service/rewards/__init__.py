"""Rewards on the API side: registered reward functions, their references and fields, and reward tests run in a subprocess."""
