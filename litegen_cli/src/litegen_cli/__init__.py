"""LiteGen CLI."""
