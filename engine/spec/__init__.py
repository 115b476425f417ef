"""Speculative decoding (DESIGN §8): drafters propose, the target verifies in the continuous batch."""
