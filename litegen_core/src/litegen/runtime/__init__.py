"""The runtime: process setup (``distributed``), the LiteGen facade and the steps its ``prepare`` takes with each model."""
