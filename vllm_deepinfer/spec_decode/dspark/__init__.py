"""DSpark speculative decoding: the proposer drafting with V4.1's DSpark stages, its gate,
cost model and calibration, and its stats on the way to the scheduler."""
