"""The runtime: process setup (``distributed``), the ``prepare`` pipeline and the LiteGen facade."""
